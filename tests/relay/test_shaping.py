"""Shaping end to end: a scripted next hop that answers like a throttling provider, grouped by MX suffix.

The test DNS server gives ``a.test`` the MX host ``mx.prov-a.test`` and
``b.test`` the MX host ``mx.prov-b.test``, both on the one next hop; the
shaping table names providers by those suffixes, so only the MX names
group the mail. The next hop answers ``421 4.7.28`` to a.test's recipients
until the test lets them through.
"""

from __future__ import annotations

import functools
import json
import os
import re
import smtplib
import sys
import time
from pathlib import Path
from typing import Any

import trio
from click.testing import CliRunner
from dns_server import DnsServer
from process_support import RelayProcess
from relay_support import NextHop, start_relay, write_relay_config

from mta.cli import main
from mta.config import load_config
from mta.delivery.retry_class import class_reaching
from mta.smtp.common import Reply

SUSPEND = 20.0  # seconds the rule suspends the provider for: long enough for a kill -9 and a restart

TABLE = f"""
[provider.prova]
mx_suffix = [".prov-a.test"]

[provider.provb]
mx_suffix = [".prov-b.test"]

[[rule]]
name = "unusual-rate"
applies_to = "provider:prova"
code = 421
enhanced = "4.7.28"
threshold = 2
window = "60s"
action = "suspend"
duration = "{SUSPEND}s"
"""


class ProviderHop(NextHop):
    """Counts RCPTs per domain; a.test's get 421 4.7.28 while ``throttle`` is set."""

    def __init__(self) -> None:
        super().__init__(self._answer)
        self.throttle = True
        self.rcpts: dict[str, list[float]] = {}

    def _answer(self, stage: str, value: Any) -> Reply | None:
        if stage != "rcpt":
            return None
        domain = str(value).rpartition("@")[2].strip(">").lower()
        self.rcpts.setdefault(domain, []).append(time.time())
        if domain == "a.test" and self.throttle:
            return Reply(421, "4.7.28", "Our system has detected an unusual rate of unsolicited mail")
        return None


def _send(port: int, rcpt: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.sendmail("alice@localhost", [rcpt], f"Subject: to {rcpt}\r\n\r\nbody\r\n")


def _explain(config_path: Path, domain: str) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["shape", "explain", domain, "--config", str(config_path), "--json"])
    assert result.exit_code == 0, result.output
    answer: dict[str, Any] = json.loads(result.output)
    return answer


async def explain(config_path: Path, domain: str) -> dict[str, Any]:
    return await trio.to_thread.run_sync(_explain, config_path, domain)


def internal(relay: RelayProcess, recipient: str) -> int:
    """The relay's own deferrals of ``recipient`` (a suspended provider's), as its delivery lines say."""
    return sum(1 for line in relay.lines if "event=delivery" in line and f"to=<{recipient}>" in line
               and "shaping: provider prova suspended" in line)


async def wait_until(condition: Any, timeout: float = 30) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.02)


