"""mta.delivery.maildir: durable, streaming, traversal-proof local delivery.

Its file operations go through a FileIO: the durability tests record them
(``RecordingFileIO``, the power-cut harness's recorder) and check their order
and every crash state a power cut may leave after ``deliver`` returned.
"""

from __future__ import annotations

import os
import smtplib
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from relay_support import DeliveryWatch, relay_config

from fault_injection import crashstates
from fault_injection.recording import ROOT_INO, Event, Link, Op, RecordingFileIO, Rename, Sync, SyncDir, Write
from mta.delivery.maildir import InvalidMailbox, MaildirDelivery, MaildirWriter, mailbox_name
from mta.process.relay import Relay
from spool.fileio import OsFileIO
from spool.format.record import Status

MESSAGE = b"From: a@example.org\r\nSubject: hi\r\n\r\nbody line\r\n"


@pytest.fixture
def md() -> MaildirWriter:
    """A writer on the real files, as the relay's maildir transport holds one per process."""
    return MaildirWriter()


def test_delivers_into_new_with_added_headers(md: MaildirWriter, tmp_path: Path) -> None:
    result = md.deliver(str(tmp_path), "Bob@Example.ORG", "a@example.org", [MESSAGE], hostname="relay")
    assert isinstance(result, MaildirDelivery)
    path = Path(result.path)
    assert path.parent == tmp_path / "bob" / "new"
    data = path.read_bytes()
    assert data == b"Return-Path: <a@example.org>\r\nDelivered-To: Bob@Example.ORG\r\n" + MESSAGE
    assert result.size == len(data)
    assert path.name.endswith(f",S={len(data)}")
    assert os.listdir(tmp_path / "bob" / "tmp") == []
    assert os.listdir(tmp_path / "bob" / "cur") == []


def test_creates_maildir_private(md: MaildirWriter, tmp_path: Path) -> None:
    md.deliver(str(tmp_path / "md"), "u@h", "s@h", [MESSAGE])
    for sub in ("", "cur", "new", "tmp"):
        mode = stat.S_IMODE(os.stat(tmp_path / "md" / "u" / sub).st_mode)
        assert mode & 0o077 == 0, (sub, oct(mode))
    (file,) = (tmp_path / "md" / "u" / "new").iterdir()
    assert stat.S_IMODE(file.stat().st_mode) == 0o600


def test_unique_names_follow_maildir_convention(md: MaildirWriter, tmp_path: Path) -> None:
    names = {Path(md.deliver(str(tmp_path), "u@h", "s@h", [MESSAGE], hostname="a/b:c").path).name for _ in range(20)}
    assert len(names) == 20
    for name in names:
        secs, middle, rest = name.split(".", 2)
        assert secs.isdigit()
        assert middle.startswith("M") and f"P{os.getpid()}Q" in middle
        assert rest.startswith("a\\057b\\072c,S=")  # "/" and ":" escaped, as the spec asks


def test_null_sender_and_header_injection(md: MaildirWriter, tmp_path: Path) -> None:
    result = md.deliver(str(tmp_path), "u@h", "", [MESSAGE])
    assert Path(result.path).read_bytes().startswith(b"Return-Path: <>\r\nDelivered-To: u@h\r\n")
    evil = md.deliver(str(tmp_path), "u@h", "x@y>\r\nBcc: victim@z", [MESSAGE])
    head = Path(evil.path).read_bytes().split(b"\r\n")
    assert head[0] == b"Return-Path: <x@y>  Bcc: victim@z>"
    assert head[1] == b"Delivered-To: u@h"


def test_lf_message_gets_lf_headers(md: MaildirWriter, tmp_path: Path) -> None:
    body = b"Subject: unix\n\nhello\n"
    result = md.deliver(str(tmp_path), "u@h", "s@h", [b"Subj", b"ect: unix", b"\n\nhello\n"])
    assert Path(result.path).read_bytes() == b"Return-Path: <s@h>\nDelivered-To: u@h\n" + body


def test_streams_chunks_without_joining(md: MaildirWriter, tmp_path: Path) -> None:
    """The body is written while the iterator is still producing: nothing waits for the end."""
    seen_in_tmp: list[int] = []
    chunk = b"x" * 65536 + b"\r\n"

    def chunks() -> Iterator[bytes]:
        yield b"Subject: big\r\n\r\n"
        for _ in range(40):
            yield chunk
            (tmp_file,) = (tmp_path / "u" / "tmp").iterdir()
            seen_in_tmp.append(tmp_file.stat().st_size)

    result = md.deliver(str(tmp_path), "u@h", "s@h", chunks())
    assert result.size == len(b"Return-Path: <s@h>\r\nDelivered-To: u@h\r\nSubject: big\r\n\r\n") + 40 * len(chunk)
    assert Path(result.path).stat().st_size == result.size
    # Each earlier chunk was already on disk when the next one was asked for.
    assert seen_in_tmp[-1] >= 39 * len(chunk)
    assert seen_in_tmp == sorted(seen_in_tmp)


