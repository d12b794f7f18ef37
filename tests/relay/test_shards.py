"""Several relay processes, one spool shard each (``[server] processes``), as real processes.

``mta serve`` runs as a subprocess and supervises one child per shard; the
next hop runs in the test (``relay_support.NextHop``). Readiness is each
shard's "listening on ... shard K (pid P)" log line; the death of a process
is polled for in /proc, with a bound, never slept for.
"""

from __future__ import annotations

import os
import re
import signal
import smtplib
import struct
from collections import Counter
from pathlib import Path

import pytest
import trio
from process_support import ServeProcess, mta, mta_json
from relay_support import NextHop, write_relay_config

from mta.config import parse_config
from mta.shards import (
    format_cursor,
    format_queue_id,
    parse_cursor,
    parse_queue_id,
    shard_config,
    shard_count,
    shard_dir,
    shards_on_disk,
)
from mta.smtp.common import Reply

SHARD_UP = re.compile(r"listening on 127\.0\.0\.1:(\d+), spool \S+, shard (\d+) \(pid (\d+)\)")
SUPERVISOR = re.compile(r"supervisor \(pid (\d+)\): (\d+) processes")
MESSAGE_ID = re.compile(rb"^Message-ID: <([^>]+)>", re.MULTILINE | re.IGNORECASE)
QUEUED_AS = re.compile(rb"queued as (\S+)")
START_TIMEOUT = 180  # a loaded two-core machine takes a while to start two Python relays


# -- pure parts -------------------------------------------------------------------


def test_queue_ids_name_their_shard() -> None:
    assert format_queue_id(0x1000001A4, 0) == "1000001A4"
    assert format_queue_id(0x1000001A4, 3) == "1000001A4-3"
    for mid in (0x100000020, 0xFFFFFFFFFFFF):
        for shard in (0, 1, 17):
            assert parse_queue_id(format_queue_id(mid, shard)) == (shard, mid)
    assert parse_queue_id("1a4") == (0, 0x1A4)
    for bad in ("", "-1", "1A4-", "1A4-0", "1A4-x", "1A4--1", "G1", "1A4-01"):
        with pytest.raises(ValueError, match="not a queue id"):
            parse_queue_id(bad)
    assert format_cursor((1732356000123, 1, 0x1000001A4)) == "1732356000123.1000001A4-1"
    for cursor in ((1732356000123, 0, 0x1000001A4), (0, 2, 77)):
        assert parse_cursor(format_cursor(cursor)) == cursor
    assert parse_cursor(None) is None
    bad_cursors: list[object] = ["x-1", "77", "77-1", "1.", ".1A", "1.1A-0", "1.ZZ", 77, ["1.1A"], "1" * 16 + ".1A"]
    for cursor_text in bad_cursors:
        with pytest.raises(ValueError, match="not a list cursor"):
            parse_cursor(cursor_text)


def test_shard_layout_and_divided_limits(tmp_path: Path) -> None:
    config = parse_config('[server]\nprocesses = 3\nmetrics_listen = "127.0.0.1:9100"\n'
                          '[spool]\ndir = "q"\n[delivery]\nconcurrency = 100\nper_destination = 20\n',
                          base_dir=str(tmp_path))
    spool = str(tmp_path / "q")
    assert shard_count(config) == 3
    zero, two = shard_config(config, 0, 3), shard_config(config, 2, 3)
    assert zero.spool.dir == spool and two.spool.dir == shard_dir(spool, 2) == os.path.join(spool, "shards", "2")
    assert two.server.control_socket == os.path.join(spool, "shards", "2", "control.sock")
    assert zero.server.control_socket == os.path.join(spool, "control.sock")
    assert two.server.metrics_listen is not None and two.server.metrics_listen.port == 9102
    assert (two.delivery.concurrency, two.delivery.per_destination) == (34, 7)
    assert shard_config(parse_config("", base_dir=str(tmp_path)), 0, 1).delivery.per_destination == 20
    # Fewer processes than shards on disk: the shards still run.
    os.makedirs(shard_dir(spool, 4))
    os.makedirs(os.path.join(spool, "shards", "notashard"))
    assert shards_on_disk(spool) == 5
    assert shard_count(config) == 5


# -- real processes ---------------------------------------------------------------


