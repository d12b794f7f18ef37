"""A validating resolver for tests: unbound on 127.0.0.1, serving zones the test writes, one of them signed.

The signed zone is signed with ldns-keygen and ldns-signzone (Debian's
ldnsutils) and its key is unbound's only trust anchor, so answers from it
carry the AD bit and answers from the unsigned zones do not (insecure: no
anchor covers them). unbound loads each zone as an ``auth-zone`` used for
its own lookups (``for-upstream``), so its validator checks the signatures
as it would for data from the network. Nothing leaves the host: root hints
name 127.0.0.9, where nothing listens, and ``test.`` is not one of unbound's
default blocked zones here. Each test gets its own config directory and
port; the process is killed at the end by its pid.

    async with unbound(tmp_path, {"dane.test": signed_records}, {"plain.test": records}) as port: ...
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import dns.asyncresolver
import dns.exception
import dns.flags
import trio

HEADER = "$TTL 300\n@ IN SOA ns admin 1 3600 600 86400 300\n@ IN NS ns\nns IN A 127.0.0.1\n"


def have_unbound() -> bool:
    return all(shutil.which(tool) for tool in ("unbound", "ldns-keygen", "ldns-signzone"))


def _zone(directory: Path, origin: str, records: Sequence[str]) -> Path:
    path = directory / f"{origin}.zone"
    path.write_text(f"$ORIGIN {origin}.\n" + HEADER + "\n".join(records) + "\n")
    return path


def _sign(directory: Path, origin: str, zone: Path) -> tuple[Path, Path]:
    """The signed zone file and the key file (the trust anchor)."""
    key = subprocess.run(["ldns-keygen", "-a", "ECDSAP256SHA256", "-k", origin], cwd=directory, check=True,
                         capture_output=True, text=True, timeout=60).stdout.strip()
    subprocess.run(["ldns-signzone", str(zone), key], cwd=directory, check=True, capture_output=True, timeout=60)
    return Path(f"{zone}.signed"), directory / f"{key}.key"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(directory: Path, port: int, anchors: list[Path], zones: Mapping[str, Path]) -> str:
    lines = ["server:", "  interface: 127.0.0.1", f"  port: {port}", "  do-ip6: no", '  username: ""',
             '  chroot: ""', f'  directory: "{directory}"', '  pidfile: ""', "  use-syslog: no",
             f'  logfile: "{directory / "unbound.log"}"', "  verbosity: 1", "  do-not-query-localhost: no",
             '  module-config: "validator iterator"', "  access-control: 127.0.0.0/8 allow",
             "  qname-minimisation: no", "  trust-anchor-signaling: no", '  local-zone: "test." nodefault',
             f'  root-hints: "{directory / "root.hints"}"']
    lines += [f'  trust-anchor-file: "{anchor}"' for anchor in anchors]
    for name, path in zones.items():
        lines += ["auth-zone:", f'  name: "{name}"', f'  zonefile: "{path}"', "  for-upstream: yes",
                  "  for-downstream: no", "  fallback-enabled: no"]
    return "\n".join(lines) + "\n"


async def _ready(port: int, name: str) -> None:
    """Until unbound answers for ``name`` (validated): at most 100 tries, each its own short timeout."""
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = ["127.0.0.1"]
    resolver.port = port
    resolver.lifetime = 0.5
    resolver.flags = dns.flags.RD | dns.flags.AD
    for _ in range(100):
        try:
            answer = await resolver.resolve(name, "SOA")
            if answer.response.flags & dns.flags.AD:
                return
        except dns.exception.DNSException:
            pass
        await trio.sleep(0.1)  # a bounded poll for a child process to listen; not a synchronisation by time
    raise RuntimeError(f"unbound did not answer for {name} on port {port}")


@asynccontextmanager
async def unbound(directory: Path, signed: Mapping[str, Sequence[str]],
                  unsigned: Mapping[str, Sequence[str]]) -> AsyncIterator[int]:
    """unbound serving ``signed`` zones (signed, anchored) and ``unsigned`` ones; yields its port."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "root.hints").write_text(". 3600000 NS a.root.invalid.\na.root.invalid. 3600000 A 127.0.0.9\n")
    zones: dict[str, Path] = {}
    anchors: list[Path] = []
    for origin, records in signed.items():
        zones[origin], anchor = _sign(directory, origin, _zone(directory, origin, records))
        anchors.append(anchor)
    for origin, records in unsigned.items():
        zones[origin] = _zone(directory, origin, records)
    port = _free_port()
    conf = directory / "unbound.conf"
    conf.write_text(_config(directory, port, anchors, zones))
    proc = subprocess.Popen(["unbound", "-d", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        await _ready(port, next(iter(signed)))
        yield port
    finally:
        proc.kill()
        proc.wait(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()
