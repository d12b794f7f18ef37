"""The spool is private: created 0700/0600 whatever the umask, refused at start when it is not (docs/security.md)."""

from __future__ import annotations

import logging
import os
import re
import smtplib
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from process_support import MTA, run_mta
from relay_support import DeliveryWatch, NextHop, relay_config, start_relay

from mta.process.security import UnsafeSpool, check_spool_dir
from spool.format.record import Status


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


async def test_spool_directories_are_0700_and_files_0600_even_with_umask_0(tmp_path: Path, open_umask: None) -> None:
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"*": "discard"}))
        watch = DeliveryWatch(relay)

        def send() -> None:
            with smtplib.SMTP("127.0.0.1", relay.ports[0], timeout=30) as s:
                s.sendmail("a@example.org", ["b@far.example"], "Subject: p\r\n\r\nprivate\r\n")

        await trio.to_thread.run_sync(send)
        await watch.wait_for(Status.DELIVERED, 1)
        await relay.aspool.checkpoint()
        modes = {}
        for root, dirs, files in os.walk(tmp_path / "spool"):
            for name in [".", *dirs, *files]:
                st = os.lstat(os.path.join(root, name))
                modes[os.path.relpath(os.path.join(root, name), tmp_path)] = (stat.S_IFMT(st.st_mode),
                                                                              stat.S_IMODE(st.st_mode))
        assert len(modes) > 3, modes  # the directory, the log, a segment, ...
        for name, (kind, mode) in modes.items():
            assert mode == (0o700 if kind == stat.S_IFDIR else 0o600), (name, oct(mode))
        nursery.cancel_scope.cancel()


def serve(tmp_path: Path, spool_dir: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "relay.toml").write_text(f'[server]\nlisten = ["127.0.0.1:0"]\n[spool]\ndir = "{spool_dir}"\n')
    return run_mta("serve", "--config", str(tmp_path / "relay.toml"), cwd=tmp_path)


def test_serve_refuses_a_group_writable_spool_in_one_line(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    spool.chmod(0o770)
    run = serve(tmp_path, str(spool))
    assert run.returncode != 0
    assert run.stderr.splitlines() == [f"mta: unsafe spool: {spool} is writable by group or others (mode 0770); "
                                       "refusing to start"]
    assert os.listdir(spool) == []  # refused before the spool was opened


def test_serve_refuses_a_spool_owned_by_someone_else(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        spool = str(tmp_path / "spool")
        os.mkdir(spool, 0o700)
        os.chown(spool, 65534, 65534)
    else:
        spool = "/"  # owned by root, and we are not root
    run = serve(tmp_path, spool)
    assert run.returncode != 0
    (line,) = run.stderr.splitlines()
    assert line.startswith("mta: unsafe spool:") and "is owned by uid" in line, line


def test_writable_entries_and_symlinks_inside_the_spool_are_refused(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    (spool / "log").mkdir(parents=True, mode=0o700)
    spool.chmod(0o700)
    segment = spool / "log" / "segment"
    segment.write_bytes(b"")
    segment.chmod(0o600)
    check_spool_dir(str(spool))
    segment.chmod(0o666)
    with pytest.raises(UnsafeSpool, match="writable by group or others"):
        check_spool_dir(str(spool))
    segment.chmod(0o600)
    (spool / "log" / "planted").symlink_to("/etc/passwd")
    with pytest.raises(UnsafeSpool, match="is a symlink"):
        check_spool_dir(str(spool))
    with pytest.raises(UnsafeSpool, match="owned by uid"):
        check_spool_dir(str(spool), owner=os.geteuid() + 1)


async def test_a_spool_others_can_read_is_made_private_at_start_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """0755/0644 (a restore without -p, a umask 022 copy): repaired to 0700/0600 and logged; the relay serves."""
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{await hop.start(nursery)}?tls=none"})
        async with trio.open_nursery() as first:
            relay = await start_relay(first, cfg)
            await trio.to_thread.run_sync(send, relay.ports[0], "before")
            await hop.wait_messages(1)
            await relay.aspool.checkpoint()
            first.cancel_scope.cancel()
        relay.aspool.core.close()  # the lock, as the process's end would release it
        spool = tmp_path / "spool"
        entries = [spool, *spool.rglob("*")]
        for entry in entries:
            entry.chmod(0o755 if entry.is_dir() else 0o644)
        assert len(entries) > 3
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mta.security"):
            relay = await start_relay(nursery, cfg)
        warnings = [r.getMessage() for r in caplog.records if r.name == "mta.security"]
        assert len(warnings) == 1, warnings
        assert re.fullmatch(rf"spool {re.escape(str(spool))}: group or others could read {len(entries)} entries "
                            rf"\(the first: {re.escape(str(spool))}, mode 0755\); made them private "
                            r"\(directories 0700, files 0600\)", warnings[0]), warnings[0]
        for entry in [spool, *spool.rglob("*")]:
            mode = stat.S_IMODE(entry.lstat().st_mode)
            assert mode == (0o700 if entry.is_dir() else 0o600), (entry, oct(mode))
        await trio.to_thread.run_sync(send, relay.ports[0], "after")
        assert b"after" in (await hop.wait_messages(2))[1].data
        nursery.cancel_scope.cancel()


def send(port: int, tag: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        assert s.noop()[0] == 250
        s.sendmail("a@example.org", ["b@far.example"], f"Subject: {tag}\r\n\r\n{tag}\r\n")


def test_a_refused_spool_is_left_as_it_was_found(tmp_path: Path) -> None:
    """Every entry is judged before any is repaired: a spool with one writable file keeps its readable ones."""
    spool = tmp_path / "spool"
    (spool / "log").mkdir(parents=True)
    spool.chmod(0o755)
    (spool / "log").chmod(0o755)
    (spool / "log" / "a").write_bytes(b"")
    (spool / "log" / "a").chmod(0o644)
    (spool / "log" / "z").write_bytes(b"")
    (spool / "log" / "z").chmod(0o666)
    with pytest.raises(UnsafeSpool, match="writable by group or others"):
        check_spool_dir(str(spool))
    assert [stat.S_IMODE(p.stat().st_mode) for p in (spool, spool / "log", spool / "log" / "a")] == [0o755] * 2 + [
        0o644]
    (spool / "log" / "z").chmod(0o640)
    repaired = check_spool_dir(str(spool))
    assert sorted(repaired) == sorted(str(p) for p in (spool, spool / "log", spool / "log" / "a", spool / "log" / "z"))
    assert check_spool_dir(str(spool)) == []


def test_serve_starts_on_a_readable_spool_and_makes_it_private(tmp_path: Path) -> None:
    """The process-level side: ``mta serve`` does not refuse a 0755 spool; it repairs it, says so, and listens."""
    spool = tmp_path / "spool"
    spool.mkdir()
    spool.chmod(0o755)
    (tmp_path / "relay.toml").write_text(f'[server]\nlisten = ["127.0.0.1:0"]\n[spool]\ndir = "{spool}"\n')
    proc = subprocess.Popen([MTA, "serve", "--config", str(tmp_path / "relay.toml")], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:  # ends at the listening line, or at EOF if the relay exits
            lines.append(line)
            if "listening on" in line:
                break
        assert any("listening on" in line for line in lines), lines
        assert sum("made them private" in line for line in lines) == 1, lines
        assert stat.S_IMODE(spool.stat().st_mode) == 0o700
        assert not any("Traceback" in line for line in lines), lines
    finally:
        proc.kill()
        proc.wait()
