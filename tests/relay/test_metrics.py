"""Every metric the relay declares moves when what it counts happens (docs/operations.md, "Metrics").

One relay life drives the core (``_scenario``): it starts on a spool left
with a message in doubt (recovery), takes and refuses mail, delivers, bounces,
times a client out, refuses a session over the limit, and holds a delivery
open against a next hop that never greets. The Prometheus endpoint is scraped
at the start, while that delivery hangs, and at the end. A second life
(``_trust_scenario``) drives what receivers trust: AUTH on the submission
port (swaks, a good and a wrong password), DKIM signing (a key from ``mta
dkim keygen``; a message dkimpy cannot sign) and MTA-STS (a policy served
over HTTPS and met, and a domain whose policy cannot be fetched), scraped at
its start and end. Each metric then has a case saying how it must have
moved. ``test_every_declared_metric_has_a_case`` keeps the list whole: a
metric added without a case fails it.
"""

from __future__ import annotations

import smtplib
import ssl
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import trio
import trustme
from dkim_support import key_config, keygen
from dns_server import DnsServer
from https_server import PolicyServer
from prometheus_client.parser import text_string_to_metric_families
from relay_support import DeliveryWatch, NextHop, RawClient, SilentHop, relay_config, start_relay, tls_files

from mta.auth.users import add_user
from mta.inbound.session import Port
from mta.shards import spool_config
from mta.smtp.common import Reply
from spool.engine.spool import Spool
from spool.format.record import Status


@attrs.frozen
class Scrape:
    samples: dict[str, float]  # 'name{label="v"}' -> value
    families: frozenset[str]  # the metric names the endpoint declared (# HELP lines)

    def __call__(self, key: str) -> float:
        return self.samples.get(key, 0.0)


@attrs.frozen
class Scrapes:
    start: Scrape
    stalled: Scrape  # while a delivery hangs on a next hop that never greets
    end: Scrape
    trust_start: Scrape  # the second relay's (AUTH, DKIM, MTA-STS)
    trust_end: Scrape


def _scrape(port: int) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    samples: dict[str, float] = {}
    families: set[str] = set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return Scrape(samples, frozenset(families))


