"""DKIM in tests: keys made by the real ``mta dkim keygen``, published by ``dns_server.DnsServer``, and dkimpy's
verifier fetching them over DNS from 127.0.0.1 (docs/security.md, "DKIM signing").

    key = keygen(tmp, "example.com", "rsa2026", "rsa")
    publish(dns, key.record)
    cfg = relay_config(..., extra=key_config(key))
    assert await verified(message_bytes, dns_port) == [True]
"""

from __future__ import annotations

import email
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import attrs
import dkim
import dns.rdatatype
import dns.resolver
import trio
from dns_server import DnsServer
from process_support import run_mta


@attrs.frozen
class Key:
    domain: str
    selector: str
    file: Path
    record: str  # the zone-file line keygen printed


def keygen(where: Path, domain: str, selector: str, kind: str) -> Key:
    """A key pair made by ``mta dkim keygen DOMAIN SELECTOR --type KIND`` in ``where``, its file private."""
    run = run_mta("dkim", "keygen", domain, selector, "--type", kind, "--dir", str(where), cwd=where)
    assert run.returncode == 0, run.stderr
    (line,) = run.stdout.splitlines()
    key_file = where / f"{domain}.{selector}.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert str(key_file) in run.stderr  # the config lines to add name the file
    return Key(domain, selector, key_file, line)


def publish(server: DnsServer, record: str) -> None:
    """Serve a zone-file line ``NAME TTL IN TXT "..." ...`` as keygen printed it."""
    name, _ttl, klass, rtype, rdata = record.split(None, 4)
    assert (klass, rtype) == ("IN", "TXT")
    server.txt_record(name, rdata)


def dns_lookup(port: int) -> Callable[..., bytes | None]:
    """dkimpy's ``dnsfunc``: a real TXT query to the test's DNS server (blocking: call dkimpy in a thread)."""
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = ["127.0.0.1"]
    resolver.port = port
    resolver.lifetime = 10

    def txt(name: bytes, timeout: int = 5) -> bytes | None:
        try:
            answer = resolver.resolve(name.decode(), dns.rdatatype.TXT)
        except dns.resolver.NXDOMAIN:
            return None
        return b"".join(next(iter(answer)).strings)

    return txt


def key_config(*keys: Key, active: bool = True) -> str:
    """``[[dkim.key]]`` tables for ``keys``."""
    return "".join(f'[[dkim.key]]\ndomain = "{k.domain}"\nselector = "{k.selector}"\nkey_file = "{k.file}"\n'
                   f"active = {'true' if active else 'false'}\n" for k in keys)


def signatures(data: bytes) -> list[str]:
    return email.message_from_bytes(data).get_all("DKIM-Signature") or []


def tag(signature: str, name: str) -> str:
    match = re.search(rf"(?:^|;)\s*{name}=([^;]*)", signature)
    assert match, signature
    return "".join(match.group(1).split())


async def verified(data: bytes, port: int) -> list[bool]:
    """Each DKIM-Signature of ``data``, verified by dkimpy with the key fetched over DNS."""
    lookup = dns_lookup(port)

    def one(d: dkim.DKIM, i: int) -> bool:
        try:
            return bool(d.verify(idx=i, dnsfunc=lookup))
        except dkim.ValidationError:  # a body hash mismatch is raised, not returned
            return False

    def check() -> list[bool]:
        d = dkim.DKIM(data)
        return [one(d, i) for i in range(len(signatures(data)))]

    return await trio.to_thread.run_sync(check)


def opendkim_verdicts(data: bytes, records: dict[str, str], where: Path) -> list[str]:
    """Each DKIM-Signature of ``data`` as Debian's ``opendkim`` judges it: ``pass``, ``fail``, ... in header order.

    ``opendkim -t`` runs the daemon's own verifier (its library and its
    configuration) on one message; ``TestDNSData`` gives it ``records``
    (``NAME`` -> TXT text) instead of a resolver. The verdicts are read from
    the Authentication-Results field it would add, one ``dkim=`` per signature.
    """
    where.mkdir(parents=True, exist_ok=True)
    keys, conf, msg = where / "keys.txt", where / "verify.conf", where / "message.eml"
    keys.write_text("".join(f"{name} {text}\n" for name, text in records.items()))
    conf.write_text(f"Syslog no\nMode v\nBackground no\nTestDNSData file:{keys}\nAlwaysAddARHeader yes\n")
    msg.write_bytes(data)
    run = subprocess.run(["opendkim", "-x", str(conf), "-vv", "-t", str(msg)], capture_output=True, timeout=60,
                         check=False)
    out = run.stdout.decode(errors="replace") + run.stderr.decode(errors="replace")
    assert run.returncode == 0, out
    match = re.search(r"hname='Authentication-Results' hvalue='(.*?)'", out, re.DOTALL)
    assert match, out
    return re.findall(r"\bdkim=(\w+)", match.group(1))
