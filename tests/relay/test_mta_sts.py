"""MTA-STS (RFC 8461) and TLS-RPT (RFC 8460) end to end, every part real on 127.0.0.1.

A DNS server started by the test answers MX, A and the ``_mta-sts`` TXT
records; an HTTPS server with a trustme certificate serves the policies at
``mta-sts.DOMAIN``; the next hops are SMTP servers on 127.0.0.1, .3 and .4
(same port, ``[delivery] mx_port``): .1 has a certificate for the MX names
the policies list, .3 one for another name, .4 offers no STARTTLS. The relay
trusts the test CA through ``[delivery] tls_ca_file``.
"""

from __future__ import annotations

import email
import email.message
import email.policy
import json
import logging
import os
import smtplib
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio
import trustme
from dns_server import DnsServer
from https_server import PolicyServer
from logfmt import events
from relay_support import DeliveryWatch, NextHop, relay_config, relay_config_text, server_context, start_relay

from mta.config import Config, parse_config
from mta.delivery.smtp_transport import SmtpTransport
from mta.delivery.tlspolicy.mtasts import PolicyInvalid, mx_matches, parse_policy, parse_txt
from mta.delivery.tlspolicy.tlsrpt import Reporter
from mta.process.relay import Relay
from spool.format.record import Status

GOOD, WRONG, PLAIN = "127.0.0.1", "127.0.0.3", "127.0.0.4"
DOMAINS = ("sts.test", "bad.test", "none.test", "try.test")


def policy(mode: str, *mx: str, max_age: int = 86400) -> str:
    return "version: STSv1\r\nmode: " + mode + "\r\n" + "".join(f"mx: {m}\r\n" for m in mx) + \
        f"max_age: {max_age}\r\n"


@attrs.define
class World:
    dns: DnsServer
    https: PolicyServer
    hops: dict[str, NextHop]
    config: Config
    nursery: trio.Nursery
    extra: str

    def publish(self, domain: str, policy_id: str, text: str) -> None:
        self.dns.forget(f"_mta-sts.{domain}", "TXT")
        self.dns.txt(f"_mta-sts.{domain}", f"v=STSv1; id={policy_id};")
        self.https.policies[f"mta-sts.{domain}"] = text


@asynccontextmanager
async def sts_world(tmp_path: Path, route: str = "mx?tls=mta-sts", delivery: str = "") -> AsyncIterator[World]:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    async with trio.open_nursery() as nursery:
        dns = DnsServer()
        dns_port = await nursery.start(dns.serve)
        https = PolicyServer(ca.issue_cert(*(f"mta-sts.{d}" for d in DOMAINS)))
        https_port = await nursery.start(https.serve)
        for d in DOMAINS:
            dns.a(f"mta-sts.{d}", "127.0.0.1")
        hops = {GOOD: NextHop(ssl_context=server_context(ca.issue_cert("mx.sts.test", "mx.try.test"))),
                WRONG: NextHop(ssl_context=server_context(ca.issue_cert("wrong.test"))),
                PLAIN: NextHop()}
        port = 0
        for address, hop in hops.items():
            port = await hop.start(nursery, address, port)
        extra = (f'[delivery]\nresolver = "127.0.0.1:{dns_port}"\nmx_port = {port}\nconnect_timeout = "10s"\n'
                 f'tls_ca_file = "{tmp_path / "ca.pem"}"\n{delivery}'
                 f'[tls_policy]\nmta_sts_port = {https_port}\nreport_dir = "reports"\n')
        cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir", "*": route}, extra=extra)
        yield World(dns, https, hops, cfg, nursery, extra)
        nursery.cancel_scope.cancel()


