"""spoolctl on real spools written by the engine: numbers checked against what the test did.

Every spool here is made with ``Spool`` (enqueue, poll_due, record_delivery,
finish with deferrals, checkpoint, hold) under a fake clock; damage is done to
those files afterwards (a flipped byte, a truncated tail), never hand-written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import pytest
from click.testing import CliRunner, Result
from spool_support import NoSync

from fault_injection.workloads import FakeClock as Clock
from spool.config.engine import SpoolConfig
from spool.engine.spool import BODY_SLACK, Attempt, Spool
from spool.fileio import OsFileIO
from spool.format.record import (
    FLAGS_OFFSET,
    HEADER_SIZE,
    Outcome,
    RecordType,
    Start,
    Status,
    format_pos,
    make_pos,
    parse_pos,
    pos_offset,
    pos_segment,
)
from spool.format.segment import SEGMENT_HEADER_SIZE, list_segments, segment_path
from spool.read import listing as admin
from spool.tools.cli import cli, main
from spool.tools.inspection import LogFiles
from spool.tools.verify import verify

T0 = 1_700_000_000


def config(clock: Clock, **kw: Any) -> SpoolConfig:
    return SpoolConfig(segment_size=4096, retry_intervals=(60.0, 300.0), clock=clock, **kw)


def run(*args: str) -> Result:
    result = CliRunner().invoke(cli, list(args))
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def run_json(*args: str, code: int = 0) -> Any:
    result = run(*args, "--json")
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


@attrs.define
class Made:
    """A spool built by the engine and a ledger of what the test did to it."""

    path: str
    sp: Spool
    clock: Clock
    envelopes: int = 0
    starts: int = 0
    deliveries: int = 0
    finishes: int = 0
    bodies: int = 0
    in_flight: list[Attempt] = attrs.field(factory=list)
    ids: list[int] = attrs.field(factory=list)

    @property
    def records(self) -> int:
        """Every record appended, by the writer's own count (the spool was opened once)."""
        return self.sp.writer.records

    @property
    def data(self) -> int:
        """DATA records: whatever the body policy copies, they are the records not in the ledger."""
        return self.records - (self.envelopes + self.starts + self.deliveries + self.finishes)

    def enqueue(self, n: int, rcpts: tuple[str, ...] = ("b@example.net", "c@example.org")) -> list[int]:
        ids = [self.sp.enqueue(f"s{i}@example.com", rcpts, b"Subject: hi\r\n\r\n" + b"x" * 500)
               for i in range(n)]
        self.sp.commit()
        self.envelopes += n
        self.bodies += n  # one chunk per body (body_chunk is 256 KiB)
        self.ids += ids
        return ids

    def poll(self) -> list[Attempt]:
        attempts = self.sp.poll_due()
        self.starts += len(attempts)
        self.sp.commit()
        return attempts

    def deliver(self, attempt: Attempt, statuses: dict[str, Status]) -> int | None:
        self.sp.record_delivery(attempt, [Outcome(r, s, 250 if s is Status.DELIVERED else 451, "", "ok", "mx")
                                          for r, s in statuses.items()])
        self.deliveries += 1
        self.sp.commit()
        replacement = self.sp.finish(attempt)
        self.finishes += 1
        if replacement is not None:
            self.envelopes += 1
        self.sp.commit()
        return replacement

    def hold(self, message_id: int) -> None:
        assert self.sp.change(message_id, "hold")
        # claim (START), replacement ENVELOPE, FINISH
        self.starts += 1
        self.envelopes += 1
        self.finishes += 1


def build(tmp_path: Path) -> Made:
    """6 new messages: 3 delivered, 2 deferred for one recipient, 1 left in flight;
    then 2 more new ones, one of them held. Live: 2 deferred, 1 new, 1 held, 1 in flight."""
    clock = Clock()
    path = str(tmp_path / "spool")
    m = Made(path, Spool.open(path, config(clock), NoSync()), clock)
    m.enqueue(6)
    clock.advance(1)
    attempts = m.poll()
    assert len(attempts) == 6
    both = {"b@example.net": Status.DELIVERED, "c@example.org": Status.DELIVERED}
    for a in attempts[:3]:
        assert m.deliver(a, both) is None
    for a in attempts[3:5]:
        assert m.deliver(a, {"b@example.net": Status.DELIVERED, "c@example.org": Status.DEFERRED}) is not None
    m.in_flight.append(attempts[5])
    clock.advance(10)
    new = m.enqueue(2)
    m.hold(new[1])
    m.sp.checkpoint()
    return m


