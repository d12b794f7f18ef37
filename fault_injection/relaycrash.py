"""Power cuts under the running relay: every crash state of its recorded workload, recovered and checked.

``python -m fault_injection relaycrash [--states N] [--seed S] [--messages M]``
``python -m fault_injection relaycrash --recording FILE --replay RECIPE``

Theory of operation
-------------------
A run (``fault_injection.relayload.record``) records the real relay, in this
process, accepting mail over SMTP, delivering it into Maildirs and to a next
hop, rotating 16 KiB segments, checkpointing and deleting segments, with every
file operation in one sequence. The recording is walked once
(``crashstates.Walker``); at crash points drawn from the seed, one state of a
*kind* is built:

- ``synced``: only what was fsynced (files) and what a directory fsync covered (names);
- ``prefix``: any prefix of each file's unsynced writes and of each directory's unsynced names;
- ``torn``: as ``prefix``, with one file's last surviving write cut at a 512-byte sector boundary;
- ``pages``: of each file's unsynced writes, any subset of the 4 KiB pages they
  touched, at the durable size or the issued one (page-order states);
- ``names``: every issued write survives, but of each directory's creates,
  renames and unlinks not followed by an fsync of that directory only a prefix
  does, often none (names vanish while their data stays).

A draw whose crash point has no state of its kind (nothing to tear, no
unsynced name) is tried again at the following points.

Each distinct state (content and acknowledgements) is written to a scratch
directory and recovered as the relay starts: ``mta.process.startup.check_start``
and ``Relay.run`` on the real files until it listens (every ``relay_every``-th
state, and the first), or ``Spool.open``, the recovery that start runs (the
rest; it is what decides what survives, and costs a fifth of a whole start).
Then the spool is opened again and checked against what the run promised
before the crash point:

1. the start did not refuse (no exception);
2. every recipient of a message answered ``250`` is still queued, or was
   delivered: its Maildir file is in ``new/``, whole, or the next hop had
   recorded it (``remote``) before the crash point, or it bounced and its DSN
   (to the sender's Maildir) is queued or in ``new/``;
3. no recipient whose DELIVERY record was durable (``recorded``) is queued
   again; one queued and also delivered is a duplicate (counted, allowed:
   the window between the delivery and its record);
4. every queued message reads back whole (checksums, and the bytes the client
   sent), has only its own recipients, and the runners claim every one of
   them but those recovery held because a recipient was in doubt;
5. counted (``held but never sent``): recipients held in doubt whose final
   dot the next hop had not seen before the crash point (its ``dot`` event)
   and that no Maildir holds. A claim alone is not doubt, so only a crash
   inside a transaction that had begun (its point of no return written, its
   dot not yet) can leave one.

A failing state prints its recipe; the recording is saved beside it, and
``--recording FILE --replay RECIPE`` recovers and checks that one state again.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable

import attrs
import trio

from fault_injection import crashstates, scratch_dir
from fault_injection.crashstates import Recipe, State, Walker
from fault_injection.ledger import FAR_FUTURE
from fault_injection.recording import Event
from fault_injection.relayload import SENDER_DOMAIN, Plan, Run, message_number, record, relay_config
from mta.process.relay import Relay
from mta.process.startup import check_start, unwrapped
from mta.shards import spool_config
from spool.damage.quarantine import DIRNAME as QUARANTINE_DIR
from spool.engine.spool import Spool
from spool.errors import SpoolError
from spool.format.record import Status
from spool.read import listing as admin

FINAL_RCPT = re.compile(rb"^Final-Recipient:\s*rfc822;\s*(\S+?)\s*$", re.MULTILINE | re.IGNORECASE)
KINDS = ("synced", "prefix", "torn", "pages", "names")
DEAD_PORT = 9  # the next hop of a recovered relay: nothing listens there (a delivery it starts defers)


@attrs.define
class Outcome:
    """What one state's recovery and check found."""

    violations: list[str] = attrs.field(factory=list)
    checked: int = 0  # acknowledged (message, recipient) pairs checked
    duplicates: int = 0
    refused: bool = False
    relay_started: bool = False
    quarantined: bool = False  # recovery cut damage (bytes that cannot have been acknowledged) into quarantine
    held: int = 0  # queued messages held in doubt (a delivery was under way at the crash)
    # Recipients held in doubt that were never sent: the next hop had not seen their final dot before the crash
    # point, and no Maildir has them. Only a crash inside a begun transaction (its point of no return written,
    # its dot not yet) can leave one (docs/design.md, "The point of no return"); a claim alone never does.
    held_unsent: int = 0
    # Of those, by where the crash point fell in the point's window: its record appended, the commit not yet
    # returned (the record survived the crash: recovery cannot tell it from a durable one); the record durable
    # and the dot free to go, the next hop not yet having read it; or before the record was even appended (a bug).
    held_in_commit: int = 0
    held_on_way: int = 0
    held_unmarked: int = 0


