"""``mta report``'s argument errors: one line, exit status 2, no traceback, and
no Spark session (they are found before the JVM starts, so these tests take
seconds; the whole command on Spark is tested in test_report.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
from click.testing import CliRunner, Result

from mta.cli import main
from mta.report.session import JAVA_MISSING
from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool


@pytest.fixture(name="spool_dir")
def spool_dir_fixture(tmp_path: Any) -> str:
    """A real spool with one message in its live log (segments to find)."""
    d = str(tmp_path / "mx1")
    sp = Spool.open(d, SpoolConfig())
    try:
        sp.enqueue("a@shop.example", ["b@ok.example"], b"hello")
        sp.commit()
    finally:
        sp.close()
    return d


def run(*args: str) -> Result:
    """Through the ``mta`` group, as an operator types it."""
    return CliRunner().invoke(main, ["report", *args], prog_name="mta")


def error_line(result: Result) -> str:
    """The line that says what is wrong, the whole output (click's usage errors too); no traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mta report: "), result.output
    return lines[0]


USAGE_HINT = " (see 'mta report --help')"


def test_help_lists_every_option() -> None:
    result = run("--help")
    assert result.exit_code == 0
    for option in ("--input", "--out", "--master", "--since", "--until", "--relay", "--conf"):
        assert option in result.output


def test_since_not_a_time(spool_dir: str, tmp_path: Any) -> None:
    result = run("--input", spool_dir, "--out", str(tmp_path / "o"), "--since", "notatime")
    assert result.exit_code == 2
    assert error_line(result) == ("mta report: Invalid value for '--since': not a time: 'notatime' "
                                  "(want 2024-05-01T12:00 or epoch seconds)" + USAGE_HINT)
    assert not os.path.exists(tmp_path / "o")


def test_until_not_a_date(spool_dir: str, tmp_path: Any) -> None:
    result = run("--input", spool_dir, "--out", str(tmp_path / "o"), "--until", "2024-13-01")
    assert result.exit_code == 2
    assert error_line(result).startswith("mta report: Invalid value for '--until': not a time: '2024-13-01'")


def test_since_after_until(spool_dir: str, tmp_path: Any) -> None:
    result = run("--input", spool_dir, "--out", str(tmp_path / "o"),
                 "--since", "2024-05-02", "--until", "2024-05-01T23:59")
    assert result.exit_code == 2
    assert error_line(result) == "mta report: --since must be before --until"


def test_missing_out(spool_dir: str) -> None:
    result = run("--input", spool_dir)
    assert result.exit_code == 2
    assert error_line(result) == "mta report: Missing option '--out'." + USAGE_HINT


def test_missing_input(tmp_path: Any) -> None:
    result = run("--out", str(tmp_path / "o"))
    assert result.exit_code == 2
    assert error_line(result) == "mta report: Missing option '--input'." + USAGE_HINT


def test_nonexistent_input_among_good_ones(spool_dir: str, tmp_path: Any) -> None:
    """A typo in one of several inputs stops the job rather than leaving that relay out."""
    missing = str(tmp_path / "mx2")
    result = run("--input", spool_dir, "--input", missing, "--out", str(tmp_path / "o"))
    assert result.exit_code == 2
    assert error_line(result) == f"mta report: --input {missing}: no such file or directory"


def test_glob_matching_nothing(tmp_path: Any) -> None:
    pattern = str(tmp_path / "relay-*")
    result = run("--input", pattern, "--out", str(tmp_path / "o"))
    assert result.exit_code == 2
    assert error_line(result) == f"mta report: --input {pattern}: no such file or directory"


def test_directory_without_segments(spool_dir: str, tmp_path: Any) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run("--input", spool_dir, "--input", str(empty), "--out", str(tmp_path / "o"))
    assert result.exit_code == 2
    assert error_line(result) == f"mta report: no segment files (*.seg) under: {empty}"


def test_out_is_a_file(spool_dir: str, tmp_path: Any) -> None:
    out = tmp_path / "report.txt"
    out.write_text("not a directory")
    result = run("--input", spool_dir, "--out", str(out))
    assert result.exit_code == 2
    assert error_line(result) == f"mta report: --out {out}: exists and is not a directory"
    assert out.read_text() == "not a directory"


def test_out_cannot_be_made(spool_dir: str, tmp_path: Any) -> None:
    """--out under a regular file (a permission test would pass as root)."""
    parent = tmp_path / "file"
    parent.write_text("")
    result = run("--input", spool_dir, "--out", str(parent / "o"))
    assert result.exit_code == 2
    assert error_line(result) == f"mta report: {parent / 'o'}: Not a directory"


def test_bad_local_master(spool_dir: str, tmp_path: Any) -> None:
    result = run("--input", spool_dir, "--out", str(tmp_path / "o"), "--master", "local[two]")
    assert result.exit_code == 2
    assert error_line(result) == ("mta report: Invalid value for '--master': 'local[two]' "
                                  "(want local, local[N], local[*] or a cluster URL)" + USAGE_HINT)


def test_no_java(spool_dir: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Good arguments on a machine without Java: the one line says how to get it,
    before Spark is imported and before --out is made."""
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    result = run("--input", spool_dir, "--out", str(tmp_path / "o"))
    assert result.exit_code == 2
    assert error_line(result) == f"mta report: {JAVA_MISSING}"
    assert "starting Spark" not in result.stderr and not os.path.exists(tmp_path / "o")


def test_without_the_spark_extra_the_relay_runs_and_the_report_says_what_to_install(spool_dir: str,
                                                                                    tmp_path: Any) -> None:
    """A relay installed without extras: ``mta`` works and ``mta report`` is one line naming the
    missing libraries (matplotlib draws the page's charts), before any JVM and before --out is made."""
    out = str(tmp_path / "o")
    code = ("import sys\n"
            "for m in ('pyspark', 'pyarrow', 'matplotlib'): sys.modules[m] = None\n"
            "from mta.cli import main\n"
            "main(['report', '--input', sys.argv[1], '--out', sys.argv[2]])\n")
    proc = subprocess.run([sys.executable, "-c", code, spool_dir, out], capture_output=True, text=True,
                          check=False, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == ("mta report: not installed: pyspark, pyarrow, matplotlib "
                                   "(pip install 'logspool[spark]')")
    assert not os.path.exists(out)
    relay = subprocess.run([sys.executable, "-c", code.replace("'report', '--input', sys.argv[1], '--out', "
                                                               "sys.argv[2]", "'--help'")],
                           capture_output=True, text=True, check=False, timeout=60)
    assert relay.returncode == 0 and "serve" in relay.stdout, relay.stderr


def test_conf_not_a_spark_setting(spool_dir: str, tmp_path: Any) -> None:
    result = run("--input", spool_dir, "--out", str(tmp_path / "o"), "--conf", "executor.memory")
    assert result.exit_code == 2
    assert error_line(result) == ("mta report: Invalid value for '--conf': 'executor.memory' "
                                  "(want spark.KEY=VALUE)" + USAGE_HINT)
    assert not os.path.exists(tmp_path / "o")


def test_two_relays_whose_spools_have_the_same_name_are_refused(spool_dir: str, tmp_path: Any) -> None:
    """Issue 25: ``a/spool`` and ``b/spool`` were one relay ``spool`` in the report, their queue ids merged."""
    spools = []
    for host in ("a", "b"):
        d = str(tmp_path / host / "spool")
        sp = Spool.open(d, SpoolConfig())
        try:
            sp.enqueue("a@shop.example", ["b@ok.example"], b"hello")
            sp.commit()
        finally:
            sp.close()
        spools.append(d)
    result = run("--input", spools[0], "--input", spools[1], "--input", spool_dir, "--out", str(tmp_path / "o"))
    assert result.exit_code == 2
    assert error_line(result) == (f"mta report: --input: {spools[0]} and {spools[1]} are two relays both named "
                                  "'spool' (the spool directory's name): their queue ids would be merged; report "
                                  "them separately or give the directories distinct names")