@pytest.fixture
def made(tmp_path: Path) -> Any:
    m = build(tmp_path)
    yield m
    m.sp.close()


def segments_of(path: str) -> list[int]:
    return list_segments(OsFileIO(), os.path.join(path, "log"))


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


# -- stats ------------------------------------------------------------------------


def test_stats_counts_what_the_test_did(made: Made) -> None:
    st = run_json("stats", made.path)
    assert st["live"] == 5
    assert st["by_class"] == {"0": 1, "1": 2}
    assert st["held"] == 1
    assert st["active"] == 1
    assert st["oldest_arrival_ms"] == T0 * 1000
    segs = segments_of(made.path)
    assert st["segments"] == len(segs) >= 2
    assert st["bytes_on_disk"] == sum(os.path.getsize(segment_path(os.path.join(made.path, "log"), s))
                                      for s in segs)
    human = run("stats", made.path)
    assert human.exit_code == 0
    assert "live messages" in human.stdout and "in flight" in human.stdout


# -- segments ---------------------------------------------------------------------


def test_segments_counts_match_the_engine(made: Made) -> None:
    out = run_json("segments", made.path)
    rows = out["segments"]
    assert [r["segment"] for r in rows] == segments_of(made.path)
    total = Counter[str]()
    for r in rows:
        total.update(r["by_type"])
        assert r["records"] == sum(r["by_type"].values())
        assert r["size"] == os.path.getsize(r["file"])
        assert r["deletable"] is False
        assert r["damage"] == []
    assert total == {"ENVELOPE": made.envelopes, "START": made.starts, "DELIVERY": made.deliveries,
                     "FINISH": made.finishes, "DATA": made.data}
    assert made.data >= made.bodies
    assert rows[0]["first"] == f"{rows[0]['segment']}:{SEGMENT_HEADER_SIZE}"
    # live envelopes per segment: the engine's own listing is the reference
    live = Counter(pos_segment(msg.pos) for msg in admin.iter_live(made.sp))
    assert {r["segment"]: r["live"] for r in rows} == {s: live.get(s, 0) for s in segments_of(made.path)}
    # every started envelope carries its garbage mark (all STARTs here are durable)
    assert sum(r["garbage"] for r in rows) == made.starts
    human = run("segments", made.path)
    assert human.exit_code == 0 and "deletable" in human.stdout


class UnlinkLost(NoSync):
    """A crash between storing a checkpoint and deleting the segments behind it:
    the unlinks never reach the disk."""

    def __init__(self) -> None:
        self.lose = False
        self.lost: list[str] = []

    def unlink(self, path: str) -> None:
        if self.lose:
            self.lost.append(path)
            return
        super().unlink(path)


def age_out(m: Made, rounds: int) -> None:
    """Advance past every retry interval and defer everything due, round after round."""
    for _ in range(rounds):
        m.clock.advance(400)
        for a in m.poll():
            m.deliver(a, dict.fromkeys(a.remaining, Status.DEFERRED))
        m.sp.checkpoint()


def test_segments_deletable_after_a_crash_before_deletion(tmp_path: Path) -> None:
    clock = Clock()
    io = UnlinkLost()
    path = str(tmp_path / "spool")
    m = Made(path, Spool.open(path, config(clock), io), clock)
    try:
        m.enqueue(20, ("d@example.net",))
        age_out(m, 3)
        io.lose = True
        m.clock.advance(400)
        for a in m.poll():
            m.deliver(a, dict.fromkeys(a.remaining, Status.DEFERRED))
        expected = m.sp.checkpoint()
        assert expected, "the scenario must reach a checkpoint that reclaims segments"
        assert sorted(int(os.path.basename(p)[:16], 16) for p in io.lost) == expected
        out = run_json("segments", path)
        assert [r["segment"] for r in out["segments"] if r["deletable"]] == expected
        assert out["garbage_end"] == format_pos(m.sp.checkpoint_state.garbage_end)  # type: ignore[union-attr]
        assert all(s < parse_pos(out["garbage_end"]) >> 32 for s in expected)
        # nothing live lies in a deletable segment
        assert all(r["live"] == 0 for r in out["segments"] if r["deletable"])
    finally:
        m.sp.close()


