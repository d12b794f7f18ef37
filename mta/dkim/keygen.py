"""New DKIM key pairs: the private key in a file of its own (mode 0600) and the TXT record that publishes it.

RSA keys are 2048 bits by default (RFC 8301: at least 1024, and 2048 is
what it recommends; larger keys make records some DNS hosting panels refuse)
and written as PKCS#1 PEM, the form OpenDKIM and
dkimpy read too. Ed25519 keys (RFC 8463) are written as PKCS#8 PEM, as
``openssl genpkey -algorithm ed25519`` does. A key file is never
overwritten: rotation means a new selector, so an existing file is a
mistake (or the key still published), and the command stops.
"""

from __future__ import annotations

import os

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from mta.dkim.keys import SigningKey, dns_record, signing_key

__all__ = ["KEY_TYPES", "KeyPair", "generate", "write_key_pair"]

KEY_TYPES = ("rsa", "ed25519")
RSA_BITS = 2048


class KeyPair:
    """What ``write_key_pair`` wrote: the key file, the record file, and the record's zone-file line."""

    def __init__(self, key_file: str, record_file: str, record: str, key: SigningKey) -> None:
        self.key_file = key_file
        self.record_file = record_file
        self.record = record
        self.key = key


def generate(kind: str, bits: int = RSA_BITS) -> rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey:
    if kind == "rsa":
        return rsa.generate_private_key(public_exponent=65537, key_size=bits)
    if kind == "ed25519":
        return ed25519.Ed25519PrivateKey.generate()
    raise ValueError(f"key type {kind!r}: one of {', '.join(KEY_TYPES)}")


def pem(key: rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey) -> bytes:
    form = serialization.PrivateFormat.TraditionalOpenSSL if isinstance(key, rsa.RSAPrivateKey) \
        else serialization.PrivateFormat.PKCS8
    return key.private_bytes(serialization.Encoding.PEM, form, serialization.NoEncryption())


def _write_new(path: str, data: bytes, mode: int) -> None:
    """Create ``path`` (never replace it) with ``mode``, write and fsync ``data``.

    Raises FileExistsError if it exists, OSError for anything else.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # whatever the umask
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_key_pair(domain: str, selector: str, kind: str, directory: str, bits: int = RSA_BITS) -> KeyPair:
    """Generate a key and write ``DIR/DOMAIN.SELECTOR.key`` (0600) and ``DIR/DOMAIN.SELECTOR.txt`` (the record).

    Raises:
        FileExistsError: either file exists (nothing is written).
        OSError: the directory cannot be written.
    """
    base = os.path.join(directory, f"{domain}.{selector}")
    key_file, record_file = base + ".key", base + ".txt"
    for path in (key_file, record_file):
        if os.path.lexists(path):
            raise FileExistsError(f"{path} exists; a new key takes a new selector (rotation), "
                                  "and an existing key is never overwritten")
    private = generate(kind, bits)
    key = signing_key(private, domain, selector)
    record = dns_record(key.name, key.record_text())
    _write_new(key_file, pem(private), 0o600)
    _write_new(record_file, (record + "\n").encode(), 0o644)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return KeyPair(key_file, record_file, record, key)
