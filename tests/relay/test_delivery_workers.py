"""``[delivery] processes``: SMTP deliveries in worker processes, against the real relay and real next hops.

The relay runs in the test (its workers are real child processes) or as
``mta serve``; the next hops are ``relay_support``'s SMTP servers on
127.0.0.1. A worker is killed with SIGKILL while the next hop holds a
message's ``250``: the message is deferred, delivered by the worker started
in its place, never lost, and the relay takes mail all along.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import smtplib
from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest
import trio
import trustme
from process_support import RelayProcess
from relay_support import (
    DeliveryWatch,
    GatedHop,
    NextHop,
    relay_config_text,
    server_context,
    start_relay,
    write_relay_config,
)

from mta.config import Config, parse_config
from mta.delivery.smtp_transport import SmtpTransport
from mta.delivery.transport import Destination, Job
from mta.delivery.workers import DeliveryWorkers
from mta.observe.logline import LogEvent
from spool.aio.inline_commit import INLINE_SYNC_FAST
from spool.errors import SyncFailed
from spool.format.record import Status
from spool.read import listing as admin


def _send(port: int, sender: str, rcpts: list[str], body: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.sendmail(sender, rcpts, body)


async def send(port: int, sender: str, rcpts: list[str], body: str) -> None:
    await trio.to_thread.run_sync(_send, port, sender, rcpts, body)


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if isinstance(r.msg, LogEvent) and r.msg.name == name]


async def test_mail_goes_through_a_worker_process_to_the_next_hop(tmp_path: Path, ca: trustme.CA,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as nursery:
        hop = NextHop(ssl_context=server_context(ca.issue_cert("127.0.0.1")))
        port = await hop.start(nursery)
        cfg = _with_processes(tmp_path, port, 1)
        relay = await start_relay(nursery, cfg)
        assert isinstance(relay.workers, DeliveryWorkers) and len(relay.workers.pids) == 1
        # The deliveries' CPU is in the worker: a lone client's fdatasync may run in the loop's thread.
        assert relay.aspool.inline_sync_max == INLINE_SYNC_FAST
        worker_pid = relay.workers.pids[0]
        assert worker_pid != os.getpid()
        watch = DeliveryWatch(relay)
        for i in range(5):
            await send(relay.ports[0], "a@example.org", [f"r{i}@far.example", f"s{i}@far.example"],
                       f"Subject: m{i}\r\n\r\n" + f"line {i}\r\n" * 500)
        msgs = await hop.wait_messages(5)
        await watch.wait_for(Status.DELIVERED, 10)
        assert sorted(tuple(m.recipients) for m in msgs) == sorted(
            (f"r{i}@far.example", f"s{i}@far.example") for i in range(5))
        assert all(m.tls for m in msgs)  # the worker's transport did STARTTLS, as the relay's would
        assert all(f"line {i}\r\n".encode() * 500 in m.data for i, m in enumerate(sorted(msgs, key=_subject)))
        # What the transport logs in the worker comes out of the relay's own logging, with the worker's pid.
        tls = events(caplog, "tls")
        assert tls and all(r.process == worker_pid for r in tls)
        assert [r.process for r in events(caplog, "delivery")] and \
            all(r.process == os.getpid() for r in events(caplog, "delivery"))  # the outcome is recorded here
        assert len(events(caplog, "worker_started")) == 1
        nursery.cancel_scope.cancel()


def _subject(m: object) -> bytes:
    match = re.search(rb"Subject: (m\d+)", m.data)  # type: ignore[attr-defined]
    assert match
    return match.group(1)


def _with_processes(tmp_path: Path, port: int, processes: int) -> Config:
    text = relay_config_text({"*": f"smtp://127.0.0.1:{port}"})
    text = text.replace("[routes]", f"[delivery]\nprocesses = {processes}\n\n[routes]")
    return parse_config(text, source=str(tmp_path / "test.toml"), base_dir=str(tmp_path))


async def test_a_big_body_is_read_by_the_worker_chunk_by_chunk(tmp_path: Path) -> None:
    """Not in the spool's cache (body_cache = 0) and bigger than INLINE_BODY: read from the segment files by the
    worker as it is sent, none of it through the relay."""
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        cfg = _with_processes(tmp_path, port, 1)
        cfg = attrs.evolve(cfg, spool=attrs.evolve(cfg.spool, body_cache=0))
        relay = await start_relay(nursery, cfg)
        body = "".join(f"{i:08d} the quick brown fox jumps over the lazy dog\r\n" for i in range(20000))  # ~1.1 MB
        await send(relay.ports[0], "a@example.org", ["big@far.example"], "Subject: big\r\n\r\n" + body)
        (msg,) = await hop.wait_messages(1)
        assert body.encode() in msg.data
        assert relay.workers is not None and relay.workers.served == 0
        nursery.cancel_scope.cancel()


def _flip_in_spool(spool: str, marker: bytes) -> None:
    """Flip one bit of ``marker``'s bytes where the spool's segments hold them: that DATA record is damaged."""
    for path in sorted(os.path.join(d, name) for d, _, names in os.walk(spool) for name in names
                       if os.path.isfile(os.path.join(d, name))):
        with open(path, "r+b") as f:
            at = f.read().find(marker)
            if at >= 0:
                f.seek(at)
                f.write(bytes([marker[0] ^ 0x01]))
                return
    raise AssertionError(f"{marker!r} is in no segment of {spool}")


async def test_a_body_damaged_where_the_worker_pulls_it_bounces_and_the_worker_serves_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A big body damaged halfway, found in the relay (by its own read for the worker, or before the attempt):
    the message bounces with the reason, as in the relay; the same worker then delivers the next message
    (test_worker_bodies has the worker's fallback to the relay's reads)."""
    caplog.set_level(logging.INFO)
    with trio.socket.socket() as probe:  # a port nobody listens on yet: the first attempt is deferred
        await probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with trio.open_nursery() as nursery:
        cfg = _with_processes(tmp_path, port, 1)
        cfg = attrs.evolve(cfg, spool=attrs.evolve(cfg.spool, body_cache=0))
        relay = await start_relay(nursery, cfg)
        assert relay.workers is not None
        watch = DeliveryWatch(relay)
        worker_pid = relay.workers.pids[0]
        body = "".join(f"{i:08d} the quick brown fox jumps over the lazy dog\r\n" for i in range(20000))  # ~1.1 MB
        await send(relay.ports[0], "a@example.org", ["big@far.example"], "Subject: big\r\n\r\n" + body)
        await watch.wait_for(Status.DEFERRED, 1, recipient="big@far.example")  # nobody listens yet
        _flip_in_spool(cfg.spool.dir, b"00012345 the quick brown fox")
        hop = NextHop()
        await hop.start(nursery, port=port)
        (bounce,) = await watch.wait_for(Status.BOUNCED, 1, recipient="big@far.example", timeout=90)
        assert bounce.enhanced == "5.3.0" and "damaged" in bounce.reply
        await send(relay.ports[0], "a@example.org", ["next@far.example"], "Subject: next\r\n\r\nafter\r\n")
        await watch.wait_for(Status.DELIVERED, 1, recipient="next@far.example", timeout=90)
        assert relay.workers.pids == [worker_pid] and relay.workers.deaths == 0
        assert "big@far.example" not in [r for m in hop.messages for r in m.recipients]  # never sent whole
        nursery.cancel_scope.cancel()