class Boom(Exception):
    pass


def test_failure_midway_leaves_nothing_behind(md: MaildirWriter, tmp_path: Path) -> None:
    def chunks() -> Iterator[bytes]:
        yield MESSAGE
        raise Boom

    with pytest.raises(Boom):
        md.deliver(str(tmp_path), "u@h", "s@h", chunks())
    assert os.listdir(tmp_path / "u" / "tmp") == []
    assert os.listdir(tmp_path / "u" / "new") == []


@pytest.mark.parametrize(
    "recipient",
    [
        "../etc@h",
        "..@h",
        ".@h",
        "@h",
        "a/b@h",
        "a\\b@h",
        "a\x00b@h",
        ".hidden@h",
        "a\nb@h",
        '"../x"@h',
        "x" * 300 + "@h",
    ],
)
def test_unsafe_local_parts_are_refused(md: MaildirWriter, tmp_path: Path, recipient: str) -> None:
    with pytest.raises(InvalidMailbox) as info:
        md.deliver(str(tmp_path / "md"), recipient, "s@h", [MESSAGE])
    assert (info.value.code, info.value.status) == (550, "5.1.1")
    assert isinstance(info.value, ValueError)
    assert not (tmp_path / "md").exists()  # refused before touching the disk


def test_mailbox_names() -> None:
    assert mailbox_name("Bob@example.org") == "bob"
    assert mailbox_name("bob+tag@h") == "bob+tag"
    assert mailbox_name('"john doe"@h') == "john doe"
    assert mailbox_name("a@b@h") == "a@b"
    assert mailbox_name("Ünïcode@h") == "ünïcode"
    assert mailbox_name("postmaster") == "postmaster"


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_mailbox_name_never_escapes_the_root(local: str) -> None:
    try:
        name = mailbox_name(local + "@h")
    except InvalidMailbox:
        return
    root = "/srv/maildir"
    joined = os.path.normpath(os.path.join(root, name))
    assert os.path.dirname(joined) == root
    assert name not in ("", ".", "..") and "/" not in name and "\0" not in name