class Supervised(ServeProcess):
    """``mta serve`` with ``processes`` > 1: the supervisor, its children and their log lines."""

    def __init__(self, config: Path) -> None:
        super().__init__(config)
        self.port = 0

    def shards_up(self) -> dict[int, int]:
        """shard -> pid of the latest process that logged it listens."""
        up: dict[int, int] = {}
        for line in self.lines:
            if m := SHARD_UP.search(line):
                self.port = int(m.group(1))
                up[int(m.group(2))] = int(m.group(3))
        return up

    async def start(self, nursery: trio.Nursery, shards: int) -> dict[int, int]:
        await self.launch(nursery)
        return await self.wait_up(shards)

    async def wait_up(self, shards: int, old: dict[int, int] | None = None) -> dict[int, int]:
        """Wait until every shard listens (with a pid other than ``old``'s for a shard that was restarted)."""
        old = old or {}

        def ready() -> bool:
            up = self.shards_up()
            return len(up) == shards and all(up[k] != old.get(k) for k in old)

        await self.wait_output(ready, START_TIMEOUT, "every shard listening")
        return self.shards_up()

    async def wait_logged(self, queue_ids: set[str], status: str) -> None:
        """Until each message's delivery log line with ``status`` is out (its outcome is durable)."""
        def missing() -> set[str]:
            return queue_ids - {m.group(1) for line in self.lines
                                if (m := re.search(rf" event=delivery qid=(\S+) .*to=<.*status={status}", line))}

        await self.wait_output(lambda: not missing(), START_TIMEOUT, lambda: f"a {status} line for {sorted(missing())}")


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


async def wait_dead(pids: list[int], timeout: float = 30) -> None:
    with trio.fail_after(timeout):
        while any(alive(p) for p in pids):
            await trio.sleep(0.05)  # polling for the kernel's doing: there is no event to wait on


def write_config(tmp_path: Path, hop_port: int, processes: int, retry: str = '["1s", "2s"]') -> Path:
    # "redeliver": the kills here land at any moment, and a delivery they interrupt must be delivered again
    # with no operator (holding in doubt is tests/relay/test_in_doubt_hold.py's).
    return write_relay_config(tmp_path, {"far.example": f"smtp://127.0.0.1:{hop_port}?tls=none"},
                              extra=f"processes = {processes}", retry=retry, spool_extra='in_doubt = "redeliver"')


def send(port: int, i: int) -> str:
    """One message on its own connection (so the kernel may pick either process); returns its queue id."""
    with smtplib.SMTP("127.0.0.1", port, timeout=120) as s:
        s.ehlo("client.test")
        assert s.mail("sender@example.org")[0] == 250
        assert s.rcpt(f"r{i}@far.example")[0] == 250
        code, text = s.data(f"Message-ID: <m{i}@test>\r\nSubject: {i}\r\n\r\nbody {i}\r\n".encode())
        assert code == 250, text
        m = QUEUED_AS.search(text)
        assert m, text
        return m.group(1).decode()


async def send_many(port: int, first: int, count: int, sessions: int = 20) -> dict[str, int]:
    """``count`` messages over ``sessions`` concurrent clients; queue id -> message number."""
    ids: dict[str, int] = {}
    todo = iter(range(first, first + count))

    async def client() -> None:
        for i in todo:
            ids[await trio.to_thread.run_sync(send, port, i)] = i

    async with trio.open_nursery() as nursery:
        for _ in range(sessions):
            nursery.start_soon(client)
    return ids


async def send_until_both_shards(port: int, first: int, batch: int = 10) -> dict[str, int]:
    """Send batches until each shard has taken at least one message (the kernel spreads by connection)."""
    ids: dict[str, int] = {}
    for n in range(20):
        ids |= await send_many(port, first + n * batch, batch, sessions=batch)
        if {parse_queue_id(q)[0] for q in ids} == {0, 1}:
            return ids
    raise AssertionError(f"one shard took every message: {sorted(ids)}")


def received_ids(hop: NextHop) -> Counter[str]:
    out: Counter[str] = Counter()
    for msg in hop.messages:
        m = MESSAGE_ID.search(msg.data)
        out[m.group(1).decode() if m else "?"] += 1
    return out