def _send(port: int, rcpt: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.sendmail("alice@localhost", [rcpt], f"Subject: to {rcpt}\r\n\r\nbody\r\n")


async def send(relay: Relay, rcpt: str) -> None:
    await trio.to_thread.run_sync(_send, relay.ports[0], rcpt)


def transport(relay: Relay) -> SmtpTransport:
    smtp = relay.scheduler.transports["mx"]
    assert isinstance(smtp, SmtpTransport)
    return smtp


def reporter(relay: Relay) -> Reporter:
    found = transport(relay).policies.reporter
    assert found is not None
    return found


# -- the policy file, the TXT record, MX patterns (RFC 8461 §3, §4.1) ------------------------------------------

def test_policy_parsing_takes_what_rfc_8461_allows_and_refuses_the_rest() -> None:
    p = parse_policy("version: STSv1\nmode: enforce\nmx: mail.example.com\nmx: *.example.net\nmax_age: 604800\n"
                     "extension: ignored\n")
    assert (p.mode, p.max_age, p.mx) == ("enforce", 604800, ("mail.example.com", "*.example.net"))
    assert p.matches("MAIL.example.com.") and p.matches("a.example.net")
    assert not p.matches("a.b.example.net") and not p.matches("example.net") and not p.matches("mail.example.org")
    assert parse_policy("version: STSv1\r\nmode: none\r\nmax_age: 0\r\n").mx == ()
    for bad in ("mode: enforce\nversion: STSv1\nmx: a\nmax_age: 1\n",  # version first
                "version: STSv1\nmode: strict\nmx: a\nmax_age: 1\n",
                "version: STSv1\nmode: enforce\nmax_age: 1\n",  # no mx
                "version: STSv1\nmode: enforce\nmx: a\nmax_age: 31557601\n",
                "version: STSv1\nmode: enforce\nmx: a\nmax_age: -1\n",
                "version: STSv1\nno colon here\n"):
        with pytest.raises(PolicyInvalid):
            parse_policy(bad)
    assert parse_txt(["v=STSv1; id=20240101T000000;", "other"]) == "20240101T000000"
    assert parse_txt(["v=spf1 -all"]) is None
    for bad_txt in (["v=STSv1; id=a;", "v=STSv1; id=b;"], ["v=STSv1; id=has-dash;"], ["v=STSv1;"]):
        with pytest.raises(PolicyInvalid):
            parse_txt(bad_txt)
    assert mx_matches("*.example.com", "mx.example.com") and not mx_matches("*.example.com", "example.com")


# -- enforce -------------------------------------------------------------------------------------------------

async def test_enforce_delivers_only_to_a_matching_mx_with_a_valid_certificate_and_reports_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mta")
    async with sts_world(tmp_path) as w:
        # sts.test: the preferred MX is not in the policy (and offers no TLS): skipped; the policy's MX takes it.
        w.publish("sts.test", "1", policy("enforce", "mx.sts.test"))
        w.dns.mx("sts.test", 10, "rogue.sts.test")
        w.dns.a("rogue.sts.test", PLAIN)
        w.dns.mx("sts.test", 20, "mx.sts.test")
        w.dns.a("mx.sts.test", GOOD)
        # bad.test: the policy's MX presents a certificate for another name.
        w.publish("bad.test", "1", policy("enforce", "mx.bad.test"))
        w.dns.mx("bad.test", 10, "mx.bad.test")
        w.dns.a("mx.bad.test", WRONG)
        # none.test: no MX host is one the policy names.
        w.publish("none.test", "1", policy("enforce", "mx.none.test"))
        w.dns.mx("none.test", 10, "other.none.test")
        w.dns.a("other.none.test", GOOD)

        relay = await start_relay(w.nursery, w.config)
        watch = DeliveryWatch(relay)
        await send(relay, "bob@sts.test")
        (done,) = await watch.wait_for(Status.DELIVERED, 1, recipient="bob@sts.test")
        assert done.next_hop.startswith("mx.sts.test[127.0.0.1]") and done.next_hop.endswith("tls=mta-sts")
        (msg,) = await w.hops[GOOD].wait_messages(1)
        assert msg.tls and msg.recipients == ["bob@sts.test"]
        assert w.hops[PLAIN].connections == 0
        cached = json.loads((tmp_path / "spool" / "mta-sts" / "sts.test.json").read_text())
        assert cached["id"] == "1" and "mx: mx.sts.test" in cached["policy"]

        await send(relay, "carol@bad.test")
        deferred = (await watch.wait_for(Status.DEFERRED, 1, recipient="carol@bad.test"))[0]
        assert "mx.bad.test" in deferred.reply and "TLS handshake failed" in deferred.reply
        assert w.hops[WRONG].messages == []

        await send(relay, "dave@none.test")
        deferred = (await watch.wait_for(Status.DEFERRED, 1, recipient="dave@none.test"))[0]
        assert "MTA-STS policy of none.test (enforce): no MX host matches" in deferred.reply
        assert deferred.enhanced == "4.7.5"
        assert len(w.hops[GOOD].messages) == 1
        lines = [r.getMessage() for r in caplog.records]
        assert any("event=mta_sts_skip" in line and "relay=rogue.sts.test" in line for line in lines), lines

        # TLS-RPT: roll the day up as if it had ended.
        rpt = reporter(relay)
        rpt.clock = lambda: time.time() + 86400
        written = {os.path.basename(p).split("!")[1]: p for p in rpt.roll_up()}
        assert {"sts.test", "bad.test", "none.test"} <= set(written)
        ok = json.loads(Path(written["sts.test"]).read_text())
        assert ok["organization-name"] == "relay.test" and ok["contact-info"] == "postmaster@relay.test"
        assert ok["date-range"]["start-datetime"].endswith("T00:00:00Z")
        by_type = {p["policy"]["policy-type"]: p for p in ok["policies"]}
        sts = by_type["sts"]
        assert sts["policy"]["policy-domain"] == "sts.test" and sts["policy"]["mx-host"] == ["mx.sts.test"]
        assert "mode: enforce" in sts["policy"]["policy-string"]
        assert sts["summary"]["total-successful-session-count"] == 1
        # the skipped MX counts as a failure of the policy
        assert sts["summary"]["total-failure-session-count"] == 1
        assert sts["failure-details"][0]["receiving-mx-hostname"] == "rogue.sts.test"
        bad = json.loads(Path(written["bad.test"]).read_text())["policies"][0]
        assert bad["summary"]["total-successful-session-count"] == 0
        assert bad["summary"]["total-failure-session-count"] >= 1
        detail = bad["failure-details"][0]
        assert detail["result-type"] == "certificate-host-mismatch"
        assert (detail["receiving-mx-hostname"], detail["receiving-ip"]) == ("mx.bad.test", WRONG)
        assert detail["sending-mta-ip"] == "127.0.0.1"
        rolled = time.strftime("%Y-%m-%d", time.gmtime(time.time() - 60)) + ".jsonl"  # the day just reported
        assert rolled not in os.listdir(tmp_path / "spool" / "tls-report")


async def test_testing_mode_delivers_and_logs_what_enforce_would_have_done(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mta")
    async with sts_world(tmp_path) as w:
        # The only MX is named by the policy but presents a certificate for another name.
        w.publish("try.test", "7", policy("testing", "mx.try.test", "*.elsewhere.test"))
        w.dns.mx("try.test", 10, "mx.try.test")
        w.dns.a("mx.try.test", WRONG)
        relay = await start_relay(w.nursery, w.config)
        watch = DeliveryWatch(relay)
        await send(relay, "erin@try.test")
        (done,) = await watch.wait_for(Status.DELIVERED, 1, recipient="erin@try.test")
        assert done.next_hop.endswith("tls=encrypted")
        (msg,) = await w.hops[WRONG].wait_messages(1)
        assert msg.tls
        lines = [r.getMessage() for r in caplog.records if "event=mta_sts_testing" in r.getMessage()]
        assert any("would=defer" in line and "domain=try.test" in line for line in lines), lines

        # An MX outside the policy: testing mode still delivers there, and says it would have skipped it.
        w.dns.forget("try.test", "MX")
        w.dns.mx("try.test", 10, "rogue.try.test")
        w.dns.a("rogue.try.test", PLAIN)
        await send(relay, "fred@try.test")
        (done,) = await watch.wait_for(Status.DELIVERED, 1, recipient="fred@try.test")
        assert done.next_hop.startswith("rogue.try.test") and done.next_hop.endswith("tls=none")
        lines = [r.getMessage() for r in caplog.records if "event=mta_sts_testing" in r.getMessage()]
        assert any("would=skip" in line and "relay=rogue.try.test" in line for line in lines), lines
        assert transport(relay).policies.sts.fetches == 1  # the second message used the cached policy


async def test_the_cached_policy_survives_a_restart_and_a_new_txt_id_fetches_again(tmp_path: Path) -> None:
    async with sts_world(tmp_path) as w:
        w.publish("sts.test", "1", policy("enforce", "mx.sts.test"))
        w.dns.mx("sts.test", 10, "mx.sts.test")
        w.dns.a("mx.sts.test", GOOD)
        w.dns.mx("sts.test", 20, "rogue.sts.test")
        w.dns.a("rogue.sts.test", PLAIN)
        async with trio.open_nursery() as first:
            relay = await start_relay(first, w.config)
            await send(relay, "bob@sts.test")
            await DeliveryWatch(relay).wait_for(Status.DELIVERED, 1)
            first.cancel_scope.cancel()
        assert len(w.https.requests) == 1

        # The policy server is gone; the TXT id is unchanged: a relay started anew keeps enforcing from the cache
        # on disk. (A new spool beside it, with the same cache: this process still holds the first spool's lock.)
        again = parse_config(relay_config_text(
            {"localhost": "maildir:maildir", "*": "mx?tls=mta-sts"},
            w.extra + f'mta_sts_cache = "{tmp_path / "spool" / "mta-sts"}"\n', spool_dir="spool2"),
            source=str(tmp_path / "again.toml"), base_dir=str(tmp_path))
        w.https.policies.clear()
        w.dns.forget("sts.test", "MX")
        w.dns.mx("sts.test", 10, "rogue.sts.test")  # an attacker's MX now comes first
        w.dns.mx("sts.test", 20, "mx.sts.test")
        async with trio.open_nursery() as second:
            relay = await start_relay(second, again)
            watch = DeliveryWatch(relay)
            await send(relay, "carol@sts.test")
            (done,) = await watch.wait_for(Status.DELIVERED, 1)
            assert done.next_hop.startswith("mx.sts.test") and done.next_hop.endswith("tls=mta-sts")
            assert transport(relay).policies.sts.fetches == 0 and len(w.https.requests) == 1
            assert w.hops[PLAIN].messages == []

            # A new id: the new policy is fetched and followed (it names only the host without TLS: deferred).
            w.publish("sts.test", "2", policy("enforce", "rogue.sts.test"))
            await send(relay, "dave@sts.test")
            (deferred,) = await watch.wait_for(Status.DEFERRED, 1, recipient="dave@sts.test")
            assert "does not offer STARTTLS" in deferred.reply
            assert transport(relay).policies.sts.fetches == 1
            assert w.hops[PLAIN].messages == []
            cached = json.loads((tmp_path / "spool" / "mta-sts" / "sts.test.json").read_text())
            assert cached["id"] == "2"
            second.cancel_scope.cancel()


async def test_a_policy_that_cannot_be_fetched_leaves_delivery_as_before_and_is_reported(tmp_path: Path) -> None:
    async with sts_world(tmp_path) as w:
        # A TXT record, but the HTTPS server has no policy (404) for the domain: no policy is in force.
        w.dns.txt("_mta-sts.sts.test", "v=STSv1; id=1;")
        w.dns.mx("sts.test", 10, "rogue.sts.test")
        w.dns.a("rogue.sts.test", PLAIN)
        relay = await start_relay(w.nursery, w.config)
        watch = DeliveryWatch(relay)
        await send(relay, "bob@sts.test")
        (done,) = await watch.wait_for(Status.DELIVERED, 1)
        assert done.next_hop.endswith("tls=none")
        rpt = reporter(relay)
        rpt.clock = lambda: time.time() + 86400
        (path,) = rpt.roll_up()
        (entry,) = json.loads(Path(path).read_text())["policies"]
        assert entry["failure-details"][0]["result-type"] == "sts-policy-fetch-error"
        assert "HTTP 404" in entry["failure-details"][0]["failure-reason-code"]


# -- what a security failure is called (RFC 3463 §3.8) and what TLS-RPT says of it (RFC 8460 §4.3) ----------------

async def show(tmp_path: Path, qid: str) -> str:
    """``mta queue show QID`` of the relay's spool, from another process."""
    (tmp_path / "show.toml").write_text('[spool]\ndir = "spool"\n[routes]\n"*" = "discard"\n')
    proc = await trio.run_process([os.path.join(os.path.dirname(sys.executable), "mta"), "queue", "show", qid,
                                   "--config", str(tmp_path / "show.toml")],
                                  capture_stdout=True, capture_stderr=True, check=False, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.decode()


def delay_status(maildir: Path) -> list[str]:
    """The ``Status`` of each recipient in the delay notices that reached ``maildir``."""
    found = []
    for path in sorted(maildir.glob("*")):
        notice = email.message_from_bytes(path.read_bytes(), policy=email.policy.default)
        report = list(notice.iter_parts())[1].get_payload()
        assert isinstance(report, list)
        found += [str(part["Status"]) for part in report[1:] if isinstance(part, email.message.Message)]
    return found


async def test_a_tls_failure_under_a_policy_is_deferred_with_a_security_code_in_the_log_queue_show_and_dsn(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A certificate for another name is ``4.7.5``, an MX that offers no STARTTLS ``4.7.4`` (they were ``4.4.1``,
    "no answer from host"); the delay notice the sender gets says the same."""
    caplog.set_level(logging.INFO, logger="mta")
    async with sts_world(tmp_path, delivery='delay_warning = "1s"\n') as w:
        w.publish("bad.test", "1", policy("enforce", "mx.bad.test"))
        w.dns.mx("bad.test", 10, "mx.bad.test")
        w.dns.a("mx.bad.test", WRONG)
        w.publish("none.test", "1", policy("enforce", "mx.none.test"))
        w.dns.mx("none.test", 10, "mx.none.test")
        w.dns.a("mx.none.test", PLAIN)
        relay = await start_relay(w.nursery, w.config)
        watch = DeliveryWatch(relay)
        await send(relay, "carol@bad.test")
        await send(relay, "dave@none.test")
        cert = (await watch.wait_for(Status.DEFERRED, 1, recipient="carol@bad.test"))[0]
        starttls = (await watch.wait_for(Status.DEFERRED, 1, recipient="dave@none.test"))[0]
        assert (cert.enhanced, starttls.enhanced) == ("4.7.5", "4.7.4")
        assert "TLS handshake failed" in cert.reply and "does not offer STARTTLS" in starttls.reply
        logged = {e["to"]: e for e in events([r for r in caplog.records if r.name == "mta.delivery"], "delivery")}
        assert (logged["<carol@bad.test>"]["dsn"], logged["<dave@none.test>"]["dsn"]) == ("4.7.5", "4.7.4")
        await watch.wait_for(Status.DELIVERED, 2, recipient="alice@localhost")  # the two delay notices
        qids = {e["to"]: e["qid"] for e in logged.values()}
        assert "carol@bad.test: deferred [tls]: 4.7.5 " in await show(tmp_path, qids["<carol@bad.test>"])
        assert "dave@none.test: deferred [tls]: 4.7.4 " in await show(tmp_path, qids["<dave@none.test>"])
    assert sorted(delay_status(tmp_path / "maildir" / "alice" / "new")) == ["4.7.4", "4.7.5"]


async def test_on_dane_and_mta_sts_a_policy_naming_no_mx_is_refused_as_policy_not_as_every_hop_failing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With DANE also on the route and no hop DANE secures, MTA-STS's refusal is the answer: ``4.7.5`` with
    ``cause=tls_policy`` (it was ``4.4.1``, each hop refused with ``cause=tls``)."""
    caplog.set_level(logging.INFO, logger="mta")
    async with sts_world(tmp_path, route="mx?tls=dane,mta-sts") as w:
        w.publish("none.test", "1", policy("enforce", "mx.none.test"))
        w.dns.mx("none.test", 10, "other.none.test")
        w.dns.a("other.none.test", GOOD)
        relay = await start_relay(w.nursery, w.config)
        watch = DeliveryWatch(relay)
        await send(relay, "dave@none.test")
        (deferred,) = await watch.wait_for(Status.DEFERRED, 1, recipient="dave@none.test")
        assert deferred.enhanced == "4.7.5", deferred
        assert "MTA-STS policy of none.test (enforce): no MX host matches" in deferred.reply
        (failed,) = events([r for r in caplog.records if r.name == "mta.smtp"], "connect_failed")
        assert failed["cause"] == "tls_policy", failed
        assert w.hops[GOOD].connections == 0


async def test_tls_rpt_leaves_out_the_sending_ip_of_a_session_never_made(tmp_path: Path) -> None:
    """An MX skipped by the policy was never connected to: its failure has no ``sending-mta-ip`` (it was ``""``,
    which RFC 8460 does not allow: the field is an IP address); a session that was made names it."""
    async with sts_world(tmp_path) as w:
        w.publish("sts.test", "1", policy("enforce", "mx.sts.test"))
        w.dns.mx("sts.test", 10, "rogue.sts.test")
        w.dns.a("rogue.sts.test", PLAIN)
        w.dns.mx("sts.test", 20, "mx.sts.test")
        w.dns.a("mx.sts.test", WRONG)
        relay = await start_relay(w.nursery, w.config)
        watch = DeliveryWatch(relay)
        await send(relay, "bob@sts.test")
        await watch.wait_for(Status.DEFERRED, 1, recipient="bob@sts.test")
        rpt = reporter(relay)
        rpt.clock = lambda: time.time() + 86400
        (path,) = rpt.roll_up()
        (entry,) = json.loads(Path(path).read_text())["policies"]
        by_mx = {d["receiving-mx-hostname"]: d for d in entry["failure-details"]}
        assert "sending-mta-ip" not in by_mx["rogue.sts.test"], by_mx
        assert by_mx["mx.sts.test"]["sending-mta-ip"] == "127.0.0.1"