def test_relative_root_is_made(md: MaildirWriter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = md.deliver("md", "u@h", "s@h", [MESSAGE])
    assert result.path == str(tmp_path / "md" / "u" / "new" / Path(result.path).name)


# -- durability, on the recorded file operations -------------------------------------------------------------


def recorded(tmp_path: Path) -> tuple[MaildirWriter, RecordingFileIO]:
    """A writer whose every file operation is recorded; Maildir roots must lie under ``tmp_path``."""
    rio = RecordingFileIO(str(tmp_path))
    return MaildirWriter(rio), rio


def synced_dirs_after(ops: list[Op], start: int) -> set[int]:
    return {op.ino for op in ops[start:] if isinstance(op, SyncDir)}


def test_every_directory_made_is_fsynced_into_its_parent_before_deliver_returns(tmp_path: Path) -> None:
    """A new mailbox's name must be durable before its delivery record can be."""
    md, rio = recorded(tmp_path)
    md.deliver(str(tmp_path / "var" / "maildir"), "u@h", "s@h", [MESSAGE])
    ops = rio.rec.ops
    made = [(i, op) for i, op in enumerate(ops) if isinstance(op, Link) and op.is_dir]
    assert [op.name for _, op in made] == ["var", "maildir", "u", "cur", "new", "tmp"]
    for i, op in made:
        assert op.parent in synced_dirs_after(ops, i + 1), f"{op.name} was never fsynced into its parent"


def test_the_file_is_synced_then_renamed_into_new_then_new_is_synced(tmp_path: Path) -> None:
    md, rio = recorded(tmp_path)
    root = str(tmp_path / "md")
    md.deliver(root, "u@h", "s@h", [MESSAGE])  # the first delivery also makes the directories
    first = len(rio.rec.ops)
    result = md.deliver(root, "u@h", "s@h", [MESSAGE])
    ops = rio.rec.ops[first:]
    new_ino = rio.entries[rio.entries[rio.entries[ROOT_INO]["md"]]["u"]]["new"]
    created, *writes, synced, renamed, new_synced = ops
    assert isinstance(created, Link) and not created.is_dir
    assert writes and all(isinstance(w, Write) and w.ino == created.ino for w in writes)
    assert b"".join(w.data for w in writes if isinstance(w, Write)) == Path(result.path).read_bytes()
    assert synced == Sync(created.ino)
    assert isinstance(renamed, Rename) and renamed.ino == created.ino and renamed.dst_parent == new_ino
    assert renamed.dst_name == Path(result.path).name
    assert new_synced == SyncDir(new_ino)  # ... and nothing more: the directories are durable already


def test_a_delivered_message_is_in_every_state_a_power_cut_can_leave(tmp_path: Path) -> None:
    """Every crash state after ``deliver`` returned (unsynced data dropped or torn, unsynced names lost)."""
    md, rio = recorded(tmp_path)
    result = md.deliver(str(tmp_path / "var" / "maildir"), "u@h", "s@h", [MESSAGE, b"x" * 5000])
    rio.event("delivered")
    rel = os.path.relpath(result.path, tmp_path)
    cands = crashstates.enumerate_states(rio.rec, per_point=64, only_point=len(rio.rec.ops))
    states = [state for _, state, _ in crashstates.materialise(rio.rec, [c.recipe for c in cands])]
    assert states
    for state in states:
        assert state.files.get(rel) == Path(result.path).read_bytes(), sorted(state.files)


def test_a_maildir_found_on_disk_is_made_durable_once_per_writer(tmp_path: Path) -> None:
    """Directories that exist may have been made by a life that crashed before their fsync."""
    os.makedirs(tmp_path / "md" / "u" / "new")
    os.makedirs(tmp_path / "md" / "u" / "tmp")
    md, rio = recorded(tmp_path)
    md.deliver(str(tmp_path / "md"), "u@h", "s@h", [MESSAGE])
    entries = rio.entries
    root_ino = entries[ROOT_INO]["md"]
    dirs = {op.ino for op in rio.rec.ops if isinstance(op, SyncDir)}
    assert {ROOT_INO, root_ino, entries[root_ino]["u"]} <= dirs  # PATH's parent, PATH, the Maildir
    first = len(rio.rec.ops)
    md.deliver(str(tmp_path / "md"), "u@h", "s@h", [MESSAGE])
    assert synced_dirs_after(rio.rec.ops, first) == {entries[entries[root_ino]["u"]]["new"]}
    again = MaildirWriter(rio)  # a new process
    first = len(rio.rec.ops)
    again.deliver(str(tmp_path / "md"), "u@h", "s@h", [MESSAGE])
    assert {ROOT_INO, root_ino, entries[root_ino]["u"]} <= synced_dirs_after(rio.rec.ops, first)


class NoRoom(OsFileIO):
    def write(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        raise OSError(28, "No space left on device")


def test_disk_error_propagates_as_oserror_and_cleans_tmp(md: MaildirWriter, tmp_path: Path) -> None:
    md.deliver(str(tmp_path), "u@h", "s@h", [MESSAGE])
    with pytest.raises(OSError, match="No space"):
        MaildirWriter(NoRoom()).deliver(str(tmp_path), "u@h", "s@h", [MESSAGE])
    assert os.listdir(tmp_path / "u" / "tmp") == []
    assert len(os.listdir(tmp_path / "u" / "new")) == 1


def _smtp_to_localhost(port: int) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.sendmail("a@example.org", ["u@localhost"], "Subject: local\r\n\r\nrecorded\r\n")


async def test_the_running_relay_records_local_delivery_with_its_spool(tmp_path: Path) -> None:
    """What the power-cut harness needs from the real relay: one recording holds the spool's file operations
    and the Maildir's, in the order they took effect; the message is durable in new/ before the delivery
    is reported (the observers hear of it once its DELIVERY record is durable)."""
    (tmp_path / "spool").mkdir(mode=0o700)
    rio = RecordingFileIO(str(tmp_path))
    cfg = relay_config(str(tmp_path), {"localhost": "maildir:maildir"})
    async with trio.open_nursery() as nursery:
        relay: Relay = await nursery.start(Relay(cfg, io=rio).run)
        watch = DeliveryWatch(relay)
        relay.scheduler.observers.append(lambda qid, outcome: rio.event("reported", qid))
        await trio.to_thread.run_sync(_smtp_to_localhost, relay.ports[0])
        await watch.wait_for(Status.DELIVERED, 1)
        nursery.cancel_scope.cancel()
    ops = rio.rec.ops
    (name,) = os.listdir(tmp_path / "maildir" / "u" / "new")
    assert b"recorded" in (tmp_path / "maildir" / "u" / "new" / name).read_bytes()
    entries = rio.entries
    new_ino = entries[entries[entries[ROOT_INO]["maildir"]]["u"]]["new"]
    renamed = next(i for i, op in enumerate(ops) if isinstance(op, Rename) and op.dst_name == name)
    synced = next(i for i, op in enumerate(ops) if i > renamed and op == SyncDir(new_ino))
    reported = next(i for i, op in enumerate(ops) if isinstance(op, Event) and op.kind == "reported")
    assert renamed < synced < reported
    log_ino = entries[entries[ROOT_INO]["spool"]]["log"]
    assert any(isinstance(op, Link) and op.parent == log_ino for op in ops[:renamed]), "the spool's segment"