def _send(port: int, sender: str, rcpt: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.sendmail(sender, [rcpt], b"Subject: metrics\r\n\r\nbody\r\n")


def _leave_a_message_in_doubt(cfg_dir: Path, cfg: object) -> None:
    """A START with no outcome, as a crash in mid-delivery leaves it: the next start reports it in doubt.

    Also two damaged messages for the damage metrics: one whose envelope's bytes are flipped (lost, named)
    and one whose body's bytes are (bounced when its turn comes).
    """
    sp = Spool.open(str(cfg_dir), spool_config(cfg))  # type: ignore[arg-type]
    try:
        sp.enqueue("s@localhost", ["doubt@localhost"], b"Subject: doubt\r\n\r\nbody\r\n")
        sp.commit()
        (attempt,) = sp.poll_due()
        sp.record_sending(attempt, attempt.remaining)  # past its final dot: in doubt at the restart
        sp.commit()
        sp.enqueue("s@localhost", ["envelope-lost@localhost"], b"Subject: lost\r\n\r\nbody\r\n")
        sp.enqueue("s@localhost", ["body-damaged@localhost"], b"Subject: damaged\r\n\r\nDAMAGE-ME\r\n")
        sp.commit()
        sp.checkpoint()  # so the damage lies in the durable log, not in a tail recovery cannot prove
    finally:
        sp.close()
    for marker in (b"envelope-lost@localhost", b"DAMAGE-ME"):
        _flip_after(cfg_dir / "log", marker)


def _flip_after(log_dir: Path, marker: bytes) -> None:
    """Flip one byte inside the first record holding ``marker``: its checksum no longer matches."""
    for seg in sorted(log_dir.glob("*.seg")):
        data = bytearray(seg.read_bytes())
        at = data.find(marker)
        if at >= 0:
            data[at + 2] ^= 0x20
            seg.write_bytes(bytes(data))
            return
    raise AssertionError(f"{marker!r} is in no segment")


async def _scenario(tmp: Path) -> Scrapes:
    async with trio.open_nursery() as nursery:
        hop = NextHop(lambda stage, value: Reply(550, "5.1.1", "no such user")
                      if stage == "rcpt" and str(value).startswith("bounce@") else None)
        hop_port = await hop.start(nursery)
        silent = SilentHop()
        silent_port = await silent.start(nursery)
        cfg = relay_config(str(tmp), {"localhost": "maildir:maildir", "far.example": f"smtp://127.0.0.1:{hop_port}",
                                      "stall.example": f"smtp://127.0.0.1:{silent_port}"},
                           extra='metrics_listen = "127.0.0.1:0"\nmax_sessions = 2\nreserved_sessions = 0\n'
                                 'command_timeout = "1s"\n', retry='["1h"]',
                           spool_extra='in_doubt = "redeliver"\n')  # the message left in doubt is delivered again
        await trio.to_thread.run_sync(_leave_a_message_in_doubt, Path(cfg.spool.dir), cfg)
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        mport = int(relay.metrics_listeners[0].socket.getsockname()[1])
        start = await trio.to_thread.run_sync(_scrape, mport)
        await watch.wait_for(Status.DELIVERED, 1, recipient="doubt@localhost")  # the in-doubt one, again
        await watch.wait_for(Status.BOUNCED, 1, recipient="body-damaged@localhost")  # its data cannot be read

        port = relay.ports[0]
        await trio.to_thread.run_sync(_send, port, "s@localhost", "ok@far.example")
        await trio.to_thread.run_sync(_send, port, "s@localhost", "bounce@far.example")
        await watch.wait_for(Status.DELIVERED, 1, recipient="ok@far.example")
        await watch.wait_for(Status.BOUNCED, 1, recipient="bounce@far.example")
        await watch.wait_for(Status.DELIVERED, 1, recipient="s@localhost")  # the DSN

        chatty = await RawClient.connect(port)
        await chatty.reply()
        assert (await chatty.command(b"FOO"))[0].startswith(b"500")  # a rejection
        other = await RawClient.connect(port)
        await other.reply()
        third = await RawClient.connect(port)  # both slots are taken: 421 4.7.0
        assert (await third.reply())[0].startswith(b"421 4.7.0")
        assert (await other.reply())[0].startswith(b"421 4.4.2")  # silent for command_timeout
        for c in (chatty, other, third):
            await c.aclose()

        await trio.to_thread.run_sync(_send, port, "s@localhost", "x@stall.example")
        await silent.connected.wait()
        stalled = await trio.to_thread.run_sync(_scrape, mport)
        silent.release()
        await watch.wait_for(Status.DEFERRED, 1, recipient="x@stall.example")
        end = await trio.to_thread.run_sync(_scrape, mport)
        nursery.cancel_scope.cancel()
    return Scrapes(start, stalled, end, *await _trust_scenario(tmp / "trust"))


PASSWORD = "correct horse battery staple"


def _swaks(port: int, rcpt: str, password: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["swaks", "--server", f"127.0.0.1:{port}", "--tls", "--auth", "PLAIN", "--auth-user",
                           "alice", "--auth-password", password, "--from", "alice@example.org", "--to", rcpt,
                           "--timeout", "30"], capture_output=True, text=True, timeout=60, check=False)


async def _trust_scenario(tmp: Path) -> tuple[Scrape, Scrape]:
    """A relay with the submission port, a DKIM key for example.org, and MTA-STS on its mx route.

    DNS (a server on 127.0.0.1) sends both sts.example and nofetch.example to mx.sts.example, the next hop
    (STARTTLS, a certificate for that name from the test's CA); the HTTPS server serves sts.example's
    enforce policy naming it, and none for nofetch.example, whose TXT record says it has one.
    """
    tmp.mkdir()
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp / "ca.pem"))
    cert, key = tls_files(tmp, ca)
    users = tmp / "users"
    await trio.to_thread.run_sync(add_user, str(users), "alice", PASSWORD)
    dkim_key = await trio.to_thread.run_sync(keygen, tmp, "example.org", "m2026", "ed25519")
    async with trio.open_nursery() as nursery:
        dns = DnsServer()
        dns_port = await nursery.start(dns.serve)
        https = PolicyServer(ca.issue_cert("mta-sts.sts.example", "mta-sts.nofetch.example"))
        https_port = await nursery.start(https.serve)
        for domain in ("sts.example", "nofetch.example"):
            dns.mx(domain, 10, "mx.sts.example")
            dns.a(f"mta-sts.{domain}", "127.0.0.1")
            dns.txt(f"_mta-sts.{domain}", "v=STSv1; id=1;")
        dns.a("mx.sts.example", "127.0.0.1")
        https.policies["mta-sts.sts.example"] = "version: STSv1\r\nmode: enforce\r\nmx: mx.sts.example\r\n" \
                                                "max_age: 86400\r\n"
        hop_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("mx.sts.example").configure_cert(hop_tls)
        hop = NextHop(ssl_context=hop_tls)
        hop_port = await hop.start(nursery)
        cfg = relay_config(str(tmp), {"sts.example": "mx?tls=mta-sts", "nofetch.example": "mx?tls=mta-sts"},
                           extra=f'metrics_listen = "127.0.0.1:0"\ntls_cert = "{cert}"\ntls_key = "{key}"\n'
                                 f'[submission]\nlisten = ["127.0.0.1:0"]\nusers_file = "{users}"\n'
                                 f'auth_failure_delay = "0s"\n'
                                 f'[delivery]\nresolver = "127.0.0.1:{dns_port}"\nmx_port = {hop_port}\n'
                                 f'tls_ca_file = "{tmp / "ca.pem"}"\n[tls_policy]\nmta_sts_port = {https_port}\n'
                                 + key_config(dkim_key))
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        mport = int(relay.metrics_listeners[0].socket.getsockname()[1])
        start = await trio.to_thread.run_sync(_scrape, mport)
        submission = relay.ports_of(Port.SUBMISSION)[0]
        wrong = await trio.to_thread.run_sync(_swaks, submission, "bob@sts.example", "not the password")
        assert "535 5.7.8" in wrong.stdout, wrong.stdout
        good = await trio.to_thread.run_sync(_swaks, submission, "bob@sts.example", PASSWORD)
        assert good.returncode == 0, good.stdout + good.stderr
        # From 127.0.0.1, in mynetworks, so signed if it could be: a header line without a colon stops dkimpy.
        await trio.to_thread.run_sync(_send_bytes, relay.ports[0], "alice@example.org", "carol@nofetch.example",
                                      b"No colon on this line\r\nFrom: alice@example.org\r\n\r\nbody\r\n")
        await watch.wait_for(Status.DELIVERED, 1, recipient="bob@sts.example")
        await watch.wait_for(Status.DELIVERED, 1, recipient="carol@nofetch.example")  # no policy: as before
        end = await trio.to_thread.run_sync(_scrape, mport)
        nursery.cancel_scope.cancel()
    return start, end


