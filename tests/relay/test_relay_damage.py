"""The real relay on a damaged spool: it starts, keeps what the damage did not touch, and names what it lost.

One template spool is built by the engine (deferred
messages over five 16 KiB segments, checkpointed, a few new messages after
the checkpoint; ``damage_support``); each case copies it twice, damages one
copy (with ``fault_injection.corrupt.Mutation``, as the corrupt harness
does), and starts the relay in this process on each: the undamaged copy to
measure the normal start, the damaged one to check that

- its recovery reads no more of the log than the normal start's (the working
  suffix) and one segment's scan of the damage, but where the damage took the checkpoint itself, whose
  loss means a rescan of the whole log;
- every message the damage did not touch is delivered to the next hop;
- a message whose data the damage touched is bounced to its sender;
- every lost message is named: a log line and the quarantine note by queue id,
  and the metric counts them, unless every record that could name it lay in
  the damage (``fault_injection.corrupt.LogMap.unnameable``);
- the damaged bytes are in ``DIR/quarantine``, as they were on disk.

Then damage met later, while the relay runs: by an admin read (``mta queue
list/count/show/flush`` over the control socket), and by the copy of a body
that a deferral carries forward. Every wait is on an event (a delivery
outcome, a message at the next hop); none is a sleep.
"""

from __future__ import annotations

import logging
import os
import random
import re
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import trio
from crc32c import crc32c
from damage_support import SEGMENT_SIZE, Template, build_template, flip_bits, random_flips
from process_support import RelayProcess
from relay_support import DeliveryWatch, NextHop, RawClient, Received, relay_config

from fault_injection.corrupt import LogMap, Mutation, named_lost
from mta.admin.client import ask_relay
from mta.admin.control import socket_path
from mta.config import Config
from mta.process.relay import Relay
from mta.process.startup import unwrapped
from mta.smtp.common import Reply
from spool.damage.policy import DamageRefused
from spool.fileio import OsFileIO
from spool.format.checkpoint import load as load_checkpoint
from spool.format.record import HEADER_SIZE, RecordType, Status, encode_frame, make_pos, pos_offset, pos_segment
from spool.format.segment import FORMAT_VERSION, SEGMENT_HEADER_SIZE
from spool.read import listing as admin
from spool.tools.inspection import LogFiles
from spool.tools.verify import verify

SPOOL_EXTRA = 'segment_size = "16KiB"'


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    return build_template(str(tmp_path_factory.mktemp("damage") / "template"))


@pytest.fixture(scope="module")
def template_map(template: Template) -> LogMap:
    return LogMap.read(template.path)


@attrs.define
class Damage:
    """What a case did: the position ranges it took (kept as damage), and the range it cut (unacknowledged)."""

    ranges: list[tuple[int, int]] = attrs.field(factory=list)
    cut: tuple[int, int] | None = None
    kept: dict[str, bytes] = attrs.field(factory=dict)  # quarantine file name -> the bytes it must hold
    notes: list[str] = attrs.field(factory=list)  # quarantine notes that must exist


def _config(root: Path, routes: dict[str, str], extra: str = "", spool_extra: str = "") -> Config:
    return relay_config(str(root), routes, retry='["1s", "1s"]', extra=extra,
                        spool_extra=f"{SPOOL_EXTRA}\n{spool_extra}")


async def _greeted(port: int) -> None:
    client = await RawClient.connect(port)
    try:
        assert await client.code() == 220
    finally:
        await client.aclose()


async def _start(nursery: trio.Nursery, config: Config) -> tuple[Relay, int]:
    """Start the relay until it answers 220; return it and the bytes of log its recovery read."""
    relay: Relay = await nursery.start(Relay(config).run)
    await _greeted(relay.ports[0])
    return relay, relay.aspool.core.recovery_stats.bytes_read


async def _normal_start(root: Path, template: Template) -> int:
    """The bytes the same spool's recovery reads, undamaged (delivering into the void: nothing waits for it)."""
    template.copy(str(root / "spool"))
    async with trio.open_nursery() as nursery:
        _relay, read = await _start(nursery, _config(root, {"*": "discard"}))
        nursery.cancel_scope.cancel()
    return read


def _seg_bytes(spool: str, seg: int) -> bytes:
    with open(os.path.join(spool, "log", f"{seg:016x}.seg"), "rb") as f:
        return f.read()


def _qname(seg: int, offset: int, slug: str) -> str:
    return f"{seg:016x}-{offset:010d}-{slug}"


@attrs.frozen
class Result:
    hop: list[Received]
    watch: DeliveryWatch
    lost_lines: list[str]
    lost_metric: float
    read: int
    normal: int



def met_while_running(line: str) -> bool:
    """Damage behind the checkpoint is met by a runner, or first by the queue gauges' count at start."""
    return "met by runner" in line or "met by an admin read" in line

