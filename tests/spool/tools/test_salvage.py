"""spoolctl salvage on spools built by the real engine and then damaged: what survives is copied whole.

Every spool here is made with ``Spool`` (small segments, bodies of many chunks
across segments, deferred, partly delivered, held and fresh messages; see
``salvage_support``), copied, and damaged in one way: a zeroed 4 KiB range,
flipped bits, a truncated segment, a missing segment (first, middle, last), a
damaged body chunk, a damaged segment header, random damage (hypothesis). Then
``spoolctl salvage`` runs for real, and the new spool is read back through the
engine's own listing. The checks (``check``) hold for every kind of damage:

- every message the damage did not touch is in the new spool with the same
  queue id, sender, recipients, body, class, held flag, arrival time, attempt
  count, in-doubt list, metadata and append time (so its next retry is due
  when it was due);
- every message it touched is listed: by queue id whenever its envelope
  survived, else inside a listed damaged range;
- whatever the new spool holds beyond that is listed as partly lost;
- the old spool is not changed by a byte, and the new one passes ``verify``.

The relay test starts the real relay on a salvaged spool and sees the mail
delivered to a next hop.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from click.testing import CliRunner, Result
from hypothesis import given, settings
from hypothesis import strategies as st
from process_support import mta_json
from relay_support import DeliveryWatch, NextHop, relay_config, start_relay
from salvage_support import (
    BODY_CHUNK,
    Clock,
    Queued,
    Range,
    build,
    config,
    flip_bits,
    hits,
    ledger,
    remove,
    segments,
    snapshot,
    touched,
    truncate,
    zero,
)

from fault_injection import scratch_dir
from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool
from spool.errors import SpoolLocked
from spool.format.record import HEADER_SIZE, Outcome, Status, format_id, parse_id, pos_segment
from spool.format.segment import SEGMENT_HEADER_SIZE
from spool.read import listing as admin
from spool.tools.cli import cli
from spool.tools.inspection import LogFiles
from spool.tools.salvage import TargetNotUsable, salvage
from spool.tools.verify import verify

T0 = 1_700_000_000.0


def run(*args: str) -> Result:
    result = CliRunner().invoke(cli, list(args))
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def salvage_json(src: str, dst: str, *extra: str) -> tuple[int, dict[str, Any]]:
    result = run("salvage", src, "--into", dst, "--retry-intervals", "1m,5m", "--json", *extra)
    return result.exit_code, json.loads(result.stdout)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Queued]]:
    path = str(tmp_path_factory.mktemp("salvage") / "built")
    return path, build(path, Clock(T0))


def copy_of(built: tuple[str, dict[str, Queued]], where: Path | str) -> tuple[str, dict[str, Queued]]:
    path = os.path.join(str(where), "old")
    shutil.copytree(built[0], path)
    return path, built[1]


def live_segments(before: dict[str, Queued]) -> dict[int, int]:
    """Bytes of live records per segment."""
    out: dict[int, int] = {}
    for m in before.values():
        for seg, lo, hi in m.records:
            out[seg] = out.get(seg, 0) + hi - lo
    return out


def busiest_middle(path: str, before: dict[str, Queued]) -> int:
    """A segment neither first nor last holding the most bytes of live records."""
    segs = segments(path)[1:-1]
    live = live_segments(before)
    return max(segs, key=lambda s: live.get(s, 0))


def envelopes_window(path: str, before: dict[str, Queued], size: int) -> tuple[int, int]:
    """A ``size``-byte range of a middle segment, beginning at a live envelope, that holds the most of them."""
    inner = set(segments(path)[1:-1])
    starts = sorted((m.envelope[0], m.envelope[1]) for m in before.values() if m.envelope[0] in inner)
    return max(starts, key=lambda s: sum(1 for t in starts if t[0] == s[0] and s[1] <= t[1] < s[1] + size))


def check(before: dict[str, Queued], damage: list[Range], code: int, out: dict[str, Any], new: str) -> None:
    """The invariants of the module docstring."""
    after = ledger(new)
    listed = {loss["queue_id"]: loss for loss in out["lost"]}
    ranges = out["damage"]

    def in_listed_damage(rec: tuple[int, int, int]) -> bool:
        seg, lo, _hi = rec
        # A range that reaches the end of its file, in a segment followed by a missing one, covers the rest of
        # the segment, whatever it held: with no next header its sealed size, and so the loss, is unknown.
        missing = {d["segment"] for d in ranges if d["kind"] == "missing_segment"}

        def to_end(d: dict[str, Any]) -> bool:
            return d["segment"] + 1 in missing and d["offset"] + d["bytes"] >= os.path.getsize(d["file"])

        return any(d["segment"] == seg and (d["kind"] == "missing_segment" or d["offset"] <= lo < d["offset"]
                                            + max(d["bytes"], 1) or (lo >= d["offset"] and to_end(d)))
                   for d in ranges)

    for qid, m in before.items():
        same = qid in after and after[qid].same() == m.same()
        if not touched(m, damage):
            assert same, f"{qid}: untouched, not copied as it was ({listed.get(qid)})"
            assert qid not in listed
        elif same:  # an earlier copy of its body was read, or its lost envelope was rebuilt just as it was
            assert qid not in listed or listed[qid]["saved"]
        elif not hits([m.envelope], damage):
            assert qid in listed, f"{qid}: its body is damaged, its envelope is not: it must be named"
            assert not listed[qid]["saved"] and qid not in after
            assert listed[qid]["sender"] == m.sender and tuple(listed[qid]["recipients"]) == m.recipients
        else:
            assert qid in listed or in_listed_damage(m.envelope), f"{qid}: touched, not listed"
    for qid, n in after.items():
        if qid not in before or n.same() != before[qid].same():
            assert qid in listed and listed[qid]["saved"], f"{qid}: copied changed, not listed"
    for qid, loss in listed.items():
        assert (qid in after) == loss["saved"]
    assert code == (0 if out["complete"] else 1)
    assert out["complete"] == (not out["lost"] and not out["damage"])
    assert out["copied"] == len(after)
    # the new spool is clean and opens under the engine's strictest policy (refuse on damage)
    assert verify(LogFiles.open(new)).clean
    assert all(pos_segment(parse_id(q)) < out["first_segment"] for q in after)


def salvage_and_check(old: str, before: dict[str, Queued], damage: list[Range], new: str) -> dict[str, Any]:
    kept = snapshot(old)
    code, out = salvage_json(old, new)
    assert snapshot(old) == kept, "salvage changed the old spool"
    check(before, damage, code, out, new)
    return out


# -- each kind of damage ------------------------------------------------------------------------


def test_an_undamaged_spool_is_copied_whole_with_exit_0(built: tuple[str, dict[str, Queued]],
                                                         tmp_path: Path) -> None:
    old, before = copy_of(built, tmp_path)
    assert {m.klass for m in before.values()} >= {0, 1, 2, 255} and any(len(m.chunks) > 16 for m in before.values())
    out = salvage_and_check(old, before, [], str(tmp_path / "new"))
    assert out["complete"] and out["copied"] == len(before) and out["lost"] == [] and out["withdrawn"] == 0
    # The new log begins past every segment of the old one: no id it hands out can be an old one.
    assert out["first_segment"] == segments(old)[-1] + 1
    human = run("salvage", old, "--into", str(tmp_path / "again"))
    assert human.exit_code == 0
    assert f"{len(before)} messages copied" in human.stdout and "0 lost" in human.stdout


def test_a_zeroed_4k_range_in_a_middle_segment(built: tuple[str, dict[str, Queued]], tmp_path: Path) -> None:
    old, before = copy_of(built, tmp_path)
    seg, off = envelopes_window(old, before, 4096)
    damage = zero(old, seg, off, 4096)
    assert sum(1 for m in before.values() if hits([m.envelope], damage)) >= 2
    out = salvage_and_check(old, before, damage, str(tmp_path / "new"))
    assert any(d["segment"] == seg and d["offset"] <= off < d["offset"] + d["bytes"] for d in out["damage"])


def test_flipped_bits(built: tuple[str, dict[str, Queued]], tmp_path: Path) -> None:
    old, before = copy_of(built, tmp_path)
    damage = flip_bits(old, busiest_middle(old, before), random.Random(3), 6)
    out = salvage_and_check(old, before, damage, str(tmp_path / "new"))
    assert out["damage"]


def test_a_truncated_middle_segment(built: tuple[str, dict[str, Queued]], tmp_path: Path) -> None:
    old, before = copy_of(built, tmp_path)
    seg = busiest_middle(old, before)
    damage = truncate(old, seg, os.path.getsize(os.path.join(old, "log", f"{seg:016x}.seg")) // 2)
    assert any(touched(m, damage) for m in before.values())
    out = salvage_and_check(old, before, damage, str(tmp_path / "new"))
    assert any(d["kind"] == "size_mismatch" and d["segment"] == seg for d in out["damage"])


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_a_missing_segment(built: tuple[str, dict[str, Queued]], tmp_path: Path, which: str) -> None:
    old, before = copy_of(built, tmp_path)
    segs = segments(old)
    seg = {"first": segs[0], "middle": busiest_middle(old, before), "last": segs[-1]}[which]
    damage = remove(old, seg)
    out = salvage_and_check(old, before, damage, str(tmp_path / "new"))
    if any(touched(m, damage) for m in before.values()):
        assert any(d["kind"] == "missing_segment" and d["segment"] == seg for d in out["damage"])


def test_a_damaged_body_chunk_names_its_message(built: tuple[str, dict[str, Queued]], tmp_path: Path) -> None:
    old, before = copy_of(built, tmp_path)
    victim = next(m for m in before.values() if len(m.chunks) >= 3 and m.klass == 0 and not m.held)
    seg, lo, _hi = victim.chunks[1]
    damage = zero(old, seg, lo + HEADER_SIZE + BODY_CHUNK // 2, 16)
    out = salvage_and_check(old, before, damage, str(tmp_path / "new"))
    (loss,) = [loss for loss in out["lost"] if loss["queue_id"] == victim.queue_id]
    assert "body chunk" in loss["reason"] and loss["damage"][0]["segment"] == seg
    text = run("salvage", old, "--into", str(tmp_path / "again"))
    assert text.exit_code == 1
    line = next(li for li in text.stdout.splitlines() if victim.queue_id in li)
    assert line.startswith("lost") and victim.sender in line and all(r in line for r in victim.recipients)
    assert f"bytes {loss['damage'][0]['offset']}.." in line


def test_a_damaged_segment_header_loses_nothing(built: tuple[str, dict[str, Queued]], tmp_path: Path) -> None:
    old, before = copy_of(built, tmp_path)
    seg = busiest_middle(old, before)
    damage = zero(old, seg, 0, 8)  # the magic
    out = salvage_and_check(old, before, damage, str(tmp_path / "new"))
    assert out["complete"] and out["copied"] == len(before)
    assert any("damaged segment header" in n for n in out["notes"])


def test_a_damaged_body_is_read_from_its_earlier_copy(tmp_path: Path) -> None:
    """A deferred message whose body was copied forward at its retry (its envelope had moved too far from
    it): when the new copy is damaged, the old one, still on disk, is read instead. Saved whole."""
    clock = Clock(T0)
    path = str(tmp_path / "old")
    sp = Spool.open(path, config(clock, (60.0, 300.0)))
    body = b"Subject: far\r\n\r\n" + b"0123456789abcdef\r\n" * 200
    mid = sp.enqueue("a@example.com", ("b@example.net",), body)
    sp.commit()
    (attempt,) = sp.poll_due(now=clock())
    for i in range(80):  # push the head a few segments further: the retry copies the body forward
        sp.enqueue(f"x{i}@example.com", (f"y{i}@example.org",), b"filler\r\n" * 80)
    sp.commit()
    sp.record_delivery(attempt, [Outcome("b@example.net", Status.DEFERRED, 451, "4.0.0", "later", "mx")])
    sp.finish(attempt)
    sp.commit()
    sp.close()
    os.remove(os.path.join(path, "lock"))
    before = ledger(path)
    victim = before[format_id(mid)]
    seg, lo, _hi = victim.chunks[0]
    assert seg > pos_segment(attempt.envelope.body[0]), "the body was not copied forward"
    damage = zero(path, seg, lo + HEADER_SIZE, 8)
    out = salvage_and_check(path, before, damage, str(tmp_path / "new"))
    assert out["lost"] == [] and ledger(str(tmp_path / "new"))[victim.queue_id].body == body
    assert any(victim.queue_id in n and "earlier copy" in n for n in out["notes"])


def test_a_lost_replacement_envelope_is_rebuilt_from_the_one_before(tmp_path: Path) -> None:
    """A deferred message whose current envelope is destroyed while the attempt's FINISH survives: copied
    from its previous envelope (which its segment still holds) with the class and attempt count the
    attempt left, and listed as partly lost."""
    clock = Clock(T0)
    path = str(tmp_path / "old")
    cfg = config(clock, (60.0, 300.0))
    sp = Spool.open(path, cfg)
    mid = sp.enqueue("a@example.com", ("b@example.net", "c@example.net"), b"Subject: x\r\n\r\nhello\r\n")
    sp.commit()
    (attempt,) = sp.poll_due(now=clock())
    sp.record_delivery(attempt, [Outcome("b@example.net", Status.DELIVERED, 250, "2.0.0", "ok", "mx"),
                                 Outcome("c@example.net", Status.DEFERRED, 451, "4.0.0", "later", "mx")])
    sp.commit()
    replacement = sp.finish(attempt)
    sp.commit()
    sp.close()
    assert replacement is not None
    frame = LogFiles.open(path).read_frame(replacement)
    damage = zero(path, pos_segment(replacement), replacement & 0xFFFFFFFF, frame.size)
    code, out = salvage_json(path, str(tmp_path / "new"))
    assert code == 1
    (loss,) = out["lost"]
    assert loss["queue_id"] == format_id(mid) and loss["saved"] and "rebuilt" in loss["reason"]
    assert loss["recipients"] == ["c@example.net"]
    (msg,) = ledger(str(tmp_path / "new")).values()
    assert (msg.queue_id, msg.recipients, msg.klass, msg.attempts) == (format_id(mid), ("c@example.net",), 1, 1)
    assert msg.body == b"Subject: x\r\n\r\nhello\r\n"
    assert damage


def test_an_attempt_in_flight_is_carried_on_as_recovery_would(tmp_path: Path) -> None:
    clock = Clock(T0)
    path = str(tmp_path / "old")
    sp = Spool.open(path, config(clock, (60.0, 300.0)))
    mid = sp.enqueue("a@example.com", ("b@example.net", "c@example.net"), b"body\r\n")
    sp.commit()
    (attempt,) = sp.poll_due(now=clock())
    sp.record_delivery(attempt, [Outcome("b@example.net", Status.DELIVERED, 250, "2.0.0", "ok", "mx")])
    sp.commit()
    sp.close()  # a crash: no FINISH
    os.remove(os.path.join(path, "lock"))
    code, out = salvage_json(path, str(tmp_path / "new"))
    assert code == 0 and out["complete"] and out["in_doubt"] == 1
    (msg,) = ledger(str(tmp_path / "new")).values()
    assert (msg.queue_id, msg.recipients, msg.in_doubt, msg.klass, msg.attempts) == (
        format_id(mid), ("c@example.net",), ("c@example.net",), 0, 0)


# -- refusals -----------------------------------------------------------------------------------


def test_refuses_a_non_empty_target_a_target_inside_the_spool_and_a_locked_spool(
        built: tuple[str, dict[str, Queued]], tmp_path: Path) -> None:
    old, _before = copy_of(built, tmp_path)
    full = tmp_path / "full"
    full.mkdir()
    (full / "something").write_text("x")
    result = run("salvage", old, "--into", str(full))
    assert result.exit_code == 2 and "not empty" in result.stderr and os.listdir(full) == ["something"]
    result = run("salvage", old, "--into", os.path.join(old, "inside"))
    assert result.exit_code == 2 and "outside" in result.stderr and not os.path.exists(os.path.join(old, "inside"))
    assert run("salvage", old).exit_code == 2  # --into is required
    assert run("salvage", old, "--into", str(tmp_path / "x"), "--segment-size", "12").exit_code == 2
    kept = snapshot(old)
    sp = Spool.open(old, SpoolConfig(retry_intervals=(60.0, 300.0)))  # a relay holds the spool
    try:
        kept = snapshot(old)
        result = run("salvage", old, "--into", str(tmp_path / "new"))
        assert result.exit_code == 3 and "stop it first" in result.stderr
        assert not os.path.exists(tmp_path / "new")
        with pytest.raises(SpoolLocked):
            salvage(old, str(tmp_path / "new2"))
    finally:
        sp.close()
    assert snapshot(old) == kept
    with pytest.raises(TargetNotUsable):
        salvage(old, str(full))
    result = run("salvage", str(tmp_path / "nothing"), "--into", str(tmp_path / "new3"))
    assert result.exit_code == 3 and "no such directory" in result.stderr


def test_new_ids_never_meet_salvaged_ones(built: tuple[str, dict[str, Queued]], tmp_path: Path) -> None:
    old, before = copy_of(built, tmp_path)
    new = str(tmp_path / "new")
    code, _out = salvage_json(old, new)
    assert code == 0
    sp = Spool.open(new, SpoolConfig(retry_intervals=(60.0, 300.0)))
    try:
        fresh = {format_id(sp.enqueue("n@example.com", ("m@example.net",), b"x")) for _ in range(50)}
        sp.commit()
        assert not fresh & set(before)
        assert min(parse_id(q) for q in fresh) > max(parse_id(q) for q in before)
        for qid in before:
            assert format_id(admin.find(sp, parse_id(qid)).message_id) == qid
        # The engine refuses to restore an id that one of its own positions could equal.
        taken = admin.find(sp, parse_id(next(iter(before)))).envelope
        with pytest.raises(ValueError, match="could be one of this spool's own"):
            sp.restore_message(attrs.evolve(taken, message_id=sp.writer.head), 0, b"x")
    finally:
        sp.close()


# -- random damage ------------------------------------------------------------------------------


@st.composite
def damages(draw: st.DrawFn) -> tuple[str, int, float, float, int]:
    """(kind, segment index, where as a fraction of the file, length as a fraction of 8 KiB, seed)."""
    kind = draw(st.sampled_from(["zero", "flip", "truncate", "remove"]))
    return (kind, draw(st.integers(0, 1000)), draw(st.floats(0, 1)), draw(st.floats(0, 1)),
            draw(st.integers(0, 2**16)))


@settings(max_examples=20, deadline=None)
@given(cases=st.lists(damages(), min_size=1, max_size=3))
def test_property_random_damage(built: tuple[str, dict[str, Queued]], cases: list[tuple[str, int, float, float, int]]
                                ) -> None:
    work = tempfile.mkdtemp(prefix="salvage-", dir=scratch_dir())
    try:
        old, before = copy_of(built, work)
        damage: list[Range] = []
        for kind, which, where, length, seed in cases:
            segs = segments(old)
            if not segs:
                break
            seg = segs[which % len(segs)]
            size = os.path.getsize(os.path.join(old, "log", f"{seg:016x}.seg"))
            off = min(size - 1, int(where * size))
            if size <= SEGMENT_HEADER_SIZE and kind != "remove":
                continue  # emptied by an earlier case
            if kind == "zero":
                damage += zero(old, seg, off, max(1, min(size - off, int(length * 8192))))
            elif kind == "flip":
                damage += flip_bits(old, seg, random.Random(seed), 1 + seed % 5)
            elif kind == "truncate":
                damage += truncate(old, seg, off)
            elif len(segs) > 1:
                damage += remove(old, seg)
        salvage_and_check(old, before, damage, os.path.join(work, "new"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- the relay on the salvaged spool -------------------------------------------------------------


@pytest.mark.slow
async def test_the_relay_starts_on_the_salvaged_spool_and_delivers(tmp_path: Path) -> None:
    """Damage a spool whose deferred mail is due (retry intervals of 1 s and 2 s), salvage it into the
    directory a relay is configured for, find an old queue id with `mta queue show`, start the relay: every
    message the damage did not touch reaches the next hop, under its old queue id, held ones excepted."""
    old = str(tmp_path / "old")
    before = build(old, Clock(time.time() - 600), intervals=(1.0, 2.0), messages=30)
    seg, off = envelopes_window(old, before, 4096)
    damage = zero(old, seg, off, 4096)
    code, out = salvage_json(old, str(tmp_path / "spool"))
    assert code == 1
    check(before, damage, code, out, str(tmp_path / "spool"))
    after = ledger(str(tmp_path / "spool"))
    untouched = {q: m for q, m in before.items() if not touched(m, damage)}
    assert len(untouched) < len(before) and {m.klass for m in after.values()} == {0, 1, 2, 255}
    deferred = next(q for q, m in untouched.items() if m.klass == 2)

    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        cfg_path = tmp_path / "relay.toml"
        cfg_path.write_text(f'[server]\nlisten = ["127.0.0.1:0"]\nhostname = "relay.test"\n[spool]\ndir = "spool"\n'
                            f'retry_intervals = ["1s", "2s"]\n[routes]\n"*" = "smtp://127.0.0.1:{port}"\n')
        msg = await mta_json(cfg_path, "queue", "show", deferred)  # offline: opens the salvaged spool
        assert (msg["id"], msg["class"], msg["attempts"]) == (deferred, 2, 2)

        relay = await start_relay(nursery, relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"},
                                                        retry='["1s", "2s"]'))
        watch = DeliveryWatch(relay)
        sendable = {q: m for q, m in after.items() if not m.held}
        received = await hop.wait_messages(len(sendable), timeout=60)
        await watch.wait_for(Status.DELIVERED, sum(len(m.recipients) for m in sendable.values()), timeout=60)
        got = {(tuple(r.recipients), r.data) for r in received}
        for q, m in untouched.items():
            if not m.held:
                assert (m.recipients, m.body) in got, f"{q} not delivered"
        delivered_ids = {qid for qid, o in watch.outcomes if o.status is Status.DELIVERED}
        assert {q for q, m in untouched.items() if not m.held} <= delivered_ids
        assert not {q for q, m in after.items() if m.held} & delivered_ids
        nursery.cancel_scope.cancel()