# -- checkpoint -------------------------------------------------------------------


def test_checkpoint_positions_and_lag(made: Made) -> None:
    cp = made.sp.checkpoint_state
    assert cp is not None
    made.clock.advance(30)
    before = made.sp.writer.appended_bytes
    made.enqueue(2)  # 4 records after the checkpoint's head
    head_bytes = made.sp.writer.appended_bytes - before  # frames only, not segment headers
    out = run_json("checkpoint", made.path, "--retry-intervals", "1m,5m")
    c = out["checkpoint"]
    assert c["head"] == format_pos(cp.head)
    assert c["working_start"] == format_pos(cp.working_start)
    assert c["garbage_end"] == format_pos(cp.garbage_end)
    assert c["runners"] == [format_pos(r) for r in cp.runners]
    assert c["sequence"] == cp.sequence and c["time_ms"] == cp.time_ms
    assert out["log_end"] == format_pos(made.sp.writer.head)
    lag = {p["name"]: p for p in out["positions"]}
    assert lag["head"]["lag_records"] == 4
    assert lag["head"]["lag_bytes"] == head_bytes
    assert lag["head"]["lag_seconds"] == 0
    assert [lag[f"runner {k}"]["interval"] for k in range(3)] == [0.0, 60.0, 300.0]
    # the oldest runner has not moved (300 s never passed): it lags by the whole log
    assert cp.garbage_end == make_pos(1, SEGMENT_HEADER_SIZE)
    assert lag["garbage_end"]["lag_records"] == made.records
    assert lag["garbage_end"]["lag_seconds"] == made.clock.now - T0
    human = run("checkpoint", made.path)
    assert human.exit_code == 0 and "working_start" in human.stdout and "5m" in human.stdout


def test_checkpoint_without_one(tmp_path: Path) -> None:
    # a spool whose checkpoint was removed: the next open scans everything
    m = build(tmp_path)
    m.sp.close()
    os.unlink(os.path.join(m.path, "checkpoint"))
    out = run_json("checkpoint", m.path)
    assert out["checkpoint"] is None and out["positions"] == []
    assert "no checkpoint" in run("checkpoint", m.path).stdout


# -- dump ---------------------------------------------------------------------------


def test_dump_json_lines(made: Made) -> None:
    result = run("dump", made.path, "--json")
    assert result.exit_code == 0
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == made.records
    assert Counter(r["type"] for r in records) == {"ENVELOPE": made.envelopes, "START": made.starts,
                                                   "DELIVERY": made.deliveries, "FINISH": made.finishes,
                                                   "DATA": made.data}
    positions = [parse_pos(r["position"]) for r in records]
    assert positions == sorted(positions)
    first_env = next(r for r in records if r["type"] == "ENVELOPE")
    assert first_env["payload"]["sender"] == "s0@example.com"
    assert first_env["payload"]["recipients"] == ["b@example.net", "c@example.org"]
    assert first_env["garbage"] is True and first_env["class"] == 0
    assert first_env["time"] == T0
    data = records[0]
    assert data["type"] == "DATA" and data["payload"]["length"] == 515
    assert data["payload"]["preview"].startswith("Subject: hi")
    held = [r for r in records if r["type"] == "ENVELOPE" and r["payload"]["held"]]
    assert len(held) == 1 and held[0]["class"] == 255
    deferred = [r for r in records if r["type"] == "DELIVERY"
                and any(o["status"] == "DEFERRED" for o in r["payload"]["outcomes"])]
    assert len(deferred) == 2


def test_dump_filters(made: Made) -> None:
    envs = [json.loads(x) for x in run("dump", made.path, "--type", "envelope", "--json").stdout.splitlines()]
    assert len(envs) == made.envelopes and {e["type"] for e in envs} == {"ENVELOPE"}
    two = run("dump", made.path, "--type", "START,FINISH", "--limit", "2", "--json").stdout.splitlines()
    assert len(two) == 2
    start = made.in_flight[0].envelope_pos
    lines = run("dump", made.path, "--from", format_pos(start), "--limit", "1", "--json").stdout.splitlines()
    assert [json.loads(x)["position"] for x in lines] == [format_pos(start)]
    seg2 = run("dump", made.path, "--segment", "2", "--json").stdout.splitlines()
    assert seg2 and all(json.loads(x)["position"].startswith("2:") for x in seg2)
    human = run("dump", made.path, "--limit", "5")
    assert human.exit_code == 0 and len(human.stdout.splitlines()) == 5
    assert "ENVELOPE" in human.stdout and "s0@example.com" in human.stdout and "len=515" in human.stdout