async def run_case(tmp_path: Path, template: Template, template_map: LogMap, caplog: pytest.LogCaptureFixture,
                   damage: Callable[[str], Damage], delivery_processes: int = 0, rescan: bool = False) -> Result:
    """Damage a copy, start the relay on it, wait until everything the damage left is delivered, and check
    the promises of the module docstring that every case shares (``delivery_processes``: SMTP deliveries in
    that many worker processes; ``rescan``: the damage took the checkpoint, so recovery reads the whole log)."""
    caplog.set_level(logging.WARNING, logger="spool")
    normal = await _normal_start(tmp_path / "normal", template)
    root = tmp_path / "damaged"
    spool = template.copy(str(root / "spool"))
    done = damage(spool)
    predicted = verify(LogFiles.open(spool)).plan
    taken = list(done.ranges) + ([done.cut] if done.cut else [])
    envelopes: set[str] = set()
    bodies: set[str] = set()
    for lo, hi in taken:
        e, b = template.touched(lo, hi)
        envelopes |= e
        bodies |= b
    bodies -= envelopes
    cut_out = template.touched(*done.cut)[0] if done.cut else set()
    untouched = [m for m in template.messages if m.qid not in envelopes | bodies]
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        cfg = _config(root, {"*": f"smtp://127.0.0.1:{port}"})
        cfg = attrs.evolve(cfg, delivery=attrs.evolve(cfg.delivery, processes=delivery_processes))
        relay, read = await _start(nursery, cfg)
        assert (relay.workers is not None) == (delivery_processes > 0)
        watch = DeliveryWatch(relay)
        if not rescan:  # the restart position holds: the working suffix, and at most the damaged segment's scan
            assert read <= normal + SEGMENT_SIZE, f"recovery read {read} bytes, the undamaged spool's {normal}"
        # Every untouched message arrives; every message whose body was damaged bounces, and its DSN arrives.
        await watch.wait_for(Status.BOUNCED, len(bodies))
        msgs = await hop.wait_messages(len(untouched) + len(bodies))
        lost_metric = relay.metrics.registry.get_sample_value("logspool_damage_lost_messages") or 0.0
        nursery.cancel_scope.cancel()
    got = {(m.recipients[0], re.search(rb"Message-ID: <([^>]+)>", m.data).group(1).decode())  # type: ignore[union-attr]
           for m in msgs if m.sender}
    assert got == {(m.rcpt, m.message_id) for m in untouched}
    assert sorted(o.recipient for _, o in watch.outcomes if o.status is Status.BOUNCED) == \
        sorted(m.rcpt for m in template.messages if m.qid in bodies)
    dsns = [m for m in msgs if not m.sender]
    assert sorted(m.recipients[0] for m in dsns) == sorted(m.sender for m in template.messages if m.qid in bodies)
    assert all(b"damaged" in m.data for m in dsns)
    # Every lost message is named (log line and note), where a surviving record could name it.
    lines = [r.getMessage() for r in caplog.records if r.name == "spool.read.anomaly"]
    lost_lines = [ln for ln in lines if ln.startswith("lost message:")]
    named = named_lost(spool)
    lost = envelopes - cut_out
    by_qid = {m.qid: m for m in template.messages}
    for qid in lost:
        mid = int(qid, 16)
        if template_map.unnameable(mid, named.damaged):
            continue
        assert qid in named.ids, f"{qid} lost and not named in the quarantine notes"
        # A new message's recipients are in its envelope alone: named from its body, it is named without them.
        rcpt = "" if by_qid[qid].new else f"<{by_qid[qid].rcpt}>"
        assert any(f"queue id {qid}" in ln and rcpt in ln for ln in lost_lines), qid
    assert len(lost_lines) == lost_metric
    # The bytes are in the quarantine, as they were.
    qdir = os.path.join(spool, "quarantine")
    for name, data in done.kept.items():
        with open(os.path.join(qdir, name + ".bin"), "rb") as f:
            assert f.read() == data, name
    for name in done.notes:
        assert os.path.exists(os.path.join(qdir, name + ".json")), (name, sorted(os.listdir(qdir)))
    # What spoolctl verify predicted before the start is what the relay did at its start: a note for each
    # damage it said the start would cut or quarantine, at the same segment and offset (damage it said a
    # runner or a read would meet later is met only if one gets there).
    notes = sorted(os.listdir(qdir)) if os.path.isdir(qdir) else []
    for action in predicted:
        if action.when == "start" and action.anomaly is not None and action.what in ("quarantine", "cut"):
            a = action.anomaly
            assert any(n.startswith(f"{a.segment:016x}-{a.offset:010d}-") for n in notes), (action.text, notes)
    return Result(msgs, watch, lost_lines, lost_metric, read, normal)


# -- the cases of "Done means" ------------------------------------------------------------------------