async def test_a_worker_killed_after_the_final_dot_holds_the_message_in_doubt(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The final dot reached the next hop, its 250 had not: the worker's SIGKILL leaves the recipient in doubt,
    held (``in_doubt = "hold"``), as the relay's own kill -9 would; it is not delivered a second time."""
    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as nursery:
        hop = GatedHop()
        port = await hop.start(nursery)
        relay = await start_relay(nursery, _with_processes(tmp_path, port, 1))
        assert relay.workers is not None
        watch = DeliveryWatch(relay)
        first_pid = relay.workers.pids[0]
        await send(relay.ports[0], "a@example.org", ["held@far.example"],
                   "Subject: one\r\nMessage-ID: <one@test>\r\n\r\nheld\r\n")
        await hop.wait_until(lambda: len(hop.held) == 1)  # the next hop has the data; its 250 waits
        os.kill(first_pid, signal.SIGKILL)
        (deferred,) = await watch.wait_for(Status.DEFERRED, 1)
        assert deferred.recipient == "held@far.example"
        assert "delivery worker 0" in deferred.reply and "died" in deferred.reply and "signal 9" in deferred.reply
        died = events(caplog, "worker_died")
        assert len(died) == 1
        fields = died[0].msg.fields if isinstance(died[0].msg, LogEvent) else {}
        assert fields["worker_pid"] == first_pid and fields["status"] == "signal 9"
        # The deferral is one line with the reason: the death was logged where it was seen, no traceback.
        errors = events(caplog, "delivery_error")
        assert errors and all(r.exc_info is None for r in errors)
        # The relay keeps taking mail while the worker is down and after it is back.
        await send(relay.ports[0], "a@example.org", ["next@far.example"],
                   "Subject: two\r\nMessage-ID: <two@test>\r\n\r\nafter\r\n")
        hop.new_life(accept_first=10)
        await watch.wait_for(Status.DELIVERED, 1, recipient="next@far.example", timeout=90)
        assert relay.workers.pids and relay.workers.pids[0] != first_pid
        assert relay.workers.deaths == 1
        (line,) = events(caplog, "in_doubt")
        assert isinstance(line.msg, LogEvent) and line.msg.fields["to"] == "held@far.example"
        (held,) = [m for m in admin.iter_live(relay.aspool.core) if m.envelope.recipients == ("held@far.example",)]
        assert held.held and held.envelope.in_doubt == ("held@far.example",)
        assert hop.ids().count("one@test") == 1 and hop.ids().count("two@test") == 1  # never sent twice
        nursery.cancel_scope.cancel()


def _serve_config(tmp_path: Path, port: int) -> Path:
    """A config file for ``mta serve`` with one delivery worker, delivering to the next hop on ``port``."""
    config = write_relay_config(tmp_path, {"*": f"smtp://127.0.0.1:{port}"})
    config.write_text(config.read_text().replace("[routes]", "[delivery]\nprocesses = 1\n\n[routes]"))
    return config


async def test_processes_0_delivers_in_the_relay_process(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        relay = await start_relay(nursery, _with_processes(tmp_path, port, 0))
        assert relay.workers is None
        assert isinstance(relay.scheduler.transports["smtp"], SmtpTransport)
        assert relay.aspool.inline_sync_max == 0, "deliveries in the loop: every fdatasync in the thread"
        await send(relay.ports[0], "a@example.org", ["x@far.example"], "Subject: x\r\n\r\nx\r\n")
        await hop.wait_messages(1)
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_a_worker_whose_relay_died_exits(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        relay = RelayProcess(_serve_config(tmp_path, port))
        await relay.start(nursery)
        await relay.wait_output(lambda: any("event=worker_started" in line for line in relay.lines), 60,
                                "the worker's start")
        (line,) = [line for line in relay.lines if "event=worker_started" in line]
        match = re.search(r"worker_pid=(\d+)", line)
        assert match
        worker = int(match.group(1))
        pidfd = os.pidfd_open(worker)
        try:
            await relay.kill()
            with trio.fail_after(30):
                await trio.lowlevel.wait_readable(pidfd)  # readable once the worker has exited
        finally:
            os.close(pidfd)
        with trio.fail_after(30):
            while not any("event=worker_exit" in line for line in relay.lines):
                await relay._changed.wait()
        nursery.cancel_scope.cancel()


def _parent_and_command(pid: int) -> tuple[int, str]:
    with open(f"/proc/{pid}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return ppid, f.read().replace(b"\0", b" ").decode()


def _worker_pids(lines: list[str]) -> list[int]:
    return [int(m.group(1)) for line in lines if "event=worker_started" in line
            for m in [re.search(r"worker_pid=(\d+)", line)] if m]


@pytest.mark.slow
async def test_mta_serve_forks_its_worker_before_its_loop_and_starts_a_new_interpreter_after_a_death(
        tmp_path: Path) -> None:
    """The first worker of ``mta serve`` is forked from the relay (it shares the relay's pages: no command line
    of its own), delivers, and after a kill -9 its successor is a new interpreter that delivers too."""
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        relay = RelayProcess(_serve_config(tmp_path, port))
        await relay.start(nursery)
        assert relay.proc is not None
        await relay.wait_output(lambda: len(_worker_pids(relay.lines)) == 1, 60, "the worker's start")
        (first,) = _worker_pids(relay.lines)
        ppid, command = _parent_and_command(first)
        assert ppid == relay.proc.pid and "worker_main" not in command and " serve " in command
        await send(relay.port, "a@example.org", ["one@far.example"], "Subject: one\r\n\r\nforked\r\n")
        await relay.wait_output(lambda: any(re.search(r" event=delivery .*to=<one@far.example>.* status=sent", line)
                                            for line in relay.lines), 60, "the first message's outcome")
        os.kill(first, signal.SIGKILL)
        await relay.wait_output(lambda: any("event=worker_died" in line and f"worker_pid={first}" in line
                                            and 'status="signal 9"' in line for line in relay.lines),
                                60, "the forked worker's death, reaped with its status")
        await relay.wait_output(lambda: len(_worker_pids(relay.lines)) == 2, 60, "the next worker's start")
        second = _worker_pids(relay.lines)[1]
        ppid, command = _parent_and_command(second)
        assert ppid == relay.proc.pid and "mta.delivery.worker_main" in command
        await send(relay.port, "a@example.org", ["two@far.example"], "Subject: two\r\n\r\nspawned\r\n")
        msgs = await hop.wait_messages(2)
        assert sorted(r for m in msgs for r in m.recipients) == ["one@far.example", "two@far.example"]
        nursery.cancel_scope.cancel()


async def test_tls_policy_counts_and_log_lines_of_a_worker_reach_the_relay(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """MTA-STS in a worker: the policy's fetch line and the session's count come back; the TLS-RPT journal is
    written by the worker where the relay's roll-up reads it."""
    from test_mta_sts import GOOD, policy, sts_world  # type: ignore[import-not-found]  # its world of DNS, HTTPS, MXs

    caplog.set_level(logging.INFO)
    async with sts_world(tmp_path) as w:
        w.publish("sts.test", "1", policy("enforce", "mx.sts.test"))
        w.dns.mx("sts.test", 10, "mx.sts.test")
        w.dns.a("mx.sts.test", GOOD)
        cfg = attrs.evolve(w.config, delivery=attrs.evolve(w.config.delivery, processes=1))
        relay = await start_relay(w.nursery, cfg)
        assert relay.workers is not None
        worker_pid = relay.workers.pids[0]
        watch = DeliveryWatch(relay)
        await send(relay.ports[0], "alice@localhost", ["bob@sts.test"], "Subject: sts\r\n\r\nbody\r\n")
        (done,) = await watch.wait_for(Status.DELIVERED, 1, recipient="bob@sts.test")
        assert done.next_hop.endswith("tls=mta-sts")
        assert relay.metrics.registry.get_sample_value(
            "logspool_tls_policy_total", {"policy": "mta-sts", "result": "success"}) == 1.0
        fetched = events(caplog, "mta_sts")
        assert fetched and all(r.process == worker_pid for r in fetched)
        journal = list((tmp_path / "spool" / "tls-report").glob("*.jsonl"))
        assert len(journal) == 1 and '"domain": "sts.test"' in journal[0].read_text()


async def test_a_failed_fsync_of_the_point_of_no_return_ends_the_relay_and_the_dot_is_never_sent(
        tmp_path: Path) -> None:
    """The worker asks for the point of no return (``dot``); making it durable fails its fsync: that is no
    peer's doing, so it ends the workers' nursery (the relay: the next start recovers), and the next hop never
    sees the message's final dot. A full disk, by contrast, only defers the batch (the other tests)."""
    async with trio.open_nursery() as outer:
        hop = NextHop()
        port = await hop.start(outer)

        async def failing_fsync(index: int, recipients: Sequence[str]) -> None:
            raise SyncFailed(5, "fdatasync failed (test)")

        workers = DeliveryWorkers(_with_processes(tmp_path, port, 1), 1)
        job = Job("Q1", "a@example.org", ("b@far.example",), (b"Subject: x\r\n\r\nbody\r\n",), 24)
        contained: list[Exception] = []

        async def deliver() -> None:
            try:
                await workers.deliver(Destination("smtp", f"127.0.0.1:{port}"), [job], before_dot=failing_fsync)
            except Exception as exc:  # what a batch boundary would get (contained, had the workers not ended)
                contained.append(exc)

        with trio.fail_after(30), pytest.raises(BaseExceptionGroup) as ended:  # contained, the workers ran on
            async with trio.open_nursery() as nursery:
                await nursery.start(workers.run)
                nursery.start_soon(deliver)
        assert ended.value.subgroup(SyncFailed) is not None, ended.value
        assert not any(isinstance(exc, SyncFailed) for exc in contained), "it ended the workers, not one batch"
        assert hop.messages == []
        outer.cancel_scope.cancel()


def _send_many(port: int, client: int, count: int) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=60) as s:
        for i in range(count):
            s.sendmail("a@example.org", [f"c{client}m{i}@far.example"], f"Subject: {client}/{i}\r\n\r\nbody\r\n")


async def test_under_concurrency_the_worker_marks_its_own_points_of_no_return(tmp_path: Path) -> None:
    """Twenty clients at once: the STARTs of most claims are durable by their dots, so the worker marks those
    itself (its own file, no round trip); each message passes exactly one point, by the worker or the relay."""
    clients, each = 20, 10
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        relay = await start_relay(nursery, _with_processes(tmp_path, port, 1))
        assert relay.workers is not None
        (worker_pid,) = relay.workers.pids
        watch = DeliveryWatch(relay)
        async with trio.open_nursery() as senders:
            for c in range(clients):
                senders.start_soon(trio.to_thread.run_sync, _send_many, relay.ports[0], c, each)
        await watch.wait_for(Status.DELIVERED, clients * each)
        registry = relay.metrics.registry
        by_worker = registry.get_sample_value("logspool_points_of_no_return_total", {"by": "worker"}) or 0.0
        by_relay = registry.get_sample_value("logspool_points_of_no_return_total", {"by": "relay"}) or 0.0
        assert by_worker + by_relay == clients * each
        assert by_worker > 0, (by_worker, by_relay)
        # Every mark was made durable by one of the worker's fdatasyncs, and each covers one mark or more.
        syncs = registry.get_sample_value("logspool_worker_fsyncs_total") or 0.0
        assert 0 < syncs <= by_worker, (syncs, by_worker)
        marks = list((tmp_path / "spool" / "marks").glob("*.marks"))
        assert marks and all(m.name.startswith(f"w0-{worker_pid}-") for m in marks)
        nursery.cancel_scope.cancel()
