"""What a TLS session turned out to be, read once after its handshake.

Both directions log it (``event=tls``) and the inbound side writes it into the
``Received:`` header, as Postfix does: ``(using TLSv1.3 with cipher
TLS_AES_256_GCM_SHA384 (256/256 bits))``. Python's ``cipher()`` gives the
secret bits only; Postfix's second number is the algorithm's bits, which
differ only for the export ciphers that no TLS 1.2+ library negotiates any
more, so the one number is written twice.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class TlsInfo:
    """``peer_cert``: ``none`` (none was asked for, or none sent), ``unverified`` (sent, not checked), or
    ``verified`` (chain and host name checked)."""

    protocol: str
    cipher: str
    bits: int
    peer_cert: str = "none"

    @property
    def verified(self) -> bool:
        return self.peer_cert == "verified"

    def using(self) -> str:
        """The ``Received:`` comment: ``using TLSv1.3 with cipher NAME (256/256 bits)``."""
        return f"using {self.protocol} with cipher {self.cipher} ({self.bits}/{self.bits} bits)"

    def fields(self) -> dict[str, str | int | bool]:
        """The log fields: protocol, cipher, bits, peer_cert, verified."""
        return {"protocol": self.protocol, "cipher": self.cipher, "bits": self.bits, "peer_cert": self.peer_cert,
                "verified": self.verified}


def tls_info(stream: Any, *, verified: bool = False) -> TlsInfo:
    """The session of a ``trio.SSLStream`` (or ``ssl.SSLObject``) whose handshake is done.

    ``verified``: the context checked the peer's certificate (a client that
    required it); otherwise a certificate the peer sent is ``unverified``.
    """
    name, _version, bits = stream.cipher() or ("unknown", "", 0)
    has_cert = stream.getpeercert(binary_form=True) is not None
    peer = "verified" if verified and has_cert else "unverified" if has_cert else "none"
    return TlsInfo(protocol=stream.version() or "unknown", cipher=name, bits=int(bits or 0), peer_cert=peer)