# -- verify --------------------------------------------------------------------------


def test_verify_clean(made: Made) -> None:
    out = run_json("verify", made.path)
    assert out["clean"] is True and out["problems"] == [] and out["torn_tail"] is None
    assert out["records"] == made.records
    # START->envelope, DELIVERY->start, FINISH->start (+replacement), envelope body chunks and replaces
    replacements = made.envelopes - len(made.ids)
    assert out["references"] == (made.starts + made.deliveries + made.finishes + replacements
                                 + made.envelopes + replacements)
    human = run("verify", made.path)
    assert human.exit_code == 0 and "clean" in human.stdout


def test_verify_works_while_the_spool_is_open_and_recover_is_refused(made: Made) -> None:
    # ``made.sp`` holds the lock: read-only commands go on, recover says why it cannot
    assert run("verify", made.path).exit_code == 0
    result = run("recover", made.path)
    assert result.exit_code == 3
    assert result.stderr.count("\n") == 1 and "another process" in result.stderr


def test_verify_flipped_byte_in_the_middle(tmp_path: Path) -> None:
    m = build(tmp_path)
    m.sp.close()
    victim = m.in_flight[0].envelope_pos  # an envelope in an earlier segment than the last
    seg, off = pos_segment(victim), pos_offset(victim)
    assert seg < segments_of(m.path)[-1]
    path = segment_path(os.path.join(m.path, "log"), seg)
    flip(path, off + HEADER_SIZE + 5)
    result = run("verify", m.path)
    assert result.exit_code == 1
    assert path in result.stdout and f"at offset {off}" in result.stdout
    # ... and says what the relay will do with it: the in-flight attempt's envelope is met at start
    assert "what the relay will do" in result.stdout
    assert "at start: quarantine " in result.stdout and f"bytes of segment {seg} at {off} " in result.stdout, \
        result.stdout
    assert "spoolctl salvage" in result.stdout
    out = run_json("verify", m.path, code=1)
    assert [a["when"] for a in out["relay_will"]] == ["start", "start"]  # the quarantine, and what refuse does
    damage = [p for p in out["problems"] if p["kind"] == "damage"]
    assert [(p["file"], p["offset"]) for p in damage] == [(path, off)]
    assert "checksum" in damage[0]["message"] and "resume" in damage[0]["message"]
    # the START that claimed it now points at a damaged record, and verify kept going past it
    refs = [p for p in out["problems"] if p["kind"] == "reference"]
    assert any(format_pos(victim) in p["message"] and "damaged" in p["message"] for p in refs)
    assert out["records"] == m.records - 1
    assert out["torn_tail"] is None
    # the other commands report it rather than crash
    seg_out = run_json("segments", m.path, code=1)
    row = next(r for r in seg_out["segments"] if r["segment"] == seg)
    assert [d["offset"] for d in row["damage"]] == [off] and row["damage"][0]["torn"] is False
    dumped = run("dump", m.path)
    assert dumped.exit_code == 1 and "!!" in dumped.stdout
    # and the engine's open quarantines it, naming the same place, and goes on
    rec = run("recover", m.path)
    assert rec.exit_code == 0
    assert f"{path} at offset {off} " in rec.stderr and "quarantined" in rec.stderr
    assert os.path.exists(os.path.join(m.path, "quarantine", f"{seg:016x}-{off:010d}-damaged-record.bin"))


def test_verify_flipped_byte_in_the_last_segment_is_damage_not_a_torn_tail(tmp_path: Path) -> None:
    m = build(tmp_path)
    m.sp.close()
    last = segments_of(m.path)[-1]
    path = segment_path(os.path.join(m.path, "log"), last)
    flip(path, SEGMENT_HEADER_SIZE + HEADER_SIZE)  # first record's payload, valid records follow
    out = run_json("verify", m.path, code=1)
    assert out["torn_tail"] is None
    assert [(p["file"], p["offset"]) for p in out["problems"] if p["kind"] == "damage"] == \
        [(path, SEGMENT_HEADER_SIZE)]