@pytest.mark.slow
async def test_two_processes_share_the_port_and_deliver_each_message_once(tmp_path: Path) -> None:
    total = 80
    with trio.fail_after(500):
        async with trio.open_nursery() as nursery:
            hop = NextHop()
            await hop.start(nursery)
            config = write_config(tmp_path, hop.port, processes=2)
            relay = Supervised(config)
            await relay.start(nursery, shards=2)
            assert any(SUPERVISOR.search(line) for line in relay.lines)

            ids = await send_many(relay.port, 0, total, sessions=20)
            assert len(ids) == total  # every message got its 250, each with its own queue id
            by_shard = Counter(parse_queue_id(q)[0] for q in ids)
            assert set(by_shard) == {0, 1}, by_shard
            assert os.listdir(tmp_path / "spool" / "shards" / "1" / "log")

            await hop.wait_messages(total, timeout=300)
            with trio.fail_after(300):  # the queue empties once every outcome is durable
                while (await mta_json(config, "queue", "count"))["count"]:
                    await trio.sleep(0.2)
            assert received_ids(hop) == Counter({f"m{i}@test": 1 for i in range(total)})
            # Shard 1's process names its messages HEX-1 in its delivery log too.
            shard1 = {q for q in ids if q.endswith("-1")}
            logged = {m.group(1) for line in relay.lines if (m := re.search(r" event=delivery qid=(\S+) .*to=<", line))}
            assert shard1 <= logged
            nursery.cancel_scope.cancel()


