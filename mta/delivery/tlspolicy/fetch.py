"""Fetching an MTA-STS policy: ``GET https://mta-sts.DOMAIN/.well-known/mta-sts.txt`` (RFC 8461 §3.3).

Why not a general HTTP client: the host's address must come from the
relay's resolver (``[delivery] resolver``, as every other delivery lookup),
redirects must not be followed, and the answer is bounded (64 KiB, RFC 8461
suggests no more). So the relay connects itself, over trio, checks the
certificate against the system's CAs plus ``[delivery] tls_ca_file`` for the
name ``mta-sts.DOMAIN``, and lets h11 (a sans-IO HTTP/1.1 parser, as our SMTP
cores are) read the answer: chunked or not, it is h11 that parses it.
"""

from __future__ import annotations

import ssl

import dns.asyncresolver
import dns.exception
import h11
import trio

from mta.delivery import mx

MAX_POLICY = 64 * 1024
PATH = "/.well-known/mta-sts.txt"


class FetchError(Exception):
    """The policy could not be fetched; ``result`` is TLS-RPT's result type for it."""

    def __init__(self, message: str, result: str = "sts-policy-fetch-error") -> None:
        super().__init__(message)
        self.result = result


def _context(ca_file: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca_file:
        ctx.load_verify_locations(cafile=ca_file)
    return ctx


async def fetch_policy(resolver: dns.asyncresolver.Resolver, domain: str, port: int = 443,
                       ca_file: str | None = None) -> str:
    """The policy text of ``domain``. The caller bounds the time. Raises FetchError."""
    host = f"mta-sts.{domain}"
    try:
        found = await mx.addresses(resolver, host)
    except dns.exception.DNSException as exc:
        raise FetchError(f"cannot resolve {host}: {exc}") from None
    if not found:
        raise FetchError(f"{host} has no address")
    ctx = _context(ca_file)
    problems: list[str] = []
    for address in found:
        try:
            stream = await trio.open_tcp_stream(address, port)
        except OSError as exc:
            problems.append(f"connect to {host}[{address}]:{port}: {exc.strerror or exc}")
            continue
        tls = trio.SSLStream(stream, ctx, server_hostname=host, https_compatible=True)
        try:
            try:
                await tls.do_handshake()
            except (trio.BrokenResourceError, ssl.SSLError) as exc:
                cause = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) else exc
                if isinstance(cause, ssl.SSLCertVerificationError):
                    raise FetchError(f"certificate of {host}: {cause.verify_message}", "sts-webpki-invalid") from None
                problems.append(f"TLS with {host}[{address}]:{port}: {cause}")
                continue
            return await _get(tls, host if port == 443 else f"{host}:{port}")
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            problems.append(f"{host}[{address}]:{port}: connection lost: {exc}")
        finally:
            await trio.aclose_forcefully(tls)
    raise FetchError("; ".join(problems))


async def _get(stream: trio.abc.Stream, host_header: str) -> str:
    conn = h11.Connection(h11.CLIENT)
    request = h11.Request(method="GET", target=PATH, headers=[
        ("Host", host_header), ("User-Agent", "logspool"), ("Accept", "text/plain"), ("Connection", "close")])
    await stream.send_all(conn.send(request) + (conn.send(h11.EndOfMessage()) or b""))
    body = bytearray()
    try:
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                conn.receive_data(bytes(await stream.receive_some(65536)))
            elif isinstance(ev, h11.Response):
                if ev.status_code != 200:  # RFC 8461 §3.3: redirects are not followed
                    raise FetchError(f"https://{host_header}{PATH} answered HTTP {ev.status_code}")
                kind = dict(ev.headers).get(b"content-type", b"").split(b";")[0].strip().lower()
                if kind != b"text/plain":
                    raise FetchError(f"the policy is served as {kind.decode('latin-1')[:60]!r}, not text/plain",
                                     "sts-policy-invalid")
            elif isinstance(ev, h11.Data):
                body += ev.data
                if len(body) > MAX_POLICY:
                    raise FetchError(f"the policy is larger than {MAX_POLICY} bytes", "sts-policy-invalid")
            elif isinstance(ev, h11.EndOfMessage):
                break
            elif isinstance(ev, h11.ConnectionClosed):
                raise FetchError("the connection closed before the end of the answer")
    except h11.RemoteProtocolError as exc:
        raise FetchError(f"not an HTTP answer: {exc}") from None
    try:
        return bytes(body).decode("utf-8")
    except UnicodeDecodeError:
        raise FetchError("the policy is not UTF-8", "sts-policy-invalid") from None