def test_verify_torn_tail_then_recover_cuts_it(tmp_path: Path) -> None:
    m = build(tmp_path)
    m.clock.advance(5)
    m.enqueue(1)  # durable, but after the checkpoint: a crash may tear it
    tail = m.sp.writer.head
    m.sp.close()
    path = segment_path(os.path.join(m.path, "log"), pos_segment(tail))
    with open(path, "r+b") as f:
        f.truncate(pos_offset(tail) - 7)
    envelope_off = m.ids[-1] & 0xFFFFFFFF
    result = run("verify", m.path)
    assert result.exit_code == 0, result.output
    assert "torn tail" in result.stdout and path in result.stdout and f"at offset {envelope_off}" in result.stdout
    out = run_json("verify", m.path)
    assert out["torn_tail"]["file"] == path and out["torn_tail"]["offset"] == envelope_off
    assert out["torn_tail"]["bytes"] == pos_offset(tail) - 7 - envelope_off
    assert out["clean"] is True
    rec = run_json("recover", m.path)
    assert rec["tail_cut_bytes"] == pos_offset(tail) - 7 - envelope_off
    assert rec["in_flight"] == 1  # the attempt left open by build()
    assert rec["in_doubt"] == 0  # ... a claim alone, never past its point of no return: due again, not in doubt
    after = run_json("verify", m.path)
    assert after["clean"] is True and after["torn_tail"] is None


def test_verify_truncation_before_the_checkpoint_head_is_damage(tmp_path: Path) -> None:
    m = build(tmp_path)
    m.sp.close()
    head = m.sp.checkpoint_state.head  # type: ignore[union-attr]
    path = segment_path(os.path.join(m.path, "log"), pos_segment(head))
    with open(path, "r+b") as f:
        f.truncate(pos_offset(head) - 3)
    out = run_json("verify", m.path, code=1)
    assert out["torn_tail"] is None
    kinds = {p["kind"] for p in out["problems"]}
    assert {"damage", "checkpoint"} <= kinds
    assert any("past the end" in p["message"] for p in out["problems"] if p["kind"] == "checkpoint")


def test_verify_references_of_the_wrong_type(made: Made) -> None:
    """Records appended through the engine's own writer that point at the wrong thing."""
    sp = made.sp
    data_pos = make_pos(1, SEGMENT_HEADER_SIZE)  # the first body chunk
    env_pos = made.ids[0]
    bad_start = sp._append(RecordType.START, Start(data_pos, 0))
    mid_record = sp._append(RecordType.START, Start(env_pos + 1, 0))
    nowhere = sp._append(RecordType.START, Start(make_pos(99, SEGMENT_HEADER_SIZE), 0))
    sp.commit()
    for recent in (1 << 16, 1):  # the in-memory window and the positioned-read path agree
        report = verify(LogFiles.open(made.path), recent=recent)
        assert not report.clean
        got = {p.pos: p.message for p in report.problems}
        assert set(got) == {bad_start, mid_record, nowhere}
        assert "holds a DATA, not a ENVELOPE" in got[bad_start]
        assert "no" in got[mid_record] and "record" in got[mid_record]
        assert "segment 99 does not exist" in got[nowhere]
    result = run("verify", made.path)
    assert result.exit_code == 1 and format_pos(bad_start) in result.stdout


def test_verify_reclaimed_references_are_fine(tmp_path: Path) -> None:
    clock = Clock()
    path = str(tmp_path / "spool")
    m = Made(path, Spool.open(path, config(clock), NoSync()), clock)
    try:
        m.enqueue(20, ("d@example.net",))
        age_out(m, 4)
        assert segments_of(path)[0] > 1, "the scenario must reclaim segments"
        out = run_json("verify", path)
        assert out["clean"] is True
        assert out["reclaimed_references"] > 0
        assert "already reclaimed" in run("verify", path).stdout
        st = run_json("stats", path)
        assert st["live"] == 20 and st["by_class"] == {"2": 20}
        first = segments_of(path)[0]
        cp = m.sp.checkpoint_state
        assert cp is not None and first >= pos_segment(cp.garbage_end) - BODY_SLACK - cp.body_span
    finally:
        m.sp.close()