def _send_bytes(port: int, sender: str, rcpt: str, data: bytes) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.sendmail(sender, [rcpt], data)


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory: pytest.TempPathFactory) -> Scrapes:
    return trio.run(_scenario, tmp_path_factory.mktemp("metrics"))


def grew(key: str) -> Callable[[Scrapes], bool]:
    return lambda s: s.end(key) > s.start(key)


def trust_grew(key: str) -> Callable[[Scrapes], bool]:
    """``key`` moved in the second relay's life (``_trust_scenario``)."""
    return lambda s: s.trust_end(key) > s.trust_start(key)


# Each declared metric: how the scenario must have moved it.
CASES: dict[str, Callable[[Scrapes], bool]] = {
    "logspool_accepted_messages": grew("logspool_accepted_messages_total"),
    "logspool_rejected_commands": grew('logspool_rejected_commands_total{reason="unknown_command"}'),
    "logspool_recipient_outcomes": lambda s: all(
        grew(f'logspool_recipient_outcomes_total{{status="{st}"}}')(s) for st in ("delivered", "bounced", "deferred")),
    "logspool_dsn_sent": grew("logspool_dsn_sent_total"),
    # The relay delivers in its own process here: each point is its record (a worker's own: test_delivery_workers).
    "logspool_points_of_no_return": grew('logspool_points_of_no_return_total{by="relay"}'),
    # The scenario's bounce and deferrals, each counted under its class (whichever the shipped rules give).
    "logspool_outcome_classes": lambda s: all(
        sum(v for k, v in s.end.samples.items() if k.startswith("logspool_outcome_classes_total") and st in k)
        > sum(v for k, v in s.start.samples.items() if k.startswith("logspool_outcome_classes_total") and st in k)
        for st in ('status="bounced"', 'status="deferred"')),
    "logspool_delivery_latency_seconds": grew("logspool_delivery_latency_seconds_count"),
    "logspool_commit_batch_messages": lambda s: grew("logspool_commit_batch_messages_count")(s)
    and s.end("logspool_commit_batch_messages_sum") == 3,  # the three messages taken over SMTP (not the DSN)
    "logspool_smtp_sessions": grew("logspool_smtp_sessions_total"),
    "logspool_smtp_sessions_refused": grew('logspool_smtp_sessions_refused_total{limit="total"}'),
    "logspool_smtp_timeouts": grew('logspool_smtp_timeouts_total{phase="command"}'),
    "logspool_fsyncs": grew("logspool_fsyncs"),
    # No delivery worker here, so no marks to sync (a worker's: test_delivery_workers).
    "logspool_worker_fsyncs": lambda s: s.end.samples.get("logspool_worker_fsyncs_total") == 0,
    "logspool_commits": grew("logspool_commits"),
    "logspool_records_appended": grew("logspool_records_appended"),
    "logspool_bytes_appended": grew("logspool_bytes_appended"),
    "logspool_active_messages": lambda s: s.stalled('logspool_active_messages{class="0"}') >= 1
    and s.end('logspool_active_messages{class="0"}') == 0,
    "logspool_runner_position": grew('logspool_runner_position{class="0"}'),
    "logspool_recovery_bytes_read": lambda s: s.start("logspool_recovery_bytes_read") > 0,
    "logspool_recovery_in_doubt": lambda s: s.start("logspool_recovery_in_doubt") == 1,
    # The queue gauges: here only present (in doubt is redelivered); they move in tests/relay/test_queue_gauges.py.
    "logspool_queue_messages": lambda s: s.stalled("logspool_queue_messages") >= 1,
    "logspool_queue_held": lambda s: s.end("logspool_queue_held") >= 0,
    "logspool_queue_in_doubt": lambda s: s.end("logspool_queue_in_doubt") >= 0,
    "logspool_queue_deferred": lambda s: s.end("logspool_queue_deferred") >= 0,
    "logspool_queue_oldest_age_seconds": lambda s: s.end("logspool_queue_oldest_age_seconds") > 0,
    "logspool_damage_found": lambda s: s.start('logspool_damage_found{kind="damaged_record"}') >= 1,
    "logspool_damage_lost_messages": lambda s: s.start("logspool_damage_lost_messages") >= 1,
    "logspool_damaged_bodies": grew("logspool_damaged_bodies"),
    "logspool_quarantine_entries": lambda s: s.start("logspool_quarantine_entries") >= 1,
    "logspool_quarantine_bytes": lambda s: s.start("logspool_quarantine_bytes") > 0,
    "logspool_quarantine_lost_messages": lambda s: s.start("logspool_quarantine_lost_messages") >= 1,
    "logspool_auth": lambda s: s.trust_end('logspool_auth_total{result="success"}') == 1
    and s.trust_end('logspool_auth_total{result="failure"}') == 1,
    "logspool_dkim_signed": lambda s: s.trust_end('logspool_dkim_signed_total{domain="example.org"}') == 1,
    "logspool_dkim_unsigned": lambda s: s.trust_end('logspool_dkim_unsigned_total{reason="error"}') == 1,
    "logspool_tls_policy": lambda s: trust_grew('logspool_tls_policy_total{policy="mta-sts",result="success"}')(s)
    and s.trust_end('logspool_tls_policy_total{policy="mta-sts",result="sts-policy-fetch-error"}') >= 1,  # nofetch
}


@pytest.mark.parametrize("metric", sorted(CASES))
def test_metric_moves(scrapes: Scrapes, metric: str) -> None:
    assert metric in scrapes.end.families
    relevant = {k: v for k, v in [*scrapes.end.samples.items(), *scrapes.trust_end.samples.items()]
                if k.startswith(metric)}
    assert CASES[metric](scrapes), (metric, relevant)


def test_every_declared_metric_has_a_case(scrapes: Scrapes) -> None:
    # prometheus_client's text format adds a NAME_created family per counter and histogram: not declared by us.
    declared = {f for f in scrapes.end.families if f.startswith("logspool_") and not f.endswith("_created")}
    assert declared == set(CASES), declared ^ set(CASES)
