"""Power cuts under the running relay: the crash-state kinds, and a bounded harness run.

The harness (``fault_injection.relaycrash``) records the real relay accepting
over SMTP, delivering into Maildirs and to a next hop, rotating 16 KiB
segments, checkpointing and deleting segments; then it recovers a few hundred
crash states and checks that nothing answered 250 was lost. The last test
shows that it would see a Maildir whose new directories are not fsynced into
their parents.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest

from fault_injection import crashstates, relaycrash, scratch_dir
from fault_injection.crashstates import Recipe, Walker
from fault_injection.recording import Event, Link, Recording, Rename, Snapshot, Sync, SyncDir, Write
from fault_injection.relayload import record
from mta.delivery.maildir import MaildirWriter

STATES = 300  # make test's share; make crashtest runs 20,000


def _at_end(rec: Recording) -> Walker:
    walker = Walker(rec)
    for _ in walker.points():
        pass
    return walker


def test_page_order_states_keep_any_subset_of_the_dirty_pages() -> None:
    rec = Recording()
    rec.ops += [Link(0, "f", 1, False), SyncDir(0), Write(1, 0, b"a" * 4096), Sync(1),
                Write(1, 4096, b"b" * 4096), Write(1, 8192, b"c" * 100), Write(1, 0, b"d" * 10)]
    walker = _at_end(rec)
    assert walker.dirty_pages(1) == [0, 1, 2]
    # the third page reached the disk, the second did not: a hole of zeros, at the issued size
    assert walker.paged(1, 0b100, 1) == b"a" * 4096 + bytes(4096) + b"c" * 100
    # the first page (rewritten) reached the disk, the size stayed the durable one
    assert walker.paged(1, 0b001, 0) == b"d" * 10 + b"a" * 4086
    state = walker.state(Recipe(walker.point, (), (), ((1, 0b011, 1),)))
    assert state.files["f"] == b"d" * 10 + b"a" * 4086 + b"b" * 4096 + bytes(100)


def test_recipe_with_pages_round_trips() -> None:
    r = Recipe(40, ((3, 1, 512),), ((0, 2),), ((7, 0b1011, 1), (9, 0, 0)))
    assert Recipe.parse(r.text()) == r


def test_names_state_drops_unsynced_entries_and_keeps_the_data() -> None:
    rec = Recording()
    rec.ops += [Link(0, "old", 1, False), SyncDir(0), Link(0, "new", 2, False), Write(2, 0, b"x" * 600), Sync(2),
                Event("ack", ())]
    walker = _at_end(rec)
    kinds = {kind: relaycrash.draw(walker, kind, random.Random(1)) for kind in relaycrash.KINDS}
    names = kinds["names"]
    assert names is not None and walker.state(names).files == {"old": b""}  # fsynced data, but no name for it
    synced = kinds["synced"]
    assert synced is not None and sorted(walker.state(synced).files) == ["old"]
    torn = kinds["torn"]
    assert torn is None  # the only write was synced: nothing to tear


def test_a_durable_rename_settles_the_unsynced_create_of_its_source_name() -> None:
    """Maildir's order: create tmp/f (tmp/ never fsynced), fsync f, rename to new/f, fsync new/: f has one name."""
    rec = Recording()
    rec.ops += [Link(0, "tmp", 1, True), Link(0, "new", 2, True), SyncDir(0), Link(1, "f", 3, False),
                Write(3, 0, b"mail"), Sync(3), Rename(1, "f", 2, "f", 3), SyncDir(2)]
    rec.dir_inos.update({1, 2})  # the recorder notes directories as it links them
    walker = _at_end(rec)
    _files, dirs = walker.choices()
    assert dirs == []  # the create in tmp/ is settled by the durable rename
    assert walker.state(Recipe(walker.point, (), ())).files == {"new/f": b"mail"}