async def test_two_421_suspend_the_provider_across_a_restart_and_only_its_own_mail(tmp_path: Path) -> None:
    with trio.fail_after(150):
        async with trio.open_nursery() as nursery:
            dns = DnsServer()
            dns_port = await nursery.start(dns.serve)
            hop = ProviderHop()
            port = await hop.start(nursery)
            for domain, host in (("a.test", "mx.prov-a.test"), ("b.test", "mx.prov-b.test")):
                dns.mx(domain, 10, host)
                dns.a(host, "127.0.0.1")
            (tmp_path / "shaping.toml").write_text(TABLE)
            extra = (f'[delivery]\nresolver = "127.0.0.1:{dns_port}"\nmx_port = {port}\n'
                     f'[shaping]\nbuiltin = false\nfile = "shaping.toml"\n')
            # Retries 3 s apart: u1's retry comes after u2 is in, even on a loaded machine.
            config_path = write_relay_config(tmp_path, {"localhost": "maildir:maildir", "*": "mx"}, extra=extra,
                                             retry='["3s", "3s"]')
            relay = RelayProcess(config_path)

            # Life 1: two 421 4.7.28 within the window suspend prova.
            await relay.start(nursery)
            for n, rcpt in enumerate(("u1@a.test", "u2@a.test"), 1):
                await trio.to_thread.run_sync(_send, relay.port, rcpt)
                await wait_until(lambda n=n: len(hop.rcpts.get("a.test", [])) >= n)
            await relay.wait_output(lambda: any("event=shaping_override" in line for line in relay.lines), 30,
                                    "the override")
            first = await explain(config_path, "a.test")
            assert [o["rule"] for o in first["overrides"]] == ["unusual-rate"]
            override = first["overrides"][0]
            assert override["scope"] == "provider:prova" and override["action"] == "suspend"
            assert [h["recipient"] for h in override["hits"]] == ["u1@a.test", "u2@a.test"]
            assert all(h["reply"].startswith("421 4.7.28 Our system has detected") for h in override["hits"])
            assert all(h["next_hop"].startswith("mx.prov-a.test[127.0.0.1]") for h in override["hits"])
            ends = override["ends_unix"]

            # Another provider keeps flowing while prova is suspended.
            await trio.to_thread.run_sync(_send, relay.port, "v@b.test")
            await hop.wait_messages(1, timeout=30)
            assert hop.messages[0].recipients == ["v@b.test"]
            # prova's mail is deferred by the relay itself: no connection, no RCPT.
            await trio.to_thread.run_sync(_send, relay.port, "u3@a.test")
            await relay.wait_output(lambda: internal(relay, "u3@a.test") >= 1, 30, "u3 deferred by the relay")
            assert len(hop.rcpts["a.test"]) == 2
            await relay.kill()  # kill -9: every start is a recovery

            assert time.time() < ends, "the test machine was too slow to restart within the suspension"
            # Life 2: the suspension, rebuilt from the log, ends when it did; internal deferrals do not extend it.
            await relay.start(nursery)
            await relay.wait_output(lambda: internal(relay, "u1@a.test") + internal(relay, "u3@a.test") >= 1, 30,
                                    "a deferral by the relay after the restart")
            assert len(hop.rcpts["a.test"]) == 2
            again = await explain(config_path, "a.test")
            assert [o["ends_unix"] for o in again["overrides"]] == [ends]
            hop.throttle = False
            await hop.wait_messages(4, timeout=SUSPEND + 30)
            assert min(hop.rcpts["a.test"][2:]) >= ends
            assert (await explain(config_path, "a.test"))["overrides"] == []
            nursery.cancel_scope.cancel()


HOLD_SUSPEND = 8.0  # seconds: within the second class (10 s) from any moment of it but its first second
HOLD_RETRY = (1.0, 10.0, 60.0)
HOLD_TABLE = TABLE.replace(f'duration = "{SUSPEND}s"', f'duration = "{HOLD_SUSPEND}s"')


class RecipientHop(ProviderHop):
    """ProviderHop that also keeps when each recipient was offered."""

    def __init__(self) -> None:
        super().__init__()
        self.by_rcpt: dict[str, list[float]] = {}

    def _answer(self, stage: str, value: Any) -> Reply | None:
        if stage == "rcpt":
            self.by_rcpt.setdefault(str(value).strip("<>").lower(), []).append(time.time())
        return super()._answer(stage, value)


async def spool_records(spool: Path) -> list[dict[str, Any]]:
    """Every record of the spool's log as ``spoolctl dump --json`` decodes it."""
    spoolctl = os.path.join(os.path.dirname(sys.executable), "spoolctl")
    done = await trio.run_process([spoolctl, "dump", "--json", str(spool)], capture_stdout=True,
                                  capture_stderr=True)
    return [json.loads(line) for line in done.stdout.decode().splitlines()]


