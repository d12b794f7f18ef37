"""A DKIM key the relay cannot use stops ``mta serve`` in one line naming the domain and the file, no spool made.

Exit 2 when the config names a file that is no usable key (missing, not a
key, encrypted, the wrong algorithm), exit 1 when the key is open to other
users (as for the TLS key: docs/security.md, "DKIM signing"). The real
``mta serve`` as a subprocess, as tests/security/test_security_start.py does.
"""

from __future__ import annotations

import base64
import re
import subprocess
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from process_support import run_mta


def write(tmp_path: Path, key_file: Path, processes: int = 1) -> Path:
    path = tmp_path / "relay.toml"
    path.write_text(f'[server]\nhostname = "relay.test"\nlisten = ["127.0.0.1:0"]\nprocesses = {processes}\n'
                    f'[spool]\ndir = "spool"\n[[dkim.key]]\ndomain = "example.com"\nselector = "s1"\n'
                    f'key_file = "{key_file}"\n')
    return path


def refused(config: Path, code: int, problem: str, *command: str) -> str:
    """The command exits ``code`` with one line: the config, the key's setting, domain, selector, file, problem."""
    run: subprocess.CompletedProcess[str] = run_mta(*(command or ("serve",)), "--config", str(config),
                                                    cwd=config.parent)
    assert run.returncode == code, run.stderr
    assert "Traceback" not in run.stderr and run.stdout == ""
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    key = config.parent / "s1.key"
    assert re.fullmatch(rf"mta: {re.escape(str(config))}: dkim\.key\[0\]: the key of example\.com \(selector s1\)"
                        rf"(?: in {re.escape(str(key))})?: .*{problem}.*", lines[0]), lines[0]
    assert str(key) in lines[0]
    assert not (config.parent / "spool").exists()
    return lines[0]


def pem(key: rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey,
        encryption: serialization.KeySerializationEncryption | None = None) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             encryption or serialization.NoEncryption())


def key_file(tmp_path: Path, data: bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "s1.key"
    path.write_bytes(data)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("processes", [1, 2])
def test_a_missing_key_file_is_one_line_and_exit_2(tmp_path: Path, processes: int) -> None:
    refused(write(tmp_path, tmp_path / "s1.key", processes), 2, "cannot read it: No such file or directory")


@pytest.mark.parametrize(("data", "problem"), [
    (b"not a key at all\n", "neither PEM nor the base64 of an Ed25519 key"),
    (b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", "not a PEM private key it can read"),
    (pem(ed25519.Ed25519PrivateKey.generate(), serialization.BestAvailableEncryption(b"pw")), "is encrypted"),
    (pem(ec.generate_private_key(ec.SECP256R1())), "DKIM signs with RSA or Ed25519"),
], ids=["text", "bad-pem", "encrypted", "ecdsa"])
def test_a_key_that_cannot_sign_is_one_line_and_exit_2(tmp_path: Path, data: bytes, problem: str) -> None:
    config = write(tmp_path, key_file(tmp_path, data))
    line = refused(config, 2, re.escape(problem))
    assert refused(config, 2, re.escape(problem), "config", "check") == line  # mta config check says the same


def test_a_key_open_to_other_users_is_one_line_and_exit_1(tmp_path: Path) -> None:
    key = key_file(tmp_path, pem(ed25519.Ed25519PrivateKey.generate()), 0o644)
    refused(write(tmp_path, key), 1, r"open to other users \(mode 0644\); chmod 600 it")


def test_keys_in_every_form_operators_have_are_read(tmp_path: Path) -> None:
    """PKCS#1 and PKCS#8 RSA, PKCS#8 Ed25519 and dkimpy's base64 Ed25519: ``mta dkim records`` reads each."""
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ed_key = ed25519.Ed25519PrivateKey.generate()
    forms = {
        "pkcs1": rsa_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                       serialization.NoEncryption()),
        "pkcs8-rsa": pem(rsa_key),
        "pkcs8-ed25519": pem(ed_key),
        "base64-ed25519": base64.b64encode(ed_key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())) + b"\n",
    }
    for form, data in forms.items():
        config = write(tmp_path, key_file(tmp_path, data))
        run = run_mta("dkim", "records", "--config", str(config), cwd=tmp_path)
        assert run.returncode == 0, (form, run.stderr)
        kind = "ed25519" if "ed25519" in form else "rsa"
        assert re.fullmatch(rf's1\._domainkey\.example\.com\. 3600 IN TXT "v=DKIM1; k={kind}; p=[^"]+"( "[^"]+")*\n',
                            run.stdout), (form, run.stdout)
