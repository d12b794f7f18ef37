"""What a client's verified certificate says, in the forms Postfix hands milters and policy servers.

Postfix's names: the subject's and the issuer's common name
(``{cert_subject}``, ``{cert_issuer}``; ``ccert_subject``, ``ccert_issuer``;
an issuer without one is named by its organization, as Postfix does),
and the SHA-256 digests of the whole certificate and of its public key (its
DER SubjectPublicKeyInfo), in upper-case hex pairs joined by colons
(``ccert_fingerprint``, ``ccert_pubkey_fingerprint``; Postfix's
``smtpd_tls_fingerprint_digest = sha256``, its default since 3.6).
"""

from __future__ import annotations

import hashlib
from typing import Any

import attrs
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from cryptography.x509.oid import NameOID


@attrs.frozen
class ClientCert:
    subject: str
    issuer: str
    fingerprint: str
    pubkey_fingerprint: str


def _name(name: x509.Name, *oids: x509.ObjectIdentifier) -> str:
    for oid in oids:
        names = name.get_attributes_for_oid(oid)
        if names:
            value = names[0].value
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return ""


def _digest(data: bytes) -> str:
    return ":".join(f"{b:02X}" for b in hashlib.sha256(data).digest())


def client_cert(stream: Any) -> ClientCert | None:
    """The certificate of a ``trio.SSLStream`` whose handshake is done; None: the client sent none.

    Only a context that asks (``[client_certs] ca_file``) gets one, and then only a verified one.
    """
    der = stream.getpeercert(binary_form=True)
    if der is None:
        return None
    cert = x509.load_der_x509_certificate(der)
    spki = cert.public_key().public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    return ClientCert(_name(cert.subject, NameOID.COMMON_NAME),
                      _name(cert.issuer, NameOID.COMMON_NAME, NameOID.ORGANIZATION_NAME), _digest(der), _digest(spki))