async def test_a_suspended_providers_mail_waits_in_the_class_reaching_the_end_and_comes_back_after_it(
        tmp_path: Path) -> None:
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            dns = DnsServer()
            dns_port = await nursery.start(dns.serve)
            hop = RecipientHop()
            port = await hop.start(nursery)
            dns.mx("a.test", 10, "mx.prov-a.test")
            dns.a("mx.prov-a.test", "127.0.0.1")
            (tmp_path / "shaping.toml").write_text(HOLD_TABLE)
            extra = (f'[delivery]\nresolver = "127.0.0.1:{dns_port}"\nmx_port = {port}\n'
                     f'[shaping]\nbuiltin = false\nfile = "shaping.toml"\n')
            retry = "[" + ", ".join(f'"{i:g}s"' for i in HOLD_RETRY) + "]"
            config_path = write_relay_config(tmp_path, {"localhost": "maildir:maildir", "*": "mx"}, extra=extra,
                                             retry=retry)
            relay = RelayProcess(config_path)
            await relay.start(nursery)
            for n, rcpt in enumerate(("u1@a.test", "u2@a.test"), 1):
                await trio.to_thread.run_sync(_send, relay.port, rcpt)
                await wait_until(lambda n=n: len(hop.rcpts.get("a.test", [])) >= n)
            await relay.wait_output(lambda: any("event=shaping_override" in line for line in relay.lines), 30,
                                    "the override")
            until = [m for line in relay.lines if "event=shaping_override" in line
                     and (m := re.search(r"until=([0-9.]+)", line))]
            ends = float(until[0].group(1))
            hop.throttle = False  # after the end prova takes the mail; during it no connection is made

            await trio.to_thread.run_sync(_send, relay.port, "u3@a.test")
            await relay.wait_output(lambda: internal(relay, "u3@a.test") >= 1, 30, "u3 deferred by the relay")
            await relay.wait_output(lambda: any("event=delivery" in line and "to=<u3@a.test>" in line
                                                and "status=sent" in line for line in relay.lines),
                                    HOLD_SUSPEND + 30, "u3 delivered after the suspension")
            assert internal(relay, "u3@a.test") == 1  # deferred once by the relay, not at every 1 s pass
            assert hop.by_rcpt["u3@a.test"] and min(hop.by_rcpt["u3@a.test"]) >= ends

            records = await spool_records(tmp_path / "spool")
            envelopes = [r for r in records if r["type"] == "ENVELOPE" and r["payload"]["recipients"] == ["u3@a.test"]]
            first, replacement = envelopes[0], envelopes[1]
            assert first["class"] == 0 and replacement["payload"]["replaces"] == first["position"]
            assert replacement["time"] < ends - 1, "the test machine was too slow: u3 deferred late in the suspension"
            starts = [r for r in records if r["type"] == "START"
                      and r["payload"]["envelope"] in (first["position"], replacement["position"])]
            assert [s["payload"]["envelope"] for s in starts] == [first["position"], replacement["position"]]
            finish = next(r for r in records
                          if r["type"] == "FINISH" and r["payload"]["start"] == starts[0]["position"])
            # The FINISH names the replacement, whose class is the smallest whose interval reaches the end...
            assert finish["payload"]["replacement"] == replacement["position"]
            assert replacement["class"] == 2 == class_reaching(HOLD_RETRY, replacement["time"], ends)
            # ...so its one claim is after the end, and at the pass that class makes, not a longer class's.
            again = starts[1]["payload"]["time_ms"] / 1000
            assert ends <= again < replacement["time"] + HOLD_RETRY[1] + 5 < replacement["time"] + HOLD_RETRY[2]
            nursery.cancel_scope.cancel()