def test_garbage_marks_are_outside_the_checksum(made: Made) -> None:
    # a lost garbage mark is not damage: flags are not checksummed (docs/format.md)
    made.sp.close()
    pos = made.ids[0]
    path = segment_path(os.path.join(made.path, "log"), pos_segment(pos))
    with open(path, "r+b") as f:
        f.seek(pos_offset(pos) + FLAGS_OFFSET)
        f.write(b"\0")
    assert run_json("verify", made.path)["clean"] is True


# -- errors --------------------------------------------------------------------------


@pytest.mark.parametrize("args, code, words", [
    (["stats", "/nonexistent/spool"], 3, "no such directory"),
    (["verify", "."], 3, "not a spool"),
    (["dump", "{spool}", "--from", "nope"], 2, "not a position"),
    (["dump", "{spool}", "--type", "BOGUS"], 2, "unknown record type"),
    (["dump", "{spool}", "--limit", "-1"], 2, "--limit"),
    (["dump", "{spool}", "--segment", "77"], 2, "no segment 77"),
    (["dump", "{spool}", "--from", "1:33"], 2, "no valid record starts"),
    (["checkpoint", "{spool}", "--retry-intervals", "5m,1m"], 2, "must not decrease"),
    (["checkpoint", "{spool}", "--retry-intervals", "soon"], 2, "not a duration"),
    (["frobnicate"], 2, "No such command"),
    (["verify"], 2, "Missing argument"),
])
def test_errors_are_one_line(made: Made, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             args: list[str], code: int, words: str) -> None:
    monkeypatch.chdir(tmp_path)
    result = run(*(a.replace("{spool}", made.path) for a in args))
    assert result.exit_code == code
    assert result.stdout == ""
    assert result.stderr.startswith("spoolctl: error: ") and result.stderr.count("\n") == 1
    assert words in result.stderr


@pytest.mark.parametrize("command", ["segments", "checkpoint", "dump", "verify", "stats"])
def test_a_read_on_a_missing_spool_names_it_in_one_line_and_creates_nothing(tmp_path: Path, command: str) -> None:
    target = tmp_path / "var" / "spool"
    result = run(command, str(target))
    assert (result.exit_code, result.stdout) == (3, "")
    assert result.stderr == f"spoolctl: error: {target}: no such directory\n"
    assert list(tmp_path.iterdir()) == []


def test_recover_on_a_missing_directory_creates_nothing(tmp_path: Path) -> None:
    target = tmp_path / "absent"
    result = run("recover", str(target))
    assert result.exit_code == 3 and not target.exists()


def test_corrupt_checkpoint_is_reported(made: Made) -> None:
    made.sp.close()
    cp_path = os.path.join(made.path, "checkpoint")
    flip(cp_path, os.path.getsize(cp_path) - 1)
    out = run_json("verify", made.path, code=1)
    assert [p["kind"] for p in out["problems"]] == ["checkpoint"]
    assert out["problems"][0]["file"] == cp_path
    result = run("checkpoint", made.path)
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and cp_path in result.stderr