@attrs.define
class Report:
    states: int = 0
    by_kind: Counter[str] = attrs.field(factory=Counter)
    checked: int = 0
    lost: int = 0
    refusals: int = 0
    duplicates: int = 0
    relay_starts: int = 0
    quarantined: int = 0
    held: int = 0
    held_unsent: int = 0
    held_in_commit: int = 0
    held_on_way: int = 0
    held_unmarked: int = 0
    recordings: int = 0
    ops: int = 0
    segments_deleted: int = 0  # by the recorded runs' checkpoints, all runs together
    failures: list[str] = attrs.field(factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def line(self) -> str:
        kinds = ", ".join(f"{k} {self.by_kind[k]}" for k in KINDS)
        return (f"relay crash states {self.states} ({kinds}) from {self.recordings} recorded runs ({self.ops} file "
                f"ops, {self.segments_deleted} segments deleted); {self.relay_starts} recovered by a whole relay "
                f"start, the rest by Spool.open; acknowledged recipients checked {self.checked}; lost {self.lost}; "
                f"refusals to start {self.refusals}; duplicates {self.duplicates}; messages held in doubt "
                f"{self.held}; recipients held but never sent {self.held_unsent} (in their record's commit "
                f"{self.held_in_commit}, their dot on its way {self.held_on_way}, before their point "
                f"{self.held_unmarked}); states where recovery quarantined "
                f"damage {self.quarantined}; failed states "
                f"{len(self.failures)}")


def draw(walker: Walker, kind: str, rng: random.Random) -> Recipe | None:
    """A recipe of ``kind`` at the walker's current crash point; None when the point has no such state."""
    files, dirs = walker.choices()
    point = walker.point
    if kind == "synced":
        return Recipe(point, tuple(g[0] for g in files), tuple(g[0] for g in dirs))
    if kind == "prefix":
        return Recipe(point, tuple(rng.choice([o for o in g if o[2] < 0]) for g in files),
                      tuple(rng.choice(g) for g in dirs))
    if kind == "torn":
        tearable = [g for g in files if any(o[2] >= 0 for o in g)]
        if not tearable:
            return None
        victim = rng.choice(tearable)
        pick = [rng.choice([o for o in victim if o[2] >= 0]) if g is victim else rng.choice([o for o in g if o[2] < 0])
                for g in files]
        return Recipe(point, tuple(pick), tuple(rng.choice(g) for g in dirs))
    if kind == "pages":
        inos = [g[0][0] for g in files if walker.dirty_pages(g[0][0])]
        if not inos:
            return None
        pages = tuple((ino, rng.getrandbits(len(walker.dirty_pages(ino))), rng.randint(0, 1)) for ino in inos)
        rest = tuple(g[0] for g in files if g[0][0] not in inos)
        return Recipe(point, rest, tuple(rng.choice(g) for g in dirs), pages)
    if kind == "names":
        if not dirs:
            return None
        issued = tuple(max((o for o in g if o[2] < 0), key=lambda o: o[1]) for g in files)
        return Recipe(point, issued, tuple(rng.choice(g[:-1]) for g in dirs))
    raise ValueError(f"unknown kind {kind!r} (known: {', '.join(KINDS)})")


@attrs.frozen
class Promised:
    """What the run had promised before a crash point, from its events."""

    acked: dict[int, tuple[str, tuple[str, ...]]]  # message number -> (queue id, recipients)
    remote: frozenset[tuple[int, str]]  # (message number, recipient) the next hop had recorded
    recorded: frozenset[tuple[str, str]]  # (queue id, recipient) whose final DELIVERY record was durable
    dots: frozenset[tuple[int, str]] = frozenset()  # (message number, recipient) whose final dot the hop had seen
    marked: frozenset[tuple[int, str]] = frozenset()  # whose point of no return's record had been appended
    passed: frozenset[tuple[int, str]] = frozenset()  # ...and made durable: the dot may have been written

    @classmethod
    def of(cls, run: Run, events: int) -> Promised:
        acked: dict[int, tuple[str, tuple[str, ...]]] = {}
        remote: set[tuple[int, str]] = set()
        recorded: set[tuple[str, str]] = set()
        dots: set[tuple[int, str]] = set()
        points: dict[str, set[tuple[str, str]]] = {"mark": set(), "point": set()}  # (queue id, recipient)
        for ev in run.recording.events(None)[:events]:
            if ev.kind == "dot":
                dots.add((ev.data[0], ev.data[1]))
            elif ev.kind in points:
                points[ev.kind].add((ev.data[0], ev.data[1]))
            elif ev.kind == "ack":
                acked[ev.data[0]] = (ev.data[1], tuple(ev.data[2]))
            elif ev.kind == "remote":
                remote.add((ev.data[0], ev.data[1]))
            elif ev.kind == "recorded" and Status(ev.data[2]).final:
                recorded.add((ev.data[0], ev.data[1]))
        # Queue id -> message number from the whole run: a delivery may begin before its client logged the 250.
        number = {ev.data[1]: ev.data[0] for ev in run.recording.events(None) if ev.kind == "ack"}

        def numbered(pairs: set[tuple[str, str]]) -> frozenset[tuple[int, str]]:
            return frozenset((number[q], r) for q, r in pairs if q in number)  # a DSN's own: not in the plan

        return cls(acked, frozenset(remote), frozenset(recorded), frozenset(dots), numbered(points["mark"]),
                   numbered(points["point"]))


def dsn_pairs(data: bytes) -> set[tuple[int, str]]:
    """(message number, recipient) of each recipient a DSN reports (its returned headers name the message)."""
    n = message_number(data)
    return {(n, m.decode()) for m in FINAL_RCPT.findall(data)} if n >= 0 else set()


def maildir_files(root: str, plan: Plan, bounced: set[tuple[int, str]]) -> tuple[set[tuple[int, str]], list[str]]:
    """(message number, recipient) of every message in a ``new/`` of ``root/mail``, and what was wrong with any.

    A DSN (delivered to a sender's Maildir) adds what it reports to ``bounced``.
    """
    found: set[tuple[int, str]] = set()
    problems: list[str] = []
    mail = os.path.join(root, "mail")
    if not os.path.isdir(mail):
        return found, problems
    for box in sorted(os.listdir(mail)):
        new = os.path.join(mail, box, "new")
        for name in sorted(os.listdir(new)) if os.path.isdir(new) else []:
            with open(os.path.join(new, name), "rb") as fh:
                data = fh.read()
            n = message_number(data)
            rcpt = data.split(b"\r\n", 2)[1].removeprefix(b"Delivered-To: ").decode() if data.count(b"\r\n") > 1 else ""
            if rcpt.endswith("@" + SENDER_DOMAIN):
                reported = dsn_pairs(data)
                bounced.update(reported)
                if not reported or not data.endswith(b"\r\n"):
                    problems.append(f"Maildir file {box}/new/{name} is not a whole DSN ({len(data)} bytes)")
            elif n < 0 or n >= len(plan.sizes) or not data.endswith(plan.message(n)):
                problems.append(f"Maildir file {box}/new/{name} is not a whole message ({len(data)} bytes)")
            else:
                found.add((n, rcpt))
    return found, problems


def _queued(sp: Spool, plan: Plan, out: Outcome, bounced: set[tuple[int, str]],
            in_doubt: set[tuple[int, str]] | None = None) -> dict[str, set[str]]:
    """Queue id -> live recipients; checks bodies and recipients, and that the runners claim every message.

    A queued DSN adds what it reports to ``bounced``. A message recovery held because a recipient was
    in doubt (``[spool] in_doubt = "hold"``, the default) is queued, for the operator to release: the
    runners rightly pass it by. Nothing else in this workload is ever held.
    """
    live: dict[str, set[str]] = {}
    held: set[str] = set()
    for msg in admin.iter_live(sp):
        env = msg.envelope
        qid = sp.queue_id(env.message_id)
        if msg.held:
            held.add(qid)
            if not env.in_doubt:
                out.violations.append(f"queued message {qid} is held, yet no recipient of it is in doubt")
        if qid in live:
            out.violations.append(f"message {qid} has more than one live envelope")
        live.setdefault(qid, set()).update(env.recipients)
        try:
            body = b"".join(sp.read_body(env))
        except SpoolError as exc:
            out.violations.append(f"LOST: queued message {qid}: its body cannot be read: {exc}")
            continue
        n = message_number(body)
        if env.sender == "":
            reported = dsn_pairs(body)
            bounced.update(reported)
            if not reported:
                out.violations.append(f"queued DSN {qid} names no message and recipient ({len(body)} bytes)")
        elif n < 0 or n >= len(plan.sizes) or not body.endswith(plan.message(n)):
            out.violations.append(f"queued message {qid} does not read back as sent ({len(body)} bytes)")
        elif not set(env.recipients) <= set(plan.recipients[n]):
            out.violations.append(f"queued message {qid} has recipients it was not sent to")
        elif msg.held and in_doubt is not None:
            in_doubt.update((n, r) for r in env.in_doubt)
    claimed: set[str] = set()
    for _ in range(10_000):
        batch = sp.poll_due(now=FAR_FUTURE, limit=1000)
        if not batch:
            break
        claimed.update(sp.queue_id(a.message_id) for a in batch)
    out.held += len(held)
    out.violations += [f"queued message {q} is never claimed by a runner (stranded)"
                       for q in sorted(set(live) - held - claimed)]
    return live


async def _start_and_stop(relay: Relay) -> None:
    """The relay's start up to listening (recovery, runners, SMTP, control socket); then cancelled."""
    async with trio.open_nursery() as nursery:
        await nursery.start(relay.run)
        nursery.cancel_scope.cancel()


def recover(root: str, *, whole_relay: bool) -> None:
    """Start on the state in ``root`` as the relay does (``whole_relay``) or as its recovery does.

    The relay has no shutdown path; here, where it ran in this process, its spool is closed
    afterwards to release the lock, as the end of its process would.
    """
    if whole_relay:
        cfg = relay_config(root, DEAD_PORT)
        check_start(cfg)
        relay = Relay(cfg)
        try:
            with unwrapped():
                trio.run(_start_and_stop, relay)
        finally:
            if hasattr(relay, "aspool"):
                relay.aspool.core.close()
    else:
        Spool.open(os.path.join(root, "spool"), spool_config(relay_config(root, DEAD_PORT))).close()


def check_state(run: Run, state: State, events: int, workdir: str, *, whole_relay: bool) -> Outcome:
    """Materialise ``state``, recover it, and check it against what was promised before its crash point."""
    out = Outcome(relay_started=whole_relay)
    root = tempfile.mkdtemp(prefix="state-", dir=workdir)
    try:
        state.write_to(root)
        try:
            recover(root, whole_relay=whole_relay)
        except Exception as exc:
            out.refused = True
            out.violations.append(f"the start refused: {type(exc).__name__}: {exc}")
            return out
        qdir = os.path.join(root, "spool", QUARANTINE_DIR)
        out.quarantined = os.path.isdir(qdir) and bool(os.listdir(qdir))
        _check(run, root, Promised.of(run, events), out)
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _check(run: Run, root: str, promised: Promised, out: Outcome) -> None:
    plan = Plan.make(run.seed, run.messages)
    try:
        sp = Spool.open(os.path.join(root, "spool"), spool_config(relay_config(root, DEAD_PORT)))
    except Exception as exc:
        out.refused = True
        out.violations.append(f"the second open refused: {type(exc).__name__}: {exc}")
        return
    bounced: set[tuple[int, str]] = set()
    held: set[tuple[int, str]] = set()
    try:
        live = _queued(sp, plan, out, bounced, held)
    finally:
        sp.close()
    local, problems = maildir_files(root, plan, bounced)
    out.violations += problems
    unsent = held - promised.dots - local
    out.held_unsent = len(unsent)
    out.held_in_commit = len(unsent & promised.marked - promised.passed)
    out.held_on_way = len(unsent & promised.passed)
    out.held_unmarked = len(unsent - promised.marked)
    out.violations += [f"recipient {r} of message {n} is held in doubt, yet its point of no return had not begun"
                       for n, r in sorted(unsent - promised.marked)]
    for n, (qid, rcpts) in sorted(promised.acked.items()):
        for r in rcpts:
            out.checked += 1
            queued = r in live.get(qid, set())
            delivered = (n, r) in local or (n, r) in promised.remote or (n, r) in bounced
            if queued and (qid, r) in promised.recorded:
                out.violations.append(f"message {n} ({qid}) to {r}: its DELIVERY record was durable, queued again")
            elif queued and delivered:
                out.duplicates += 1
            elif not queued and not delivered:
                out.violations.append(f"LOST: message {n} ({qid}) to {r}: answered 250, neither queued nor delivered")


def _plan_states(run: Run, budget: int, seed: int) -> dict[int, list[tuple[str, int]]]:
    """Crash point -> [(kind, sub-seed)]: ``budget`` draws, kinds in turn, points uniform over the recording."""
    rng = random.Random(seed)
    points = [k for k, op in enumerate(run.recording.ops) if not isinstance(op, Event)]
    points.append(len(run.recording.ops))
    plan: dict[int, list[tuple[str, int]]] = {}
    for i in range(budget):
        plan.setdefault(rng.choice(points), []).append((KINDS[i % len(KINDS)], rng.getrandbits(32)))
    return plan


def explore(run: Run, budget: int, seed: int, report: Report, *, relay_every: int = 25,
            progress: Callable[[str], None] | None = None, save_dir: str | None = None) -> None:
    """Check up to ``budget`` distinct states of ``run`` (fewer when draws repeat a state), adding to ``report``.

    A failed state's recording is saved (once per run) in ``save_dir`` (None: the temporary directory).
    """
    saved: str | None = None
    workdir = tempfile.mkdtemp(prefix="logspool-relaycrash-", dir=scratch_dir())
    try:
        wanted = _plan_states(run, budget, seed)
        seen: set[tuple[str, int]] = set()
        walker = Walker(run.recording)
        carried: list[tuple[str, int]] = []  # draws whose point had no state of their kind: the next points try
        for point in walker.points():
            todo, carried = carried + wanted.get(point, []), []
            for kind, sub in todo:
                recipe = draw(walker, kind, random.Random(sub))
                if recipe is None:
                    carried.append((kind, sub))
                    continue
                state = walker.state(recipe)
                key = (state.digest(), walker.events)
                if key in seen:
                    continue
                seen.add(key)
                whole = report.states % relay_every == 0
                res = check_state(run, state, walker.events, workdir, whole_relay=whole)
                report.states += 1
                report.by_kind[kind] += 1
                report.checked += res.checked
                report.duplicates += res.duplicates
                report.relay_starts += whole
                report.refusals += res.refused
                report.quarantined += res.quarantined
                report.held += res.held
                report.held_unsent += res.held_unsent
                report.held_in_commit += res.held_in_commit
                report.held_on_way += res.held_on_way
                report.held_unmarked += res.held_unmarked
                report.lost += sum(1 for v in res.violations if v.startswith("LOST"))
                if res.violations:
                    where = saved or save_recording(run, save_dir)
                    saved = where
                    line = (f"FAIL seed {run.seed} kind {kind}: python -m fault_injection relaycrash --recording "
                            f"{where} --replay '{recipe.text()}'\n  " + "\n  ".join(res.violations[:5]))
                    report.failures.append(line)
                    if progress:
                        progress(line)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def save_recording(run: Run, directory: str | None = None) -> str:
    fd, path = tempfile.mkstemp(prefix=f"relaycrash-seed{run.seed}-", suffix=".pickle",
                                dir=directory or tempfile.gettempdir())
    os.close(fd)
    run.save(path)
    return path


def run(states: int, seed: int = 0, *, messages: int = 40, per_recording: int = 1000, relay_every: int = 25,
        progress: Callable[[str], None] | None = None, save_dir: str | None = None) -> Report:
    """Record runs (seed, seed+1, ...) and check their crash states until ``states`` were checked."""
    report = Report()
    s = seed
    while report.states < states:
        workdir = tempfile.mkdtemp(prefix=f"logspool-relayrun-{s}-", dir=scratch_dir())
        try:
            t0 = time.monotonic()
            recorded = record(os.path.join(workdir, "run"), s, messages)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        report.recordings += 1
        report.ops += len(recorded.recording.ops)
        report.segments_deleted += recorded.segments_deleted
        before = report.states
        explore(recorded, min(per_recording, states - report.states), s, report, relay_every=relay_every,
                progress=progress, save_dir=save_dir)
        if progress:
            progress(f"seed {s}: {len(recorded.recording.ops)} ops recorded in {recorded.seconds:.1f}s, "
                     f"{report.states - before} states checked [{time.monotonic() - t0:.0f}s]; total {report.states}")
        s += 1
    return report


def replay(path: str, recipe_text: str) -> Outcome:
    """Recover and check the one state ``recipe_text`` of the saved recording ``path``."""
    recorded = Run.load(path)
    recipe = Recipe.parse(recipe_text)
    state, events = crashstates.state_of(recorded.recording, recipe)
    workdir = tempfile.mkdtemp(prefix="logspool-relaycrash-replay-", dir=scratch_dir())
    try:
        return check_state(recorded, state, events, workdir, whole_relay=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

