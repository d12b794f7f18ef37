"""``mta events`` as an operator runs it: the events of a spool, where to begin, and one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

from process_support import run_mta
from relay_support import write_relay_config

from spool import Spool, SpoolConfig, format_id


def spool_with_mail(tmp_path: Path) -> tuple[Path, list[int]]:
    config = write_relay_config(tmp_path, {})
    sp = Spool.create(str(tmp_path / "spool"), SpoolConfig())
    try:
        ids = [sp.enqueue("a@src.example", [f"r{i}@dst.example"], b"Subject: x\r\n\r\nbody\r\n") for i in range(3)]
        sp.commit()
    finally:
        sp.close()
    return config, ids


def test_the_events_of_a_spool_from_the_start_from_a_position_and_from_a_time(tmp_path: Path) -> None:
    config, ids = spool_with_mail(tmp_path)
    out = run_mta("events", "--json", "--config", str(config), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(e["kind"], e["queue_id"]) for e in events] == [("received", format_id(i)) for i in ids]
    second = events[1]["id"]
    out = run_mta("events", "--from", second, "--config", str(config), cwd=tmp_path)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and [line.split()[0] for line in lines] == [e["id"] for e in events[1:]]
    assert lines[0].split()[1:3] == ["received", format_id(ids[1])]
    out = run_mta("events", "--from", "2000-01-01", "--config", str(config), cwd=tmp_path)
    assert len(out.stdout.splitlines()) == 3
    out = run_mta("events", "--from", "2999-01-01T00:00:00Z", "--config", str(config), cwd=tmp_path)
    assert out.returncode == 0 and out.stdout == ""


def test_what_cannot_be_read_is_one_line_and_a_status(tmp_path: Path) -> None:
    config, _ = spool_with_mail(tmp_path)
    cases = [
        (("--from", "yesterday"), 2, "not a position (1:70) nor a time"),
        (("--from", "1:7"), 2, "no record starts at position 1:7"),
        (("--shard", "3"), 2, "no shard 3: the relay has 1"),
    ]
    for args, status, text in cases:
        out = run_mta("events", *args, "--config", str(config), cwd=tmp_path)
        assert out.returncode == status and out.stderr.startswith("mta: ") and text in out.stderr, out.stderr
        assert len(out.stderr.splitlines()) == 1
    out = run_mta("events", "--from", "1:7", "--json", "--config", str(config), cwd=tmp_path)
    assert json.loads(out.stdout) == {"code": "bad_request", "error": "no record starts at position 1:7"}
    (tmp_path / "none").mkdir()
    elsewhere = write_relay_config(tmp_path / "none", {})
    out = run_mta("events", "--config", str(elsewhere), cwd=tmp_path / "none")
    assert out.returncode == 1 and "no log there" in out.stderr and len(out.stderr.splitlines()) == 1
