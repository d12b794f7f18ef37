"""Damaged spools for the relay's damage tests: built by the real engine, damaged as the corrupt harness does.

``build_template`` makes a spool of deferred messages over several small
segments (each message: body, envelope, a claim, a deferral, a replacement
envelope of the first deferred class), checkpointed, with a few new messages
after the checkpoint; every record is an hour old, so every message is due
the moment a relay starts on it. ``Template`` knows where every message's
records lie, so a test can say which messages a damaged byte range touched,
and the damage is applied with ``fault_injection.corrupt.Mutation`` where it
fits (flips, zeroed ranges, truncation).
"""

from __future__ import annotations

import os
import random
import shutil
import time

import attrs

from fault_injection.corrupt import Mutation
from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool
from spool.fileio import OsFileIO
from spool.format.record import (
    Envelope,
    Frame,
    Outcome,
    RecordType,
    Status,
    decode_payload,
    format_id,
    make_pos,
    pos_offset,
    pos_segment,
)
from spool.format.segment import list_segments, segment_path
from spool.read.reader import LogReader

SEGMENT_SIZE = 16 * 1024


@attrs.frozen
class Message:
    """One message of the template: its queue id, recipient, Message-ID, and where its live records lie."""

    qid: str
    sender: str
    rcpt: str
    message_id: str
    envelope: tuple[int, int]  # the live envelope's [position, end)
    body: tuple[tuple[int, int], ...]  # its DATA records' [position, end)
    new: bool  # enqueued after the checkpoint, never claimed


@attrs.frozen
class Template:
    path: str
    messages: tuple[Message, ...]
    segments: tuple[int, ...]
    frames: tuple[Frame, ...]  # every record, in log order

    def copy(self, dst: str) -> str:
        shutil.copytree(self.path, dst)
        return dst

    def seg_file(self, spool: str, seg: int) -> str:
        return segment_path(os.path.join(spool, "log"), seg)

    def seg_rel(self, seg: int) -> str:
        return os.path.join("log", os.path.basename(segment_path("", seg)))

    def touched(self, lo: int, hi: int) -> tuple[set[str], set[str]]:
        """Queue ids whose live envelope lies in positions [lo, hi), and those whose body does (only)."""
        envelopes = {m.qid for m in self.messages if m.envelope[0] < hi and lo < m.envelope[1]}
        bodies = {m.qid for m in self.messages if m.qid not in envelopes
                  and any(a < hi and lo < b for a, b in m.body)}
        return envelopes, bodies

    def frame_at(self, seg: int, offset: int) -> Frame:
        """The record whose bytes hold ``offset`` of segment ``seg``."""
        pos = make_pos(seg, offset)
        return next(f for f in self.frames if f.pos <= pos < f.pos + f.size)


class NoSync(OsFileIO):
    """Building a template needs no durability: the tests start relays on copies of it."""

    def fsync(self, fd: int) -> None:
        pass

    def fdatasync(self, fd: int) -> None:
        pass

    def fsync_dir(self, path: str) -> None:
        pass


def body_of(i: int) -> bytes:
    text = f"Subject: message {i}\r\nMessage-ID: <m{i}@damage.test>\r\nFrom: s{i}@example.org\r\n\r\n"
    return (text + f"body of message {i} " * 20 + "\r\n").encode()


def build_template(path: str, *, rounds: int = 12, per_round: int = 8, new: int = 4) -> Template:
    """``rounds`` x ``per_round`` deferred messages (interleaved: bodies, envelopes, claims, deferrals and
    replacements in every segment), a checkpoint, then ``new`` messages after it."""
    clock = [time.time() - 3600]
    config = SpoolConfig(segment_size=SEGMENT_SIZE, retry_intervals=(3600.0, 7200.0), clock=lambda: clock[0])
    sp = Spool.open(path, config, NoSync())
    senders: dict[int, tuple[str, str, str]] = {}
    i = 0
    for _ in range(rounds):
        for _ in range(per_round):
            sender, rcpt = f"s{i}@example.org", f"r{i}@far.example"
            mid = sp.enqueue(sender, [rcpt], body_of(i))
            senders[mid] = (sender, rcpt, f"m{i}@damage.test")
            i += 1
        sp.commit()
        clock[0] += 0.5
        attempts = sp.poll_due(now=clock[0])
        assert len(attempts) == per_round
        for a in attempts:
            sp.record_delivery(a, [Outcome(a.envelope.recipients[0], Status.DEFERRED, 451, "4.3.0", "later")])
        sp.commit()
        for a in attempts:
            sp.finish(a)
        sp.commit()
    sp.checkpoint()
    fresh = set()
    for _ in range(new):
        sender, rcpt = f"s{i}@example.org", f"r{i}@far.example"
        mid = sp.enqueue(sender, [rcpt], body_of(i))
        senders[mid] = (sender, rcpt, f"m{i}@damage.test")
        fresh.add(mid)
        i += 1
        sp.commit()
    sp.close()
    return _read_template(path, senders, fresh)


def _read_template(path: str, senders: dict[int, tuple[str, str, str]], fresh: set[int]) -> Template:
    io = OsFileIO()
    log_dir = os.path.join(path, "log")
    frames = tuple(f for f in LogReader(io, log_dir).frames())
    sizes = {f.pos: f.size for f in frames}
    live: dict[int, tuple[int, Envelope]] = {}
    for f in frames:
        if f.rtype == RecordType.ENVELOPE and not f.garbage:
            env = decode_payload(f.rtype, f.payload)
            assert isinstance(env, Envelope)
            live[env.message_id] = (f.pos, env)
    messages = []
    for mid, (pos, env) in sorted(live.items()):
        sender, rcpt, message_id = senders[mid]
        body = tuple((p, p + sizes[p]) for p in env.body)
        messages.append(Message(format_id(mid), sender, rcpt, message_id, (pos, pos + sizes[pos]), body,
                                mid in fresh))
    return Template(path, tuple(messages), tuple(list_segments(io, log_dir)), frames)


def flip_bits(spool: str, path: str, offsets: list[tuple[int, int]]) -> None:
    for off, bit in offsets:
        Mutation(path, "bitflip", off, 0, bit).apply(spool)


def random_flips(rng: random.Random, size: int, lo: int, n: int) -> list[tuple[int, int]]:
    """``n`` bit flips at random offsets in [lo, size), never bit 0 of a flags byte (outside the checksum)."""
    out: list[tuple[int, int]] = []
    while len(out) < n:
        off = rng.randrange(lo, size)
        out.append((off, rng.randrange(1, 8)))
    return out


def position(seg: int, offset: int) -> int:
    return make_pos(seg, offset)


__all__ = ["SEGMENT_SIZE", "Message", "NoSync", "Template", "body_of", "build_template", "flip_bits",
           "pos_offset", "pos_segment", "position", "random_flips"]
