"""Egress by shaping provider on the real relay: the MX hosts the test DNS server gives decide the address.

``one.test`` and ``two.test`` have MX hosts under ``.provx.test``, the
shaping table's provider ``provx``, which ``[egress.providers]`` sends from
127.0.0.3; ``three.test`` is under the same suffix but has a route of its
own (127.0.0.2), and ``plain.test`` belongs to no provider (the ``*`` route,
127.0.0.4). Every MX host is the one next hop on 127.0.0.1, which records the
address each message came from. No domain is looked up before its first
message: that message's address shows it waited for the shaper's lookup.
"""

from __future__ import annotations

import smtplib
from pathlib import Path

import trio
from dns_server import DnsServer
from relay_support import DeliveryWatch, NextHop, start_relay, write_relay_config

from mta.config import load_config
from spool.format.record import Status

EGRESS = """
[egress.sources."127.0.0.2"]
ehlo = "out2.relay.test"
[egress.sources."127.0.0.3"]
ehlo = "out3.relay.test"
[egress.sources."127.0.0.4"]
ehlo = "out4.relay.test"
[egress.routes]
"three.test" = "127.0.0.2"
"*" = "127.0.0.4"
[egress.providers]
provx = "127.0.0.3"
"""

TABLE = '[provider.provx]\nmx_suffix = [".provx.test"]\n\n[provider.other]\nmx_suffix = [".other.test"]\n'


def _send(port: int, rcpts: list[str]) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        for rcpt in rcpts:
            s.sendmail("x@src.example", [rcpt], f"Subject: to {rcpt}\r\n\r\nbody\r\n")


async def test_a_providers_domains_send_from_its_address_and_a_route_match_wins_over_it(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            dns = DnsServer()
            dns_port = await nursery.start(dns.serve)
            hop = NextHop()
            port = await hop.start(nursery)
            for domain, host in (("one.test", "mx1.provx.test"), ("two.test", "in.mx2.provx.test"),
                                 ("three.test", "mx3.provx.test"), ("plain.test", "mx.plain.test")):
                dns.mx(domain, 10, host)
                dns.a(host, "127.0.0.1")
            (tmp_path / "shaping.toml").write_text(TABLE)
            extra = (f'[delivery]\nresolver = "127.0.0.1:{dns_port}"\nmx_port = {port}\n'
                     f'[shaping]\nbuiltin = false\nfile = "shaping.toml"\n')
            config_path = write_relay_config(tmp_path, {"*": "mx"}, extra=extra, spool_extra=EGRESS)
            relay = await start_relay(nursery, load_config(str(config_path)))
            watch = DeliveryWatch(relay)
            rcpts = ["a@one.test", "b@two.test", "c@three.test", "d@plain.test", "e@one.test"]
            await trio.to_thread.run_sync(_send, relay.ports[0], rcpts)
            await watch.wait_for(Status.DELIVERED, len(rcpts))
            seen = {m.recipients[0]: (m.peer, m.helo) for m in await hop.wait_messages(len(rcpts))}
            shaper = relay.scheduler.shaper
            assert shaper is not None
            providers = {d: s.resolution.provider.name if s.resolution.provider else None
                         for d, s in shaper.shapes.items()}
            nursery.cancel_scope.cancel()
    assert seen == {"a@one.test": ("127.0.0.3", "out3.relay.test"),
                    "b@two.test": ("127.0.0.3", "out3.relay.test"),
                    "c@three.test": ("127.0.0.2", "out2.relay.test"),  # the route's match wins over provx
                    "d@plain.test": ("127.0.0.4", "out4.relay.test"),  # no provider: the * route
                    "e@one.test": ("127.0.0.3", "out3.relay.test")}
    assert providers == {"one.test": "provx", "two.test": "provx", "three.test": "provx", "plain.test": None}
