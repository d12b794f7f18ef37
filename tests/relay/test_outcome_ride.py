"""Delivery outcomes that ride the next commit (docs/benchmarks.md, "Outcomes ride the next enqueue commit").

A delivery's DELIVERY record waits, bounded, for the next commit somebody
needs (an enqueue's) instead of asking for an fsync of its own
(``GroupCommit.commit_riding``, ``Scheduler._commit_outcomes``). The rule it
must keep (docs/design.md, durability rules): the outcome is durable before
the message's next step, its FINISH. And a relay where no commit comes must
still commit it within the bound.

The first test records the real relay under concurrent SMTP clients (so the
outcomes do ride) with every file operation in order
(``fault_injection.relayload``), and checks the order of writes and syncs:
no FINISH record reaches a file before a sync of every DELIVERY record of its
attempt. A crash at any point of that order then finds each finished
attempt's outcomes on disk (the crash-state suites recover such recordings in
full; this names the one order that riding could break). The second holds a
client connected after its message, so that the outcome waits to ride, and no
other message comes: it is committed on its own when the bound runs out.
"""

from __future__ import annotations

import smtplib
import tempfile
from pathlib import Path

import trio
from relay_support import DeliveryWatch, relay_config, start_relay

from fault_injection import relayload, scratch_dir
from fault_injection.recording import Link, Recording, Sync, Write
from spool.errors import CorruptRecord
from spool.format.record import Delivery, Finish, RecordType, Status, decode_frame, decode_payload
from spool.format.segment import SEGMENT_HEADER_SIZE, parse_segment_name

BOUND = 10.0  # seconds: a bound on waiting for one outcome (liveness), not a pace


def _frames(rec: Recording) -> list[tuple[int, int, int, int]]:
    """(op index, inode, record type, attempt's START position) of every DELIVERY and FINISH frame written.

    A batch is written as whole frames from a frame boundary; zeros written
    ahead of the log (spool.write.room), segment headers and one-byte garbage marks
    decode as no frame and are skipped.
    """
    segment_of: dict[int, int] = {}
    found: list[tuple[int, int, int, int]] = []
    for i, op in enumerate(rec.ops):
        if isinstance(op, Link) and not op.is_dir:
            seg = parse_segment_name(op.name)
            if seg is not None:
                segment_of[op.ino] = seg
        if not isinstance(op, Write) or op.ino not in segment_of or len(op.data) < 2:
            continue
        seg = segment_of[op.ino]
        off = SEGMENT_HEADER_SIZE if op.offset == 0 else 0  # a new segment's header, written with its first records
        while off < len(op.data):
            try:
                frame = decode_frame(seg, op.data, off, at=op.offset + off)
            except CorruptRecord:
                break
            if frame.rtype in (RecordType.DELIVERY, RecordType.FINISH):
                payload = decode_payload(frame.rtype, frame.payload)
                assert isinstance(payload, Delivery | Finish)
                found.append((i, op.ino, frame.rtype, payload.start))
            off += frame.size
    return found


def test_no_finish_reaches_the_log_before_its_attempts_outcomes_are_synced() -> None:
    with tempfile.TemporaryDirectory(dir=scratch_dir()) as work:
        run = relayload.record(work, seed=7, messages=24, concurrency=4, min_deleted=0)
    rec = run.recording
    syncs: dict[int, list[int]] = {}
    for i, op in enumerate(rec.ops):
        if isinstance(op, Sync):
            syncs.setdefault(op.ino, []).append(i)
    deliveries: dict[int, list[tuple[int, int]]] = {}
    finishes: list[tuple[int, int]] = []
    for i, ino, rtype, start in _frames(rec):
        if rtype == RecordType.DELIVERY:
            deliveries.setdefault(start, []).append((i, ino))
        else:
            finishes.append((i, start))
    delivered = [(i, start) for i, start in finishes if start in deliveries]
    # Each of the 24 messages is finished once at least (the last FINISH records may still be unwritten when
    # the run stops: they are written lazily), and a message deferred at first once more.
    assert len(delivered) >= 20, f"only {len(delivered)} delivered attempts were finished: too few to say anything"
    for at, start in delivered:
        for written, ino in deliveries[start]:
            assert written < at, f"the FINISH of attempt {start:#x} was written before its DELIVERY"
            assert any(written < s < at for s in syncs.get(ino, [])), \
                f"the FINISH of attempt {start:#x} was written (op {at}) before its DELIVERY (op {written}) was synced"


def _open_and_send(port: int) -> smtplib.SMTP:
    """A client that sends one message and stays connected (it is not closed here)."""
    client = smtplib.SMTP("127.0.0.1", port, timeout=30)
    client.sendmail("alice@example.org", ["bob@localhost"], "Subject: ride\r\n\r\nwaits for a commit\r\n")
    return client


async def test_an_outcome_waiting_to_ride_on_a_quiet_relay_is_committed_when_the_bound_runs_out(
        tmp_path: Path) -> None:
    cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir", "*": "discard"})
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        aspool = relay.aspool
        client = await trio.to_thread.run_sync(_open_and_send, relay.ports[0])
        try:
            # The client is still connected and sends nothing more: the outcome waits to ride a commit that
            # does not come, and must be committed on its own (within the ride's bound; BOUND only says
            # that it never waits for ever).
            await watch.wait_for(Status.DELIVERED, 1, timeout=BOUND)
            assert aspool.rides == 1 and aspool.rides_run_out == 1
        finally:
            await trio.to_thread.run_sync(client.quit)
        nursery.cancel_scope.cancel()
