"""``[client_certs]``: client certificates on the inbound listeners, for the filters and policy servers to read.

Why a CA file and no "ask but do not verify": Python's TLS server cannot take
a certificate it does not verify (OpenSSL's verify callback is not offered),
so asking means verifying. A client that sends no certificate is served as
before; one whose certificate does not verify against ``ca_file`` fails the
handshake. The certificate of a client that verified is what milters see as
``{cert_subject}`` and ``{cert_issuer}`` and policy servers as ``ccert_*``
(docs/operations.md, "Client certificates").
"""

from __future__ import annotations

import attrs

from mta.config.values import ReadableFile
from spool import Optional, setting

__all__ = ["ClientCertsSection"]


@attrs.frozen(kw_only=True)
class ClientCertsSection:
    """``[client_certs]``: docs/operations.md, "Client certificates"."""

    ca_file: str | None = setting(
        Optional(ReadableFile()), "PEM CA certificates: with it, TLS clients on every listener are asked for a "
        "certificate, verified against these (one that does not verify fails the handshake; none is fine), and "
        "its names and fingerprints go to the milters and policy servers; not set: no certificate is asked for",
        None)
