"""``spoolctl marks``: the delivery workers' marks files as the operator sees them, while a worker writes one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool
from spool.format.marks import marks_dir
from spool.format.record import format_pos
from spool.tools.cli import main
from spool.write.marks import MarksWriter


def spool_with_marks(path: Path) -> tuple[int, int]:
    sp = Spool.open(str(path), SpoolConfig())
    sp.enqueue("a@src.example", ["b@x.example"], b"body")
    sp.commit()
    sp.close()
    with MarksWriter(marks_dir(str(path)), "w0-10") as closed:
        closed.add(1 << 32 | 100, ["b@x.example"])
        closed.add(1 << 32 | 200, ["c@x.example", "d@x.example"])
        closed.sync()
    return 1 << 32 | 100, 1 << 32 | 200


def test_each_file_with_its_marks_positions_and_whether_a_worker_writes_it(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    first, last = spool_with_marks(tmp_path)
    with MarksWriter(marks_dir(str(tmp_path)), "w0-11") as live:
        live.add(1 << 32 | 300, ["e@x.example"])
        live.sync()
        assert main(["marks", str(tmp_path), "--json"]) == 0
        rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["marks"]}
        assert main(["marks", str(tmp_path)]) == 0
        table = capsys.readouterr().out
    assert (rows["w0-10-1.marks"]["marks"], rows["w0-10-1.marks"]["first"], rows["w0-10-1.marks"]["last"],
            rows["w0-10-1.marks"]["writing"]) == (2, format_pos(first), format_pos(last), False)
    assert (rows["w0-11-1.marks"]["marks"], rows["w0-11-1.marks"]["writing"]) == (1, True)
    assert "w0-11-1.marks" in table and "writing" in table and "closed" in table


def test_a_damaged_file_is_named_and_the_exit_code_says_so(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    spool_with_marks(tmp_path)
    path = Path(marks_dir(str(tmp_path))) / "w0-10-1.marks"
    data = bytearray(path.read_bytes())
    data[16 + 9] ^= 0xFF  # inside the first record, with the second after it
    path.write_bytes(bytes(data))
    assert main(["marks", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "record at offset 16" in captured.out
    assert "quarantines it" in captured.err and "Traceback" not in captured.err
    assert main(["verify", str(tmp_path)]) == 1  # the log is whole; the marks file is not
    out = capsys.readouterr().out
    assert "marks file w0-10-1.marks: record at offset 16" in out and "clean" not in out.splitlines()


def test_not_a_spool_is_one_line_and_exit_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["marks", str(tmp_path / "nothing")]) == 3
    err = capsys.readouterr().err
    assert err.startswith("spoolctl: error: ") and err.count("\n") == 1