@pytest.mark.timeout(1200)  # two relay starts and a dozen `mta` commands, on a machine shared with load
@pytest.mark.slow
async def test_admin_commands_span_shards_and_fewer_processes_still_deliver(tmp_path: Path) -> None:
    refuse = [True]

    def policy(stage: str, value: object) -> Reply | None:
        return Reply(451, "4.3.0", "not now") if stage == "data" and refuse else None

    with trio.fail_after(1100):
        async with trio.open_nursery() as nursery:
            hop = NextHop(policy)
            await hop.start(nursery)
            config = write_config(tmp_path, hop.port, processes=2, retry='["1h"]')
            relay = Supervised(config)
            pids = await relay.start(nursery, shards=2)

            ids = await send_until_both_shards(relay.port, 0)
            await relay.wait_logged(set(ids), "deferred")
            q0 = next(q for q in ids if parse_queue_id(q)[0] == 0)
            q1 = next(q for q in ids if parse_queue_id(q)[0] == 1)
            assert (await mta_json(config, "queue", "count"))["count"] == len(ids)

            listed: list[str] = []
            arrivals: list[float] = []
            cursor: list[str] = []
            for _ in range(len(ids)):
                page = await mta_json(config, "queue", "list", "--limit", str(len(ids) // 2 + 1), *cursor)
                listed += [m["id"] for m in page["messages"]]
                arrivals += [m["arrival"] for m in page["messages"]]
                assert page["total"] == len(ids)
                if page["next"] is None:
                    break
                cursor = ["--cursor", str(page["next"])]
            assert sorted(listed) == sorted(ids)
            assert arrivals == sorted(arrivals)  # oldest first over both shards, not shard by shard

            shown = await mta_json(config, "queue", "show", q1)
            assert shown["id"] == q1 and shown["recipients"] == [f"r{ids[q1]}@far.example"]
            held = await mta_json(config, "queue", "hold", q0, q1)
            assert sorted(held["done"]) == sorted([q0, q1])
            assert (await mta_json(config, "queue", "release", q1))["done"] == [q1]
            assert (await mta_json(config, "queue", "delete", q0))["done"] == [q0]
            shape = await mta_json(config, "queue", "shape")
            assert [(r["domain"], r["total"], sum(r["counts"])) for r in shape["rows"]] == \
                [("far.example", len(ids) - 1, len(ids) - 1)]
            assert (await mta_json(config, "queue", "list", "--in-doubt"))["messages"] == []
            missing = await mta(config, "queue", "show", q1.replace("-1", "-7"))
            assert missing.returncode != 0 and b"no shard 7" in missing.stderr

            # kill -9 of the supervisor: its children follow it.
            await relay.kill()
            await wait_dead(list(pids.values()))
            # With no relay, the commands open every shard themselves.
            assert (await mta_json(config, "queue", "count"))["count"] == len(ids) - 1

            # One process configured, but shard 1 still holds mail: both shards run and deliver it.
            config.write_text(config.read_text().replace("processes = 2", "processes = 1"))
            refuse.clear()
            await relay.start(nursery, shards=2)
            await mta_json(config, "queue", "flush")
            await hop.wait_messages(len(ids) - 1, timeout=300)
            expected = {f"m{i}@test" for q, i in ids.items() if q != q0}
            assert set(received_ids(hop)) == expected
            nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_a_killed_shard_is_restarted_and_delivers_its_queue(tmp_path: Path) -> None:
    refuse = [True]

    def policy(stage: str, value: object) -> Reply | None:
        return Reply(451, "4.3.0", "not now") if stage == "data" and refuse else None

    with trio.fail_after(500):
        async with trio.open_nursery() as nursery:
            hop = NextHop(policy)
            await hop.start(nursery)
            config = write_config(tmp_path, hop.port, processes=2)
            relay = Supervised(config)
            pids = await relay.start(nursery, shards=2)
            ids = await send_until_both_shards(relay.port, 0)

            os.kill(pids[1], signal.SIGKILL)
            await wait_dead([pids[1]])
            restarted = await relay.wait_up(2, old={1: pids[1]})
            assert restarted[0] == pids[0]  # the other shard went on untouched
            assert any(re.search(rf"shard 1 \(pid {pids[1]}\) ended with signal 9", line) for line in relay.lines)

            refuse.clear()
            await hop.wait_messages(len(ids), timeout=300)
            assert set(received_ids(hop)) == {f"m{i}@test" for i in ids.values()}
            nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_sigterm_and_sighup_to_the_supervisor_reach_every_shard(tmp_path: Path) -> None:
    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            hop = NextHop()
            await hop.start(nursery)
            config = write_config(tmp_path, hop.port, processes=2)
            relay = Supervised(config)
            pids = await relay.start(nursery, shards=2)
            assert relay.proc is not None
            relay.proc.send_signal(signal.SIGHUP)
            await relay.wait_output(lambda: sum(" event=reload " in line for line in relay.lines) == 2, START_TIMEOUT,
                                    "a reload line from each shard")
            assert relay.proc.returncode is None and relay.shards_up() == pids
            relay.proc.send_signal(signal.SIGTERM)
            with trio.fail_after(START_TIMEOUT):
                await relay.proc.wait()
            assert relay.proc.returncode == 0, relay.lines
            assert sum("event=drain_end" in line for line in relay.lines) == 2, relay.lines
            assert not any("restarting in" in line for line in relay.lines), relay.lines
            nursery.cancel_scope.cancel()


def page_total(spool: Path) -> int:
    """The connected clients the shards' page holds, read as another process reads it (``mta.process.presence``)."""
    data = (spool / "shards" / "sessions").read_bytes()
    return sum(max(0, n) for n in struct.unpack(f"{len(data) // 4}i", data))


async def wait_page(spool: Path, want: int, timeout: float = 60) -> None:
    with trio.fail_after(timeout):
        while page_total(spool) != want:
            await trio.sleep(0.05)  # the shards write it from their own processes: nothing to wait on here


def alive_session(s: smtplib.SMTP) -> bool:
    try:
        return s.noop()[0] == 250
    except (smtplib.SMTPException, OSError):
        return False


async def test_the_shards_count_each_others_clients_and_a_killed_one_starts_from_none(tmp_path: Path) -> None:
    """Every shard sees the relay's clients (its outcomes ride a commit while any is connected), through
    admissions, releases and a kill -9."""
    with trio.fail_after(500):
        async with trio.open_nursery() as nursery:
            hop = NextHop()
            await hop.start(nursery)
            config = write_config(tmp_path, hop.port, processes=2)
            relay = Supervised(config)
            pids = await relay.start(nursery, shards=2)
            spool = tmp_path / "spool"
            await wait_page(spool, 0)
            held = [smtplib.SMTP("127.0.0.1", relay.port, timeout=60) for _ in range(6)]
            try:
                for s in held:
                    assert s.ehlo("idle.test")[0] == 250
                await wait_page(spool, 6)
                ids = {await trio.to_thread.run_sync(send, relay.port, i): i for i in range(8)}  # a lone client
                await hop.wait_messages(len(ids), timeout=300)
                await wait_page(spool, 6)

                os.kill(pids[1], signal.SIGKILL)
                await wait_dead([pids[1]])
                await relay.wait_up(2, old={1: pids[1]})
                left = [s for s in held if alive_session(s)]  # shard 1's were cut by the kill
                await wait_page(spool, len(left))
            finally:
                for s in held:
                    s.close()
            await wait_page(spool, 0)
            assert set(received_ids(hop)) == {f"m{i}@test" for i in ids.values()}
            nursery.cancel_scope.cancel()
