"""Spools for the salvage tests: built by the real engine, damaged afterwards, and a ledger of what was queued.

``build`` makes a spool with small segments, bodies of several chunks that
cross segments, deferred messages (one and two attempts), partly delivered
ones, held ones and fresh ones, then reopens it (recovery, checkpoint). The
``Ledger`` is what the engine's own listing says is queued, with every byte
range each live message occupies (its envelope and its body chunks), so a test
knows which messages a given damage touched.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool
from spool.fileio import OsFileIO
from spool.format.record import FLAGS_OFFSET, HEADER, HEADER_SIZE, Outcome, Status, format_id, pos_offset, pos_segment
from spool.format.segment import SEGMENT_HEADER_SIZE, list_segments, segment_path
from spool.read import listing as admin
from spool.read.listing import SpoolView

SEGMENT_SIZE = 16 * 1024
BODY_CHUNK = 1024


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def config(clock: Callable[[], float], intervals: tuple[float, ...]) -> SpoolConfig:
    return SpoolConfig(segment_size=SEGMENT_SIZE, body_chunk=BODY_CHUNK, retry_intervals=intervals, clock=clock,
                       fit_to_disk=False)


@attrs.frozen
class Queued:
    """One live message as the engine lists it, with the byte ranges of its records."""

    queue_id: str
    sender: str
    recipients: tuple[str, ...]
    body: bytes
    klass: int
    held: bool
    arrival_ms: int
    attempts: int
    appended: int
    in_doubt: tuple[str, ...]
    extra: dict[str, Any]
    envelope: tuple[int, int, int]  # segment, first byte, end
    chunks: tuple[tuple[int, int, int], ...]

    def same(self) -> tuple[Any, ...]:
        """What salvage must keep."""
        return (self.queue_id, self.sender, self.recipients, self.body, self.klass, self.held, self.arrival_ms,
                self.attempts, self.appended, self.in_doubt, self.extra)

    @property
    def records(self) -> tuple[tuple[int, int, int], ...]:
        return (self.envelope, *self.chunks)


def ledger(path: str) -> dict[str, Queued]:
    """Every live message of the spool at ``path`` (read-only, through the engine's listing)."""
    view = SpoolView(path)
    out: dict[str, Queued] = {}
    for m in admin.iter_live(view):
        env = m.envelope
        chunks = tuple(_extent(view, p) for p in env.body)
        out[format_id(m.message_id)] = Queued(
            format_id(m.message_id), env.sender, env.recipients, b"".join(view.read_body(env)), m.klass, m.held,
            env.arrival_ms, env.attempts, m.appended, env.in_doubt, dict(env.extra), _extent(view, m.pos), chunks)
    return out


def _extent(view: SpoolView, pos: int) -> tuple[int, int, int]:
    frame = view.read_frame(pos)
    return pos_segment(pos), pos_offset(pos), pos_offset(pos) + frame.size


def build(path: str, clock: Clock, intervals: tuple[float, ...] = (60.0, 300.0), seed: int = 7,
          messages: int = 60) -> dict[str, Queued]:
    """A spool with every kind of queued message (see the module docstring); returns its ledger."""
    rng = random.Random(seed)
    cfg = config(clock, intervals)
    sp = Spool.open(path, cfg)
    try:
        ids = []
        for i in range(messages):
            size = rng.choices((40, 300, 1500, 5000, 21000), (4, 4, 2, 1, 1))[0]  # 21000: 21 chunks, 2+ segments
            rcpts = tuple(f"r{i}.{k}@example.net" for k in range(1 + i % 3))
            body = f"Subject: message {i}\r\n\r\n".encode() + text(rng, size)
            ids.append(sp.enqueue(f"s{i}@example.com", rcpts, body, extra={"client": f"192.0.2.{i}"}))
            clock.advance(1)
        sp.commit()
        clock.advance(1)
        for n, a in enumerate(sp.poll_due(now=clock(), limit=messages * 2 // 3)):
            outcomes = dict.fromkeys(a.envelope.recipients, Status.DEFERRED)
            if n % 4 == 0:
                outcomes = dict.fromkeys(outcomes, Status.DELIVERED)
            elif n % 4 == 3:
                outcomes[a.envelope.recipients[0]] = Status.DELIVERED  # partly delivered
            _outcome(sp, a, outcomes)
        clock.advance(intervals[0] + 1)
        for n, a in enumerate(sp.poll_due(now=clock(), limit=messages)):
            if a.klass == 1 and n % 2 == 0:  # a second failure: class 2, two attempts
                _outcome(sp, a, dict.fromkeys(a.remaining, Status.DEFERRED))
            elif a.klass == 1:
                _outcome(sp, a, dict.fromkeys(a.remaining, Status.DELIVERED))
            else:  # the fresh messages the first round left: deferred once
                _outcome(sp, a, dict.fromkeys(a.remaining, Status.DEFERRED))
        deferred = {m.klass: m.message_id for m in admin.iter_live(sp)}
        for i in range(6):  # fresh mail at the head of the log
            ids.append(sp.enqueue(f"late{i}@example.com", (f"late{i}@example.net",),
                                  b"Subject: late\r\n\r\n" + text(rng, rng.choice((100, 3000)))))
            clock.advance(1)
        sp.commit()
        for mid in (deferred[1], deferred[2], ids[-1]):  # held: a deferred one of each class, a fresh one
            assert sp.change(mid, "hold")
        sp.checkpoint()
    finally:
        sp.close()
    Spool.open(path, cfg).close()  # the recovery's checkpoint covers the whole log
    os.remove(os.path.join(path, "lock"))
    return ledger(path)


def text(rng: random.Random, size: int) -> bytes:
    """About ``size`` bytes of mail text: lines of letters and digits, CRLF (any SMTP hop carries it as is)."""
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    lines = []
    while size > 0:
        n = min(size, rng.randint(10, 76))
        lines.append("".join(rng.choices(alphabet, k=n)))
        size -= n + 2
    return ("\r\n".join(lines) + "\r\n").encode()


def _outcome(sp: Spool, attempt: Any, outcomes: dict[str, Status]) -> None:
    sp.record_delivery(attempt, [Outcome(r, s, 250 if s is Status.DELIVERED else 451, "", "ok", "mx.example.net")
                                 for r, s in outcomes.items()])
    sp.commit()
    sp.finish(attempt)
    sp.commit()


# -- damage ---------------------------------------------------------------------------------


Range = tuple[int, int, float]  # segment, first byte, end (math.inf: to the end of the file)


def segments(path: str) -> list[int]:
    return list_segments(OsFileIO(), os.path.join(path, "log"))


def seg_file(path: str, seg: int) -> str:
    return segment_path(os.path.join(path, "log"), seg)


def zero(path: str, seg: int, offset: int, length: int) -> list[Range]:
    with open(seg_file(path, seg), "r+b") as f:
        f.seek(offset)
        f.write(bytes(length))
    return [(seg, offset, offset + length)]


def flip_bits(path: str, seg: int, rng: random.Random, n: int) -> list[Range]:
    """``n`` random bit flips in ``seg``, none on a frame's garbage mark (outside the checksum by design)."""
    name = seg_file(path, seg)
    with open(name, "rb") as f:
        data = bytearray(f.read())
    flags = frame_offsets(bytes(data))
    out: list[Range] = []
    for _ in range(n):
        off = rng.randrange(SEGMENT_HEADER_SIZE, len(data))
        bit = rng.randrange(1, 8) if off - FLAGS_OFFSET in flags else rng.randrange(8)
        data[off] ^= 1 << bit
        out.append((seg, off, off + 1))
    with open(name, "r+b") as f:
        f.write(data)
    return out


def truncate(path: str, seg: int, size: int) -> list[Range]:
    os.truncate(seg_file(path, seg), size)
    return [(seg, size, math.inf)]


def remove(path: str, seg: int) -> list[Range]:
    os.remove(seg_file(path, seg))
    return [(seg, 0, math.inf)]


def frame_offsets(data: bytes) -> set[int]:
    out = set()
    off = SEGMENT_HEADER_SIZE
    while off + HEADER_SIZE <= len(data):
        out.add(off)
        off += HEADER_SIZE + HEADER.unpack_from(data, off)[1]
    return out


def hits(records: Iterable[tuple[int, int, int]], damage: Iterable[Range]) -> bool:
    """Does the damage reach a byte of one of these records (segment, first byte, end)?"""
    damage = list(damage)
    return any(seg == rs and lo < rhi and rlo < hi for rs, rlo, rhi in records for seg, lo, hi in damage)


def touched(msg: Queued, damage: Iterable[Range]) -> bool:
    """Does the damage reach a byte of one of the message's records (its envelope, a body chunk)?"""
    return hits(msg.records, damage)


def snapshot(path: str) -> dict[str, bytes]:
    """Every file under ``path`` and its bytes: salvage must leave them as they were."""
    out = {}
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out
