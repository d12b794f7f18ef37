"""mta.maildir: durable, streaming, traversal-proof local delivery."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mta.delivery.maildir import InvalidMailbox, MaildirDelivery, deliver, mailbox_name

MESSAGE = b"From: a@example.org\r\nSubject: hi\r\n\r\nbody line\r\n"


def test_delivers_into_new_with_added_headers(tmp_path: Path) -> None:
    result = deliver(str(tmp_path), "Bob@Example.ORG", "a@example.org", [MESSAGE], hostname="relay")
    assert isinstance(result, MaildirDelivery)
    path = Path(result.path)
    assert path.parent == tmp_path / "bob" / "new"
    data = path.read_bytes()
    assert data == b"Return-Path: <a@example.org>\r\nDelivered-To: Bob@Example.ORG\r\n" + MESSAGE
    assert result.size == len(data)
    assert path.name.endswith(f",S={len(data)}")
    assert os.listdir(tmp_path / "bob" / "tmp") == []
    assert os.listdir(tmp_path / "bob" / "cur") == []


def test_creates_maildir_private(tmp_path: Path) -> None:
    deliver(str(tmp_path / "md"), "u@h", "s@h", [MESSAGE])
    for sub in ("", "cur", "new", "tmp"):
        mode = stat.S_IMODE(os.stat(tmp_path / "md" / "u" / sub).st_mode)
        assert mode & 0o077 == 0, (sub, oct(mode))
    (file,) = (tmp_path / "md" / "u" / "new").iterdir()
    assert stat.S_IMODE(file.stat().st_mode) == 0o600


def test_unique_names_follow_maildir_convention(tmp_path: Path) -> None:
    names = {Path(deliver(str(tmp_path), "u@h", "s@h", [MESSAGE], hostname="a/b:c").path).name for _ in range(20)}
    assert len(names) == 20
    for name in names:
        secs, middle, rest = name.split(".", 2)
        assert secs.isdigit()
        assert middle.startswith("M") and f"P{os.getpid()}Q" in middle
        assert rest.startswith("a\\057b\\072c,S=")  # "/" and ":" escaped, as the spec asks


def test_null_sender_and_header_injection(tmp_path: Path) -> None:
    result = deliver(str(tmp_path), "u@h", "", [MESSAGE])
    assert Path(result.path).read_bytes().startswith(b"Return-Path: <>\r\nDelivered-To: u@h\r\n")
    evil = deliver(str(tmp_path), "u@h", "x@y>\r\nBcc: victim@z", [MESSAGE])
    head = Path(evil.path).read_bytes().split(b"\r\n")
    assert head[0] == b"Return-Path: <x@y>  Bcc: victim@z>"
    assert head[1] == b"Delivered-To: u@h"


def test_lf_message_gets_lf_headers(tmp_path: Path) -> None:
    body = b"Subject: unix\n\nhello\n"
    result = deliver(str(tmp_path), "u@h", "s@h", [b"Subj", b"ect: unix", b"\n\nhello\n"])
    assert Path(result.path).read_bytes() == b"Return-Path: <s@h>\nDelivered-To: u@h\n" + body


def test_streams_chunks_without_joining(tmp_path: Path) -> None:
    """The body is written while the iterator is still producing: nothing waits for the end."""
    seen_in_tmp: list[int] = []
    chunk = b"x" * 65536 + b"\r\n"

    def chunks() -> Iterator[bytes]:
        yield b"Subject: big\r\n\r\n"
        for _ in range(40):
            yield chunk
            (tmp_file,) = (tmp_path / "u" / "tmp").iterdir()
            seen_in_tmp.append(tmp_file.stat().st_size)

    result = deliver(str(tmp_path), "u@h", "s@h", chunks())
    assert result.size == len(b"Return-Path: <s@h>\r\nDelivered-To: u@h\r\nSubject: big\r\n\r\n") + 40 * len(chunk)
    assert Path(result.path).stat().st_size == result.size
    # Each earlier chunk was already on disk when the next one was asked for.
    assert seen_in_tmp[-1] >= 39 * len(chunk)
    assert seen_in_tmp == sorted(seen_in_tmp)


def test_fsync_file_then_rename_then_fsync_new(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src: str, dst: str) -> None:
        events.append(("rename", dst))
        real_rename(src, dst)

    deliver(str(tmp_path), "u@h", "s@h", [MESSAGE])  # first delivery also makes directories
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    result = deliver(str(tmp_path), "u@h", "s@h", [MESSAGE])
    tmp_name = Path(result.path).name.rsplit(",S=", 1)[0]
    assert events == [
        ("fsync", str(tmp_path / "u" / "tmp" / tmp_name)),
        ("rename", result.path),
        ("fsync", str(tmp_path / "u" / "new")),
    ]


def test_new_directories_are_fsynced_into_their_parents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    deliver(str(tmp_path / "root"), "u@h", "s@h", [MESSAGE])
    for parent in (tmp_path, tmp_path / "root", tmp_path / "root" / "u"):
        assert str(parent) in synced


class Boom(Exception):
    pass


def test_failure_midway_leaves_nothing_behind(tmp_path: Path) -> None:
    def chunks() -> Iterator[bytes]:
        yield MESSAGE
        raise Boom

    with pytest.raises(Boom):
        deliver(str(tmp_path), "u@h", "s@h", chunks())
    assert os.listdir(tmp_path / "u" / "tmp") == []
    assert os.listdir(tmp_path / "u" / "new") == []


def test_disk_error_propagates_as_oserror_and_cleans_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: object) -> int:
        raise OSError(28, "No space left on device")

    deliver(str(tmp_path), "u@h", "s@h", [MESSAGE])
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match="No space"):
        deliver(str(tmp_path), "u@h", "s@h", [MESSAGE])
    assert os.listdir(tmp_path / "u" / "tmp") == []
    assert len(os.listdir(tmp_path / "u" / "new")) == 1


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
def test_unsafe_local_parts_are_refused(tmp_path: Path, recipient: str) -> None:
    with pytest.raises(InvalidMailbox) as info:
        deliver(str(tmp_path / "md"), recipient, "s@h", [MESSAGE])
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


def test_relative_root_is_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = deliver("md", "u@h", "s@h", [MESSAGE])
    assert result.path == str(tmp_path / "md" / "u" / "new" / Path(result.path).name)