async def test_resolve_names_the_matched_suffix_and_the_source_of_each_limit(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        dns = DnsServer()
        dns_port = await nursery.start(dns.serve)
        dns.mx("gmail.com", 5, "gmail-smtp-in.l.google.com")
        (tmp_path / "shaping.toml").write_text('[provider.google]\nconnections = 3\n')
        config_path = write_relay_config(tmp_path, {"*": "mx"}, extra=(
            f'[delivery]\nresolver = "127.0.0.1:{dns_port}"\n[shaping]\nfile = "shaping.toml"\n'))
        run = functools.partial(CliRunner().invoke, main, ["shape", "resolve", "gmail.com", "--config",
                                                           str(config_path)])
        r = await trio.to_thread.run_sync(run)
        assert r.exit_code == 0, r.output
        lines = r.output.splitlines()
        assert "provider google (MX host gmail-smtp-in.l.google.com ends with .google.com)" in lines
        assert f"  provider.connections = 3 (total over the provider's domains) from {tmp_path / 'shaping.toml'}" \
            in lines
        assert "  provider.messages_per_connection = 50 from <builtin>" in lines
        assert any(line.startswith("  rule gmail-4.7.28 ") for line in lines)
        bad = CliRunner().invoke(main, ["shape", "resolve", "not a domain", "--config", str(config_path)])
        assert bad.exit_code == 2 and "is not a domain" in bad.output and "Traceback" not in bad.output
        nursery.cancel_scope.cancel()


RAMP_TABLE = """
[provider.provc]
mx_suffix = [".prov-c.test"]
rate = "10/s"
messages_per_connection = 1

[[rule]]
name = "slow-down"
applies_to = "provider:provc"
code = 451
enhanced = "4.7.1"
threshold = 1
window = "60s"
action = "limit"
limit = { rate = "20%" }
duration = "3s"
ramp_steps = 2
ramp_step = "2s"
"""


class TimedHop(NextHop):
    """Says ``451 4.7.1`` to the first recipient; notes when each connection opened and each message came."""

    def __init__(self) -> None:
        super().__init__(self._answer)
        self.opened: list[float] = []
        self.taken: list[float] = []
        self.refused = False

    def _answer(self, stage: str, value: Any) -> Reply | None:
        if stage == "rcpt" and not self.refused:
            self.refused = True
            return Reply(451, "4.7.1", "slow down, please")
        if stage == "data":
            self.taken.append(time.time())
        return None

    async def _handle(self, tcp: trio.SocketStream) -> None:
        self.opened.append(time.time())
        await super()._handle(tcp)


def _send_many(port: int, rcpts: list[str]) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        for rcpt in rcpts:
            s.sendmail("alice@localhost", [rcpt], f"Subject: to {rcpt}\r\n\r\nbody\r\n")


def per_second(times: list[float], begin: float, end: float) -> float:
    return sum(1 for t in times if begin <= t < end) / (end - begin)


async def test_a_relative_decrease_then_a_step_wise_ramp_up_in_connections_and_messages(tmp_path: Path) -> None:
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            dns = DnsServer()
            dns_port = await nursery.start(dns.serve)
            hop = TimedHop()
            port = await hop.start(nursery)
            dns.mx("c.test", 10, "mx.prov-c.test")
            dns.a("mx.prov-c.test", "127.0.0.1")
            (tmp_path / "shaping.toml").write_text(RAMP_TABLE)
            extra = (f'[delivery]\nresolver = "127.0.0.1:{dns_port}"\nmx_port = {port}\nconnection_cache_time = "0s"\n'
                     f'[shaping]\nbuiltin = false\nfile = "shaping.toml"\n')
            config_path = write_relay_config(tmp_path, {"localhost": "maildir:maildir", "*": "mx"}, extra=extra,
                                             retry='["60s"]')
            relay = await start_relay(nursery, load_config(str(config_path)))
            shaper = relay.scheduler.shaper
            assert shaper is not None
            await trio.to_thread.run_sync(_send_many, relay.ports[0], ["trigger@c.test"])
            await wait_until(lambda: bool(shaper.adaptive.overrides))
            (override,) = shaper.adaptive.overrides.values()
            began, ends = override.began, override.ends
            # Far more mail than the limits let through in the test's time: the rate alone paces it.
            await trio.to_thread.run_sync(_send_many, relay.ports[0], [f"u{i}@c.test" for i in range(120)])
            await wait_until(lambda: time.time() > ends + 4 + 2, timeout=30)
            nursery.cancel_scope.cancel()

    step = override.rule.ramp_step
    phases = [(began + 1, ends), (ends, ends + step), (ends + step, ends + 2 * step)]
    messages = [per_second(hop.taken, a, b) for a, b in phases]
    connections = [per_second(hop.opened, a, b) for a, b in phases]
    # 10/s cut to 20 % (2/s) for 3 s, then 2 + 8/3 (4.7/s) and 2 + 16/3 (7.3/s): one second's worth of burst each.
    assert messages[0] <= 2 + 2 / (ends - began - 1) + 0.5, messages
    assert messages[0] < messages[1] < messages[2], messages
    assert messages[2] <= 7.34 + 7.34 / step + 0.5, messages
    assert connections[0] < connections[1] < connections[2], connections


def test_a_bad_shaping_table_stops_config_check_and_serve_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "shaping.toml").write_text('[[rule]]\nname = "r"\ncode = 421\naction = "nap"\nduration = "1h"\n')
    config_path = write_relay_config(tmp_path, {"*": "mx"}, extra='[shaping]\nfile = "shaping.toml"\n')
    for args in (["config", "check"], ["serve"]):
        r = CliRunner().invoke(main, [*args, "--config", str(config_path)])
        assert r.exit_code == 2, (args, r.output)
        assert "shaping.toml: rule r: action must be one of suspend, bounce, limit" in r.output
        assert "Traceback" not in r.output
