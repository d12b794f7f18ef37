"""The listeners' TLS context, built from ``[server]`` at start and again at each reload."""

from __future__ import annotations

import ssl

from mta.config import Config


def ssl_context(config: Config) -> ssl.SSLContext | None:
    s = config.server
    if not s.tls_cert or not s.tls_key:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # Client-initiated renegotiation costs the server a handshake per request (a cheap DoS) and buys nothing.
    ctx.options |= ssl.OP_NO_RENEGOTIATION
    ctx.load_cert_chain(s.tls_cert, s.tls_key)
    if config.client_certs.ca_file is not None:  # mta.config.client_certs: asking means verifying
        ctx.verify_mode = ssl.CERT_OPTIONAL
        ctx.load_verify_locations(cafile=config.client_certs.ca_file)
    return ctx