def test_console_script_entry_point(made: Made, tmp_path: Path) -> None:
    assert main(["verify", made.path]) == 0
    script = Path(sys.executable).parent / "spoolctl"
    proc = subprocess.run([str(script), "stats", str(tmp_path / "none")], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 3
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    proc = subprocess.run([str(script), "stats", made.path, "--json"], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0 and json.loads(proc.stdout)["live"] == 5


def rotate(m: Made) -> int:
    """Enqueue until the log rotates; returns the new last segment."""
    segs = segments_of(m.path)
    while segments_of(m.path) == segs:
        m.enqueue(1)
    return segments_of(m.path)[-1]


def test_half_created_last_segment_is_a_torn_tail(tmp_path: Path) -> None:
    m = build(tmp_path)
    m.clock.advance(5)
    last = rotate(m)
    m.sp.close()
    path = segment_path(os.path.join(m.path, "log"), last)
    with open(path, "r+b") as f:
        f.truncate(10)  # the crash came while the new segment's header was being written
    out = run_json("verify", m.path)
    assert out["clean"] is True
    assert out["torn_tail"]["file"] == path and out["torn_tail"]["offset"] == 0
    assert parse_pos(out["log_end"]) >> 32 == last - 1
    rec = run("recover", m.path)
    assert rec.exit_code == 0 and "tail cut bytes" in rec.stdout and "removing segment" in rec.stderr
    assert segments_of(m.path)[-1] == last - 1
    assert run_json("verify", m.path)["torn_tail"] is None


def test_zeroed_header_with_records_after_it_is_damage(tmp_path: Path) -> None:
    m = build(tmp_path)
    m.clock.advance(5)
    last = rotate(m)
    m.sp.close()
    path = segment_path(os.path.join(m.path, "log"), last)
    with open(path, "r+b") as f:
        f.write(bytes(SEGMENT_HEADER_SIZE))
    out = run_json("verify", m.path, code=1)
    assert out["torn_tail"] is None
    assert [(p["kind"], p["file"], p["offset"]) for p in out["problems"] if p["kind"] == "damage"] == \
        [("damage", path, 0)]


def test_verify_reports_a_live_body_in_a_reclaimed_segment(tmp_path: Path) -> None:
    """Deleting a segment that a live envelope still needs is the loss verify must catch."""
    clock = Clock()
    path = str(tmp_path / "spool")
    m = Made(path, Spool.open(path, config(clock), NoSync()), clock)
    try:
        m.enqueue(2, ("d@example.net",))
        # a body that just fits in segment 1, so that its envelope rotates into segment 2
        room = 4096 - pos_offset(m.sp.writer.head) - HEADER_SIZE - 20
        mid = m.sp.enqueue("s@example.com", ["d@example.net"], b"y" * room)
        m.sp.commit()
        msg = admin.find(m.sp, mid)
        assert pos_segment(msg.envelope.body[0]) == 1 and pos_segment(msg.pos) == 2
    finally:
        m.sp.close()
    assert run_json("verify", path)["clean"] is True
    # as if segment 1 had been reclaimed too early
    os.rename(segment_path(os.path.join(path, "log"), 1), str(tmp_path / "gone.seg"))
    out = run_json("verify", path, code=1)
    msgs = [(p["position"], p["message"]) for p in out["problems"]]
    # The checkpoint says segment 1 must still exist (nothing reclaims it before garbage_end - 2 - body_span):
    # its absence is a missing segment, and the live message whose body it held is named too.
    assert msgs == [("1:0", "segment 1 is missing; the checkpoint needs every segment from 1 on"),
                    (format_pos(msg.pos), f"ENVELOPE body chunk -> {format_pos(msg.envelope.body[0])}: a live "
                     "message's data lies in segment 1, which was already reclaimed")]
    assert out["problems"][0]["kind"] == "segment" and out["problems"][0]["anomaly"] == "missing_segment"


def test_recover_reports_the_removed_half_created_segment_as_tail_cut(tmp_path: Path) -> None:
    """Engine bug (spool/engine/recovery.py, then Spool._drop_empty_last_segment): the half-created last
    segment it removes is a torn tail, but recovery_stats.tail_cut_bytes stayed 0, so
    `spoolctl recover` told the operator nothing was cut."""
    m = build(tmp_path)
    m.clock.advance(5)
    last = rotate(m)
    m.sp.close()
    with open(segment_path(os.path.join(m.path, "log"), last), "r+b") as f:
        f.truncate(10)
    assert run_json("recover", m.path)["tail_cut_bytes"] == 10


@pytest.mark.parametrize("mode", ["hold", "redeliver"])
def test_recover_holds_a_message_in_doubt_unless_told_to_redeliver(tmp_path: Path, mode: str) -> None:
    """``spoolctl recover --in-doubt`` chooses as the relay's ``[spool] in_doubt`` does; hold by default."""
    path = str(tmp_path / "spool")
    sp = Spool.open(path, SpoolConfig())
    mid = sp.enqueue("s@src.example", ["a@x.example"], b"body")
    sp.commit()
    (attempt,) = sp.poll_due()
    sp.record_sending(attempt, attempt.remaining)
    sp.commit()  # past the point of no return, no outcome: in doubt
    sp.close()
    rec = run_json("recover", path, *(["--in-doubt", mode] if mode == "redeliver" else []))
    assert (rec["in_doubt"], rec["held"]) == (1, 1 if mode == "hold" else 0)
    sp = Spool.open(path, SpoolConfig())
    try:
        (msg,) = admin.iter_live(sp)
        assert msg.message_id == mid and msg.held == (mode == "hold") and msg.envelope.in_doubt == ("a@x.example",)
    finally:
        sp.close()
