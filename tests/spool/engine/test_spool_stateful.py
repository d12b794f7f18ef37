"""The engine against a dictionary: a Hypothesis state machine with crashes.

Rules drive a real spool on disk (small segments, so rotation and segment
deletion happen) with a fake clock, and apply the same operations to
``tests.spool_model.SpoolModel``. A crash is ``close()`` without ``commit()``
followed by ``Spool.open``: the model rolls back to its last commit and does
what recovery promises. After every step the live messages the engine lists,
their recipients, class, held flag, in-doubt list and bodies must equal the
model's.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)
from spool_model import SpoolModel

from spool.config.engine import SpoolConfig
from spool.config.fairness import QUIET
from spool.engine.spool import Attempt, Spool
from spool.errors import MessageBusy, NotFound
from spool.format.record import HELD_CLASS, Outcome, Status
from spool.format.segment import list_segments
from spool.read import listing as admin

INTERVALS = (10.0, 20.0, 40.0)
# The machine checks what a crash (close without commit) keeps and loses, which does not depend on
# the medium; it makes thousands of fsync calls, and on tmpfs those return at once. Power loss is
# the fault-injection harness's subject, not this one's.
SCRATCH = os.environ.get("SPOOL_TEST_SCRATCH") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
LIFETIME = 300.0
ACTIVE_LIMIT = 6

addresses = st.sampled_from(["a@one.example", "b@one.example", "c@two.example", "d@three.example",
                             "e@two.example"])
recipient_lists = st.lists(addresses, min_size=1, max_size=3, unique=True).map(tuple)
bodies = st.binary(max_size=600)
statuses = st.sampled_from([Status.DELIVERED, Status.DEFERRED, Status.BOUNCED])


class SpoolMachine(RuleBasedStateMachine):
    messages = Bundle("messages")
    attempts = Bundle("attempts")

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="spool-stateful-", dir=SCRATCH)
        self.now = 1_000_000.0
        self.config = SpoolConfig(retry_intervals=INTERVALS, segment_size=4096, active_limit=ACTIVE_LIMIT,
                                  max_queue_lifetime=LIFETIME, body_chunk=128, clock=lambda: self.now)
        self.spool = Spool.open(self.dir, self.config)
        self.model = SpoolModel(self.config.classes)
        self.generation = 0
        self.live_attempts: dict[int, Attempt] = {}
        self.reclaimed = 0

    def teardown(self) -> None:
        self.spool.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- helpers ------------------------------------------------------------------

    def _attempt(self, handle: tuple[int, int]) -> Attempt | None:
        gen, start = handle
        if gen != self.generation or start not in self.model.flights:
            return None  # lost in a crash, or already finished
        return self.live_attempts[start]

    def _claimed(self, attempts: list[Attempt]) -> list[tuple[int, int]]:
        eligible = self.model.eligible()
        handles = []
        for a in attempts:
            mid = a.message_id
            assert mid in eligible, f"{mid:X} started but not eligible (held, busy or gone)"
            eligible.discard(mid)
            m = self.model.msgs[mid]
            assert a.envelope.recipients == m.recipients
            assert a.klass == m.klass
            assert a.expired == (self.now - m.arrival >= LIFETIME)
            self.model.start(a.start_pos, mid)
            self.live_attempts[a.start_pos] = a
            handles.append((self.generation, a.start_pos))
        assert len(self.spool.attempts) <= ACTIVE_LIMIT
        return handles

    # -- rules ----------------------------------------------------------------------

    @rule(target=messages, rcpts=recipient_lists, body=bodies, how=st.sampled_from(["bytes", "parts", "writer"]),
          cut=st.integers(0, 600))
    def enqueue(self, rcpts: tuple[str, ...], body: bytes, how: str, cut: int) -> int:
        if how == "bytes":
            src: object = body
        elif how == "parts":
            src = [body[:cut], body[cut:]]
        else:
            w = self.spool.begin_body()
            w.write(body[:cut])
            w.write(body[cut:])
            src = w
        mid = self.spool.enqueue("s@sender.example", rcpts, src)  # type: ignore[arg-type]
        self.model.enqueue(mid, rcpts, body, self.now)
        return mid

    @rule(target=messages, batch=st.lists(st.tuples(recipient_lists, bodies), min_size=1, max_size=5))
    def enqueue_many(self, batch: list[tuple[tuple[str, ...], bytes]]):  # type: ignore[no-untyped-def]
        ids = self.spool.enqueue_many([("s@sender.example", r, b) for r, b in batch])
        assert len(set(ids)) == len(ids)
        for mid, (r, b) in zip(ids, batch):
            self.model.enqueue(mid, r, b, self.now)
        self.model.commit()
        return multiple(*ids)

    @rule()
    def commit(self) -> None:
        self.spool.commit()
        self.model.commit()

    @rule(dt=st.sampled_from([1, 5, 11, 25, 60]))
    def advance_clock(self, dt: int) -> None:
        self.now += dt

    @rule(target=attempts, limit=st.none() | st.integers(1, 4))
    def poll_due(self, limit: int | None):  # type: ignore[no-untyped-def]
        got = self.spool.poll_due(limit=limit)
        if limit is not None:
            assert len(got) <= limit
        return multiple(*self._claimed(got))

    @rule(target=attempts)
    def drain(self):  # type: ignore[no-untyped-def]
        """Commit, let every runner pass the head, and poll until nothing more comes: all eligible mail is due.

        While new mail is being claimed the deferred budget rations deferred claims; the drain lets
        simulated time pass to ``next_wake`` when a poll comes back empty, which also checks that the
        budget never holds due mail back longer than its quiet interval.
        """
        self.spool.commit()
        self.model.commit()
        self.now += max(INTERVALS) + 1
        expected = self.model.eligible()
        room = ACTIVE_LIMIT - len(self.model.flights)
        handles: list[tuple[int, int]] = []
        got: set[int] = set()
        for _ in range(2 * ACTIVE_LIMIT + 2 + len(self.model.msgs)):  # an empty poll moves a runner on
            batch = self.spool.poll_due()
            if batch:
                got |= {a.message_id for a in batch}
                handles += self._claimed(batch)
                continue
            wake = self.spool.next_wake()
            if len(self.spool.attempts) >= ACTIVE_LIMIT or wake is None:
                break
            # ``wake <= now`` after an empty poll: a runner stopped at its limit on candidates that were
            # not claims (a held envelope carried forward), and the next poll goes on from there.
            assert wake - self.now <= QUIET, f"next_wake {wake - self.now:.3f} s away with mail due"
            self.now = max(self.now, wake)
        if len(expected) <= room:
            assert got == expected, f"due but not started: {sorted(expected - got)}"
        else:
            assert len(got) == room
        return multiple(*handles)

    @rule(handle=attempts, data=st.data())
    def record_delivery(self, handle: tuple[int, int], data: st.DataObject) -> None:
        attempt = self._attempt(handle)
        if attempt is None:
            return
        remaining = list(attempt.remaining)
        if not remaining:
            return
        chosen = data.draw(st.lists(st.sampled_from(remaining), min_size=1, unique=True), label="recipients")
        outs = {r: data.draw(statuses, label=r) for r in chosen}
        self.spool.record_delivery(attempt, [Outcome(r, s, 250 if s is Status.DELIVERED else 451) for r, s in
                                             outs.items()])
        self.spool.commit()
        self.model.record(attempt.start_pos, outs)
        self.model.commit()
        assert tuple(attempt.remaining) == self.model.flights[attempt.start_pos].remaining

    @rule(handle=attempts, data=st.data())
    def pass_point_of_no_return(self, handle: tuple[int, int], data: st.DataObject) -> None:
        """A transaction's final dot is about to go out: its recipients' ``sending``, committed."""
        attempt = self._attempt(handle)
        if attempt is None or not attempt.remaining:
            return
        chosen = tuple(data.draw(st.lists(st.sampled_from(list(attempt.remaining)), min_size=1, unique=True),
                                 label="sending"))
        self.spool.record_sending(attempt, chosen)
        self.spool.commit()
        self.model.send(attempt.start_pos, chosen)
        self.model.commit()

    @rule(handle=consumes(attempts))
    def finish(self, handle: tuple[int, int]) -> None:
        attempt = self._attempt(handle)
        if attempt is None:
            return
        replacement = self.spool.finish(attempt)
        assert (replacement is None) == (not self.model.flights[attempt.start_pos].remaining)
        self.model.finish(attempt.start_pos)
        del self.live_attempts[attempt.start_pos]

    @rule()
    def checkpoint(self) -> None:
        gone = self.spool.checkpoint()
        self.model.commit()
        on_disk = list_segments(self.spool.io, self.spool.log_dir)
        assert not set(gone) & set(on_disk)
        assert on_disk == list(range(on_disk[0], on_disk[-1] + 1)), "segment ids must stay contiguous"
        self.reclaimed += len(gone)

    @rule()
    def crash(self) -> None:
        self.spool.close()
        self.spool = Spool.open(self.dir, self.config)
        self.generation += 1
        self.live_attempts.clear()
        in_flight, doubt = self.model.crash()
        stats = self.spool.recovery_stats
        assert stats.in_flight == in_flight
        assert stats.in_doubt == doubt
        assert stats.tail_cut_bytes == 0

    # -- invariants ---------------------------------------------------------------

    @invariant()
    def attempts_match(self) -> None:
        engine = sorted((s, a.message_id, tuple(a.remaining)) for s, a in self.spool.attempts.items())
        model = sorted((s, f.mid, f.remaining) for s, f in self.model.flights.items())
        assert engine == model

    @precondition(lambda self: not self.spool.writer.has_pending)
    @invariant()
    def live_messages_match(self) -> None:
        live = list(admin.iter_live(self.spool))
        ids = [m.message_id for m in live]
        assert len(ids) == len(set(ids)), "a message is listed twice (two live envelopes)"
        assert set(ids) == set(self.model.msgs), (
            f"engine only: {[f'{i:X}' for i in set(ids) - set(self.model.msgs)]}, "
            f"model only: {[f'{i:X}' for i in set(self.model.msgs) - set(ids)]}")
        assert not set(ids) & self.model.state.done, "a finished message is live again"
        busy = self.model.in_flight()
        for msg in live:
            m = self.model.msgs[msg.message_id]
            assert msg.envelope.recipients == m.recipients
            assert msg.held == m.held
            assert msg.klass == (HELD_CLASS if m.held else m.klass)
            assert (msg.state == "active") == (msg.message_id in busy)
            assert set(msg.envelope.in_doubt) == m.in_doubt
            assert msg.envelope.arrival_ms == int(m.arrival * 1000)
            assert msg.envelope.body_size == len(m.body)
            assert b"".join(self.spool.read_body(msg.envelope)) == m.body


SETTINGS = settings(
    max_examples=int(os.environ.get("SPOOL_STATEFUL_EXAMPLES", "40")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class SpoolAdminMachine(SpoolMachine):
    """The same machine with admin changes (hold, release, delete, flush) by queue id."""

    @rule(mid=SpoolMachine.messages, action=st.sampled_from(["hold", "release", "delete", "flush"]))
    def admin_change(self, mid: int, action: str) -> None:
        self.spool.commit()
        self.model.commit()
        m = self.model.msgs.get(mid)
        # What change() should do: NotFound for a message that is not live; False when there is
        # nothing to do; MessageBusy when there is, but an attempt has it; otherwise the change.
        if m is None:
            expect: object = NotFound
        elif (action == "hold" and m.held) or (action == "release" and not m.held) \
                or (action == "flush" and (m.held or m.klass == 0)):
            expect = False
        elif mid in self.model.in_flight():
            expect = MessageBusy
        else:
            expect = True
        try:
            changed: object = self.spool.change(mid, action)
        except (NotFound, MessageBusy) as exc:
            changed = type(exc)
        assert changed == expect, f"change({mid:X}, {action!r}): expected {expect}, got {changed}"
        if changed is True:
            if action == "hold":
                self.model.hold(mid)
            elif action == "delete":
                self.model.delete(mid)
            else:
                self.model.release(mid)
        self.model.commit()


SpoolMachine.TestCase.settings = SETTINGS
TestSpoolMachine = SpoolMachine.TestCase

# Admin changes run in their own machine so that a failure names them. It once found runners starting
# envelopes an admin change had replaced (a stale read window; test_spool_runners pins the exact case).
SpoolAdminMachine.TestCase.settings = settings(SETTINGS,
                                               max_examples=int(os.environ.get("SPOOL_STATEFUL_EXAMPLES", "30")))
TestSpoolAdminMachine = SpoolAdminMachine.TestCase


def test_segments_rotate_and_get_reclaimed(tmp_path: os.PathLike[str]) -> None:
    """The machine's settings are meant to reach rotation and deletion; this checks they can."""
    now = [1_000_000.0]
    config = SpoolConfig(retry_intervals=INTERVALS, segment_size=4096, body_chunk=128, clock=lambda: now[0])
    sp = Spool.open(str(tmp_path), config)
    try:
        for _ in range(6):
            sp.enqueue_many([("s@x", ["a@one.example"], b"x" * 300)] * 5)
            for a in sp.poll_due():
                sp.record_delivery(a, [Outcome("a@one.example", Status.DELIVERED)])
                sp.finish(a)
            sp.commit()
            now[0] += 50
        sp.poll_due()
        gone = sp.checkpoint()
        assert gone, "no segment was reclaimed"
        assert admin.count(sp) == 0
    finally:
        sp.close()