def test_relay_crash_states_lose_nothing() -> None:
    report = relaycrash.run(STATES, seed=0, relay_every=25)
    assert report.failures == []
    assert report.states == STATES
    assert report.lost == 0 and report.refusals == 0
    assert all(report.by_kind[k] > 0 for k in relaycrash.KINDS), report.by_kind
    assert report.relay_starts >= STATES // 25
    assert report.segments_deleted > 0
    assert report.checked > STATES  # each state checks every acknowledged recipient before its crash point
    # A recipient held though never sent is held only inside its point of no return's window (a held one before
    # it is a failure of its state): in its record's commit, or with its dot on its way.
    assert report.held_unmarked == 0
    assert report.held_unsent == report.held_in_commit + report.held_on_way


def test_harness_sees_a_maildir_without_the_parent_directory_fsync(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """Decided by this test: without fsyncing a new mailbox into its parent, mail is lost."""

    def ensure_without_parent_fsync(self: MaildirWriter, maildir: str) -> None:
        for path in (os.path.dirname(maildir), maildir, *(os.path.join(maildir, s) for s in ("cur", "new", "tmp"))):
            if not self.io.exists(path):
                self.io.makedirs(path)
        self.io.fsync_dir(maildir)  # cur/ new/ tmp/ are durable; the Maildir's own name is not

    monkeypatch.setattr(MaildirWriter, "_ensure_maildir", ensure_without_parent_fsync)
    report = relaycrash.run(150, seed=0, relay_every=1000, save_dir=str(tmp_path))
    assert report.lost > 0
    assert any("@local.test" in f or "@senders.test" in f for f in report.failures)
    # A failure names its saved recording and recipe; replaying them finds the same loss again.
    (saved,) = tmp_path.glob("relaycrash-seed0-*.pickle")
    first = report.failures[0]
    assert f"--recording {saved} --replay '" in first
    recipe = first.split("--replay '", 1)[1].split("'", 1)[0]
    assert any(v.startswith("LOST") for v in relaycrash.replay(str(saved), recipe).violations)


def test_the_recording_sees_every_file_operation_of_the_relay() -> None:
    """Every op issued, replayed from the recording, gives the tree the relay left on disk: nothing bypassed it.

    Maildir delivery included (its files, renames, the directories it made); the
    spool's lock and control socket are not data and are left out.
    """
    workdir = tempfile.mkdtemp(prefix="logspool-test-relayrec-", dir=scratch_dir())
    try:
        root = os.path.join(workdir, "run")
        run = record(root, seed=5, messages=16, min_deleted=0)
        walker = _at_end(run.recording)
        files, dirs = walker.choices()
        issued = Recipe(walker.point, tuple(max((o for o in g if o[2] < 0), key=lambda o: o[1]) for g in files),
                        tuple(g[-1] for g in dirs))
        state = walker.state(issued)
        os.unlink(os.path.join(root, "spool", "control.sock"))  # a socket: bound, not written
        on_disk = Snapshot.capture(root)
        assert sorted(state.dirs) == sorted(on_disk.dirs)
        assert state.files == on_disk.files
        mail = [p for p in state.files if p.startswith("mail/") and "/new/" in p]
        assert len(mail) >= 5  # local deliveries and DSNs landed, and were recorded
        assert any(isinstance(op, SyncDir) and op.ino != 0 for op in run.recording.ops)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_failed_state_replays_from_its_saved_recording(tmp_path: Path) -> None:
    run = record(str(tmp_path / "run"), seed=3, messages=12, min_deleted=0)
    path = str(tmp_path / "run.pickle")
    run.save(path)
    last = len(run.recording.ops)
    res = relaycrash.replay(path, Recipe(last, (), ()).text())
    assert res.violations == [] and res.relay_started
    assert res.checked == sum(len(ev.data[2]) for ev in run.recording.events() if ev.kind == "ack")
    assert crashstates.state_of(run.recording, Recipe(last, (), ()))[1] == len(run.recording.events())