async def test_torn_tail(tmp_path: Path, template: Template, template_map: LogMap,
                         caplog: pytest.LogCaptureFixture) -> None:
    """The last record was half written when the power went: cut, its bytes kept, nothing named lost."""
    last = template.segments[-1]
    frame = template.frames[-1]
    cut = pos_offset(frame.pos) + HEADER_SIZE + 7

    def damage(spool: str) -> Damage:
        kept = _seg_bytes(spool, last)[pos_offset(frame.pos):cut]
        Mutation(template.seg_rel(last), "truncate", cut).apply(spool)
        return Damage(cut=(frame.pos, frame.pos + frame.size),
                      kept={_qname(last, pos_offset(frame.pos), "torn-tail"): kept})

    result = await run_case(tmp_path, template, template_map, caplog, damage)
    assert result.lost_lines == []
    assert any("cutting torn tail" in r.getMessage() for r in caplog.records)


async def test_out_of_order_unsynced_pages(tmp_path: Path, template: Template, template_map: LogMap,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """A sector past the checkpoint's head never reached the disk, later ones did: damage, then valid
    records, past the last position recovery can prove durable. Cut from there (never acknowledged), the
    bytes kept, one line saying so; what lies before it is delivered."""
    last = template.segments[-1]
    fresh = [m for m in template.messages if m.new]
    victim = fresh[1]  # the second message after the checkpoint: a sector of its records never got there
    sector = -(-pos_offset(victim.body[0][0]) // 512) * 512  # the first sector boundary inside its body
    hit = template.frame_at(last, sector)
    at = pos_offset(hit.pos)
    assert sector + 512 < pos_offset(fresh[2].envelope[0])  # valid records follow the damage

    def damage(spool: str) -> Damage:
        data = _seg_bytes(spool, last)
        Mutation(template.seg_rel(last), "zero", sector, 512).apply(spool)
        return Damage(cut=(hit.pos, make_pos(last, len(data))),
                      kept={_qname(last, at, "cut"): data[at:sector] + bytes(512) + data[sector + 512:]})

    result = await run_case(tmp_path, template, template_map, caplog, damage)
    assert result.lost_lines == []
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cut ")]
    assert f"at offset {at} (segment {last})" in line and "nothing from there on was acknowledged" in line
    assert "last position recovery can prove durable" in line


async def test_zeroed_4k_range_in_a_middle_segment(tmp_path: Path, template: Template, template_map: LogMap,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Behind the checkpoint: not met at start, but by the runners as they pass it (the scheduler's feeder
    claims through them): quarantined there, the records around it kept, every message it took named."""
    seg = template.segments[len(template.segments) // 2]
    first = template.frame_at(seg, 6000)
    after = template.frame_at(seg, 6000 + 4096)

    def damage(spool: str) -> Damage:
        data = _seg_bytes(spool, seg)
        Mutation(template.seg_rel(seg), "zero", 6000, 4096).apply(spool)
        lo, hi = pos_offset(first.pos), pos_offset(after.pos) + after.size
        zeroed = data[lo:6000] + bytes(4096) + data[10096:hi]
        return Damage(ranges=[(first.pos, after.pos + after.size)],
                      kept={_qname(seg, lo, "damaged-record"): zeroed})

    result = await run_case(tmp_path, template, template_map, caplog, damage)
    assert len(result.lost_lines) >= 4
    assert any(met_while_running(r.getMessage()) for r in caplog.records if r.name == "spool.read.anomaly")


async def test_random_bit_flips(tmp_path: Path, template: Template, template_map: LogMap,
                                caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(14)
    segs = template.segments[:-1]  # the last one past its head is the out-of-order case

    def damage(spool: str) -> Damage:
        done = Damage()
        for seg in segs[:3]:
            data = _seg_bytes(spool, seg)
            flips = random_flips(rng, len(data), 32, 2)
            flip_bits(spool, template.seg_rel(seg), flips)
            for off, _bit in flips:
                frame = template.frame_at(seg, off)
                done.ranges.append((frame.pos, frame.pos + frame.size))
                if frame.pos in live:  # a garbage record is never read again: only verify sees it
                    done.notes.append(_qname(seg, pos_offset(frame.pos), "damaged-record"))
        return done

    live = {m.envelope[0] for m in template.messages} | {lo for m in template.messages for lo, _ in m.body}
    await run_case(tmp_path, template, template_map, caplog, damage)


async def test_truncated_middle_segment(tmp_path: Path, template: Template, template_map: LogMap,
                                        caplog: pytest.LogCaptureFixture) -> None:
    seg = template.segments[len(template.segments) // 2]
    victim = template.frame_at(seg, 8000)

    def damage(spool: str) -> Damage:
        data = _seg_bytes(spool, seg)
        Mutation(template.seg_rel(seg), "truncate", 8000).apply(spool)
        return Damage(ranges=[(victim.pos, make_pos(seg, len(data)))],
                      kept={_qname(seg, pos_offset(victim.pos), "damaged-record"): data[pos_offset(victim.pos):8000]},
                      notes=[_qname(seg, 8000, "size-mismatch")])

    await run_case(tmp_path, template, template_map, caplog, damage)


@pytest.mark.parametrize("which", ["first", "middle", "last"])
async def test_missing_segment(tmp_path: Path, template: Template, template_map: LogMap,
                               caplog: pytest.LogCaptureFixture, which: str) -> None:
    """Deleted by hand: the checkpoint and the segment headers say it should be there. Damage, loudly."""
    seg = {"first": template.segments[0], "middle": template.segments[len(template.segments) // 2],
           "last": template.segments[-1]}[which]

    def damage(spool: str) -> Damage:
        os.unlink(template.seg_file(spool, seg))
        return Damage(ranges=[(make_pos(seg, 0), make_pos(seg + 1, 0))], notes=[_qname(seg, 0, "missing-segment")])

    await run_case(tmp_path, template, template_map, caplog, damage)
    lines = [r.getMessage() for r in caplog.records if r.name == "spool.read.anomaly"]
    assert any(f"segment {seg}" in ln and "missing" in ln for ln in lines)


async def test_missing_checkpoint(tmp_path: Path, template: Template, template_map: LogMap,
                                  caplog: pytest.LogCaptureFixture) -> None:
    def damage(spool: str) -> Damage:
        os.unlink(os.path.join(spool, "checkpoint"))
        return Damage()

    result = await run_case(tmp_path, template, template_map, caplog, damage, rescan=True)
    assert result.read > result.normal, "no checkpoint: the whole log is read"
    assert result.lost_lines == []
    assert any("no checkpoint: scanning the whole log" in r.getMessage() for r in caplog.records)


async def test_damaged_checkpoint(tmp_path: Path, template: Template, template_map: LogMap,
                                  caplog: pytest.LogCaptureFixture) -> None:
    original: list[bytes] = []

    def damage(spool: str) -> Damage:
        path = os.path.join(spool, "checkpoint")
        Mutation("checkpoint", "bitflip", os.path.getsize(path) - 3, 0, 2).apply(spool)
        with open(path, "rb") as f:
            original.append(f.read())
        return Damage()

    result = await run_case(tmp_path, template, template_map, caplog, damage, rescan=True)
    assert result.read > result.normal, "a damaged checkpoint: the whole log is read"
    assert result.lost_lines == []
    qdir = tmp_path / "damaged" / "spool" / "quarantine"
    (moved,) = [n for n in os.listdir(qdir) if n.startswith("checkpoint-") and n.endswith(".bin")]
    assert (qdir / moved).read_bytes() == original[0]
    assert any("damaged checkpoint" in r.getMessage() and "scanning the whole log" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("delivery_processes", [0, 1])
async def test_damaged_body(tmp_path: Path, template: Template, template_map: LogMap,
                            caplog: pytest.LogCaptureFixture, delivery_processes: int) -> None:
    """A bit flipped in a live message's data: the message is bounced to its sender with the reason, its
    record quarantined; delivery goes on for everything else, in the relay or through a delivery worker."""
    victim = next(m for m in template.messages if not m.new and pos_segment(m.body[0][0]) == 2)
    lo, hi = victim.body[0]
    off = pos_offset(lo) + HEADER_SIZE + 40

    def damage(spool: str) -> Damage:
        seg = pos_segment(lo)
        flip_bits(spool, template.seg_rel(seg), [(off, 3)])
        data = _seg_bytes(spool, seg)
        return Damage(ranges=[(lo, hi)], kept={_qname(seg, pos_offset(lo), "damaged-record"):
                                               data[pos_offset(lo):pos_offset(hi)]})

    result = await run_case(tmp_path, template, template_map, caplog, damage, delivery_processes)
    (bounce,) = [o for _, o in result.watch.outcomes if o.status is Status.BOUNCED]
    assert bounce.recipient == victim.rcpt and bounce.enhanced == "5.3.0" and "damaged" in bounce.reply
    assert any(r.getMessage().startswith(f"event=damaged_body qid={victim.qid} ") and "action=bounced" in r.getMessage()
               for r in caplog.records)


# -- on_damage = "refuse" ---------------------------------------------------------------------------------


async def test_refuse_keeps_the_old_behaviour_and_says_what_to_run(tmp_path: Path, template: Template) -> None:
    spool = template.copy(str(tmp_path / "spool"))
    os.unlink(template.seg_file(spool, template.segments[1]))
    cfg = _config(tmp_path, {"*": "discard"}, spool_extra='on_damage = "refuse"')
    with pytest.raises(DamageRefused) as info, unwrapped():
        async with trio.open_nursery() as nursery:
            await nursery.start(Relay(cfg).run)
    text = str(info.value)
    assert f"spoolctl verify {spool}" in text and "spoolctl salvage" in text and "missing" in text
    assert not os.path.exists(os.path.join(spool, "quarantine"))


def test_mta_serve_with_refuse_exits_with_one_line(tmp_path: Path, template: Template) -> None:
    spool = template.copy(str(tmp_path / "spool"))
    os.unlink(template.seg_file(spool, template.segments[1]))
    conf = tmp_path / "relay.toml"
    conf.write_text('[server]\nlisten = ["127.0.0.1:0"]\nhostname = "relay.test"\n[spool]\ndir = "spool"\n'
                    'on_damage = "refuse"\n[routes]\n"*" = "discard"\n')
    mta = os.path.join(os.path.dirname(sys.executable), "mta")
    proc = subprocess.run([mta, "serve", "--config", str(conf)], cwd=tmp_path, capture_output=True, timeout=120,
                          check=False)
    assert proc.returncode == 1
    err = proc.stderr.decode().strip().splitlines()
    assert len([ln for ln in err if ln.startswith("mta:")]) == 1 and "Traceback" not in proc.stderr.decode()
    assert "spoolctl verify" in err[-1]


# -- damage met later, while the relay runs ------------------------------------------------------------------


async def test_damage_met_by_admin_reads_while_running(tmp_path: Path, template: Template,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The relay runs with every message deferred; a segment is damaged under it. ``mta queue list``,
    ``count``, ``show --body`` and ``flush`` answer (the damage quarantined and named by the first read),
    and the flushed messages are delivered or, where their data is gone, bounced."""
    caplog.set_level(logging.WARNING, logger="spool")
    spool = template.copy(str(tmp_path / "spool"))
    refusing = [True]

    def policy(stage: str, value: object) -> Reply | None:
        return Reply(451, "4.3.0", "not now") if stage == "rcpt" and refusing else None

    async with trio.open_nursery() as nursery:
        hop = NextHop(policy)
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"}, retry='["1s", "1h"]',
                           spool_extra=SPOOL_EXTRA)
        relay, _read = await _start(nursery, cfg)
        watch = DeliveryWatch(relay)
        await watch.wait_for(Status.DEFERRED, len(template.messages))
        await relay.aspool.commit()  # the replacements (class 2, an hour away) are durable
        # Damage the data of three queued messages (deferral copied old bodies forward: look where they are now).
        queued, _next = await trio.to_thread.run_sync(lambda: admin.page(relay.aspool.core, limit=1000))
        hit = queued[10:13]
        for m in hit:
            pos = m.envelope.body[0]
            flip_bits(spool, template.seg_rel(pos_segment(pos)), [(pos_offset(pos) + HEADER_SIZE + 9, 5)])
        by_qid = {m.qid: m for m in template.messages}

        path = socket_path(cfg)
        listed = await trio.to_thread.run_sync(ask_relay, path, {"op": "list", "limit": 1000})
        assert listed is not None and len(listed["messages"]) == len(template.messages)
        counted = await trio.to_thread.run_sync(ask_relay, path, {"op": "count"})
        assert counted is not None and counted["count"] == len(template.messages)
        victim = hit[0].queue_id
        shown = await trio.to_thread.run_sync(ask_relay, path, {"op": "show", "id": victim, "body": True})
        assert shown is not None and "body" not in shown and "damaged" in shown["body_error"]
        lines = [r.getMessage() for r in caplog.records if r.name == "spool.read.anomaly"]
        # The first of these reads to pass the damaged record quarantines it: a walk of the envelopes, or the
        # body's read by ``show --body``, as the damage lies.
        assert any("met by an admin read" in ln or "met by a read of message data" in ln for ln in lines), lines
        for m in hit:
            assert any(f"queue id {m.queue_id} " in ln and "its data lies in the damaged range" in ln
                       for ln in lines), m
        kept = [n for n in os.listdir(os.path.join(spool, "quarantine")) if n.endswith(".bin")]
        assert len(kept) == len(hit)

        refusing.clear()
        flushed = await trio.to_thread.run_sync(ask_relay, path, {"op": "flush"})
        assert flushed is not None and flushed["done"] == len(template.messages)
        await watch.wait_for(Status.BOUNCED, len(hit))
        await watch.wait_for(Status.DELIVERED, len(template.messages))  # the others, and the DSNs of those bounced
        bounced = sorted(o.recipient for _, o in watch.outcomes if o.status is Status.BOUNCED)
        assert bounced == sorted(by_qid[m.queue_id].rcpt for m in hit)
        nursery.cancel_scope.cancel()


async def test_damage_met_when_a_deferral_copies_the_body(tmp_path: Path, template: Template,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A deferral carries an old body forward (it is copied to the head, so that it pins no old segment). Its
    data is damaged between the delivery attempt that read it and that copy: the copy names the damage, the
    replacement says its data is gone, and the message is bounced when it comes due. The relay goes on."""
    caplog.set_level(logging.WARNING, logger="spool")
    spool = template.copy(str(tmp_path / "spool"))
    victim = next(m for m in template.messages if pos_segment(m.body[0][0]) == 1)
    body = next(f for f in template.frames if f.pos == victim.body[0][0])
    answered: list[str] = []

    def policy(stage: str, value: object) -> Reply | None:
        if stage == "data" and isinstance(value, Received) and value.recipients == [victim.rcpt] and not answered:
            answered.append(victim.rcpt)
            flip_bits(spool, template.seg_rel(pos_segment(body.pos)), [(pos_offset(body.pos) + HEADER_SIZE + 3, 6)])
            return Reply(451, "4.3.0", "try again")
        return None

    async with trio.open_nursery() as nursery:
        hop = NextHop(policy)
        port = await hop.start(nursery)
        relay, _read = await _start(nursery, _config(tmp_path, {"*": f"smtp://127.0.0.1:{port}"}))
        watch = DeliveryWatch(relay)
        (bounce,) = await watch.wait_for(Status.BOUNCED, 1)
        await watch.wait_for(Status.DELIVERED, len(template.messages))  # the others, and the bounce's DSN
        nursery.cancel_scope.cancel()
    assert bounce.recipient == victim.rcpt and "damaged" in bounce.reply
    lines = [r.getMessage() for r in caplog.records if r.name == "spool.read.anomaly"]
    assert any("met by a read of message data" in ln and f"at offset {pos_offset(body.pos)} " in ln for ln in lines)
    assert os.path.exists(os.path.join(spool, "quarantine", _qname(pos_segment(body.pos), pos_offset(body.pos),
                                                                   "damaged-record") + ".bin"))


async def test_a_damaged_body_is_held_when_the_operator_says_so(tmp_path: Path, template: Template,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """``delivery.on_damaged_body = "hold"``: the message waits in the held class, saying why, for the
    administrator; nothing is bounced, and everything else is delivered."""
    caplog.set_level(logging.WARNING, logger="spool")
    spool = template.copy(str(tmp_path / "spool"))
    victim = next(m for m in template.messages if not m.new and pos_segment(m.body[0][0]) == 2)
    flip_bits(spool, template.seg_rel(2), [(pos_offset(victim.body[0][0]) + HEADER_SIZE + 40, 3)])
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"}, retry='["1s", "1s"]',
                           extra="[delivery]\non_damaged_body = \"hold\"", spool_extra=SPOOL_EXTRA)
        relay, _read = await _start(nursery, cfg)
        watch = DeliveryWatch(relay)
        (held,) = await watch.wait_for(Status.DEFERRED, 1)
        await hop.wait_messages(len(template.messages) - 1)
        await relay.aspool.commit()
        shown = await trio.to_thread.run_sync(ask_relay, socket_path(cfg), {"op": "show", "id": victim.qid})
        nursery.cancel_scope.cancel()
    assert held.recipient == victim.rcpt and "held for the administrator" in held.reply
    assert watch.count(Status.BOUNCED) == 0
    assert shown is not None and shown["state"] == "held" and "damaged" in shown["last_error"]


# -- records that pass their checksum but cannot be used: damage of that record alone ---------------------------


def _rewrite_frame(spool: str, template: Template, pos: int, rtype: int | None = None,
                   payload: bytes | None = None) -> bytes:
    """Rewrite the record at ``pos`` in place with another type or payload (same length) and a checksum that
    passes, as a newer writer or a bug would have written it; return the new frame's bytes."""
    seg, off = pos_segment(pos), pos_offset(pos)
    frame = template.frame_at(seg, off)
    new = encode_frame(seg, frame.rtype if rtype is None else rtype,
                       frame.payload if payload is None else payload, klass=frame.klass, time=frame.time,
                       flags=frame.flags)
    assert len(new) == frame.size
    with open(os.path.join(spool, template.seg_rel(seg)), "r+b") as f:
        f.seek(off)
        f.write(new)
    return new


def _predicted(spool: str) -> list[tuple[str, str, int, int]]:
    """What ``spoolctl verify`` says the relay will do: (when, what, segment, offset) per damage."""
    report = verify(LogFiles.open(spool))
    return [(a.when, a.what, a.anomaly.segment, a.anomaly.offset) for a in report.plan if a.anomaly is not None]


async def test_a_whole_envelope_whose_payload_does_not_decode(tmp_path: Path, template: Template,
                                                             template_map: LogMap,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Its checksum passes, its CBOR does not decode, in the working suffix that recovery scans: the relay
    starts (it used to exit with "bad ENVELOPE payload"), quarantines that record alone and delivers the rest,
    as verify predicted."""
    victim = [m for m in template.messages if m.new][1]
    seg, off = pos_segment(victim.envelope[0]), pos_offset(victim.envelope[0])
    size = victim.envelope[1] - victim.envelope[0]

    def damage(spool: str) -> Damage:
        new = _rewrite_frame(spool, template, victim.envelope[0], payload=b"\xff" * (size - HEADER_SIZE))
        assert _predicted(spool) == [("start", "quarantine", seg, off)]
        return Damage(ranges=[victim.envelope], kept={_qname(seg, off, "bad-payload"): new})

    await run_case(tmp_path, template, template_map, caplog, damage)


async def test_a_whole_record_of_an_unknown_type_after_the_checkpoint(tmp_path: Path, template: Template,
                                                                      template_map: LogMap,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A record of a type this version does not know, in the last segment past every position recovery can
    prove durable: its checksum proves it was written whole, so it is not an unacknowledged tail. Recovery
    used to cut it and every valid record after it; now that record alone is quarantined and every message
    after it delivered, as verify predicted."""
    victim = [m for m in template.messages if m.new][1]
    seg, off = pos_segment(victim.envelope[0]), pos_offset(victim.envelope[0])
    assert seg == template.segments[-1]

    def damage(spool: str) -> Damage:
        new = _rewrite_frame(spool, template, victim.envelope[0], rtype=max(RecordType) + 3)
        assert _predicted(spool) == [("start", "quarantine", seg, off)]
        return Damage(ranges=[victim.envelope], kept={_qname(seg, off, "unknown-type"): new})

    result = await run_case(tmp_path, template, template_map, caplog, damage)
    assert not any(r.getMessage().startswith("cut ") for r in caplog.records)
    assert len(result.hop) == len(template.messages) - 1


async def test_damaged_segment_header(tmp_path: Path, template: Template, template_map: LogMap,
                                      caplog: pytest.LogCaptureFixture) -> None:
    """A middle segment's magic overwritten: the header is quarantined, every record after it is read and
    delivered, no message is lost."""
    seg = template.segments[len(template.segments) // 2]

    def damage(spool: str) -> Damage:
        Mutation(template.seg_rel(seg), "zero", 0, 8).apply(spool)
        (action,) = [a for a in verify(LogFiles.open(spool)).plan if a.anomaly is not None]
        assert action.what == "quarantine" and action.anomaly is not None
        assert (action.anomaly.kind.name, action.anomaly.segment, action.anomaly.offset) == ("BAD_HEADER", seg, 0)
        return Damage(notes=[_qname(seg, 0, "bad-header")])

    result = await run_case(tmp_path, template, template_map, caplog, damage)
    assert result.lost_lines == []
    assert len(result.hop) == len(template.messages)


async def test_a_whole_envelope_that_does_not_decode_met_by_a_runner(tmp_path: Path, template: Template,
                                                                    template_map: LogMap,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Behind the checkpoint, a deferred message's live envelope passes its checksum and does not decode:
    the start does not meet it, the runner that claims it quarantines that record alone and names the
    message, as verify predicted ("later"); everything else is delivered."""
    seg = template.segments[len(template.segments) // 2]
    victim = next(m for m in template.messages if not m.new and pos_segment(m.envelope[0]) == seg)
    off = pos_offset(victim.envelope[0])
    size = victim.envelope[1] - victim.envelope[0]

    def damage(spool: str) -> Damage:
        new = _rewrite_frame(spool, template, victim.envelope[0], payload=b"\xff" * (size - HEADER_SIZE))
        assert _predicted(spool) == [("later", "quarantine", seg, off)]
        assert [m.queue_id for a in verify(LogFiles.open(spool)).plan for m in a.lost] == [victim.qid]
        return Damage(ranges=[victim.envelope], kept={_qname(seg, off, "bad-payload"): new})

    result = await run_case(tmp_path, template, template_map, caplog, damage)
    assert any(f"queue id {victim.qid}" in ln and f"<{victim.rcpt}>" in ln for ln in result.lost_lines)
    assert any(met_while_running(r.getMessage()) for r in caplog.records if r.name == "spool.read.anomaly")


async def test_mta_serve_starts_on_a_whole_envelope_that_does_not_decode(tmp_path: Path, template: Template) -> None:
    """The command a new user runs: ``mta serve`` on a spool whose working suffix holds an envelope that
    passes its checksum and does not decode answers 220 (it used to exit 1, "bad ENVELOPE payload"), and
    says in its log that it quarantined the record, as ``spoolctl verify`` said it would."""
    spool = template.copy(str(tmp_path / "spool"))
    victim = [m for m in template.messages if m.new][1]
    size = victim.envelope[1] - victim.envelope[0]
    _rewrite_frame(spool, template, victim.envelope[0], payload=b"\xff" * (size - HEADER_SIZE))
    seg, off = pos_segment(victim.envelope[0]), pos_offset(victim.envelope[0])
    assert _predicted(spool) == [("start", "quarantine", seg, off)]
    conf = tmp_path / "relay.toml"
    conf.write_text('[server]\nlisten = ["127.0.0.1:0"]\nhostname = "relay.test"\n[spool]\ndir = "spool"\n'
                    f'{SPOOL_EXTRA}\n[routes]\n"*" = "discard"\n')
    async with trio.open_nursery() as nursery:
        relay = RelayProcess(conf)
        await relay.start(nursery)
        await _greeted(relay.port)
        assert any("bad ENVELOPE payload" in ln and "quarantined" in ln for ln in relay.lines), relay.lines
        await relay.kill()
        nursery.cancel_scope.cancel()
    assert os.path.exists(os.path.join(spool, "quarantine", _qname(seg, off, "bad-payload") + ".bin"))


def test_mta_serve_refuses_a_segment_of_a_newer_format_in_one_line_and_changes_nothing(
        tmp_path: Path, template: Template) -> None:
    """A segment header that is whole (its CRC passes) but names a format version this code does not read:
    written by a newer logspool. The one damage kind that stops a start whatever ``on_damage`` says, because
    quarantining it would destroy mail a newer version can read: one line, exit 1, the files untouched, and
    ``spoolctl verify`` names it the same way."""
    spool = template.copy(str(tmp_path / "spool"))
    seg = template.segments[-1]  # in the working suffix: recovery reads it at start
    path = template.seg_file(spool, seg)
    with open(path, "r+b") as f:
        header = bytearray(f.read(SEGMENT_HEADER_SIZE))
        header[8:10] = struct.pack("<H", FORMAT_VERSION + 1)
        header[28:32] = struct.pack("<I", crc32c(bytes(header[:28])))
        f.seek(0)
        f.write(header)
    log_dir = os.path.join(spool, "log")
    before = {name: os.path.getsize(os.path.join(log_dir, name)) for name in os.listdir(log_dir)}
    (action,) = [a for a in verify(LogFiles.open(spool)).plan if a.anomaly is not None]
    assert action.anomaly is not None and (action.anomaly.kind.name, action.anomaly.segment) == ("NEWER_FORMAT", seg)
    conf = tmp_path / "relay.toml"
    conf.write_text('[server]\nlisten = ["127.0.0.1:0"]\nhostname = "relay.test"\n[spool]\ndir = "spool"\n'
                    '[routes]\n"*" = "discard"\n')
    mta = os.path.join(os.path.dirname(sys.executable), "mta")
    proc = subprocess.run([mta, "serve", "--config", str(conf)], cwd=tmp_path, capture_output=True, timeout=60,
                          check=False)
    err = proc.stderr.decode()
    assert proc.returncode == 1 and "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("mta:")]
    assert len(lines) == 1 and os.path.basename(path) in lines[0] and "version" in lines[0], lines
    after = {name: os.path.getsize(os.path.join(log_dir, name)) for name in os.listdir(log_dir)}
    assert after == before and not os.path.exists(os.path.join(spool, "quarantine"))


async def test_a_segment_that_ends_before_what_the_checkpoint_knows_durable(
        tmp_path: Path, template: Template, template_map: LogMap, caplog: pytest.LogCaptureFixture) -> None:
    """The last segment cut short below the checkpoint's head (a file system that lost synced data, a copy
    cut short): damage, not a torn tail, because those bytes were known durable. Quarantined and named; the
    relay starts and delivers every message the cut left; what lay past the head is gone without a trace."""
    cp = load_checkpoint(OsFileIO(), template.path)
    assert cp is not None
    seg = pos_segment(cp.head)
    assert seg == template.segments[-1] and pos_offset(cp.head) > 4096, "the template's head is in its last segment"
    victim = template.frame_at(seg, pos_offset(cp.head) // 2)
    cut = pos_offset(victim.pos)

    def damage(spool: str) -> Damage:
        data = _seg_bytes(spool, seg)
        Mutation(template.seg_rel(seg), "truncate", cut).apply(spool)
        (action,) = [a for a in verify(LogFiles.open(spool)).plan if a.anomaly is not None]
        assert action.anomaly is not None and (action.anomaly.kind.name, action.anomaly.segment) == ("ENDS_EARLY", seg)
        # What lay past the head was durable too, but nothing left says it existed: lost unnamed, like a cut.
        return Damage(ranges=[(victim.pos, cp.head)], cut=(cp.head, make_pos(seg, len(data))),
                      notes=[_qname(seg, action.anomaly.offset, "ends-early")])

    await run_case(tmp_path, template, template_map, caplog, damage)
    lines = [r.getMessage() for r in caplog.records if r.name == "spool.read.anomaly"]
    assert any("before the position" in ln and "known durable" in ln for ln in lines), lines
