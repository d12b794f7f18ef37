"""The report job: every figure against a plain Python computation over the same records."""

from __future__ import annotations

import glob
import os
import shutil
from typing import Any

import attrs
import pytest
import report_reference as ref
from click.testing import CliRunner
from spark_fixture import T0

from mta.report.cli import report
from mta.report.errors import ReportError
from mta.report.figures import Figures
from mta.report.session import JAVA_MISSING, make_session
from mta.report.text import render_text
from spool.export.rows import segment_rows
from spool.format.record import pos_offset

# The first test here pays for the session-scoped SparkSession and the report job
# (327 s of set-up on the 2-core machine at load 5, 2026-11-22): more than the
# suite's 600 s default allows on a busier machine.
pytestmark = pytest.mark.timeout(1800)

FIELDS = [f.name for f in attrs.fields(Figures) if f.name != "errors"]


def normal(value: Any) -> Any:
    """Round floats so that Spark's and Python's summation orders compare equal."""
    if isinstance(value, float):
        return round(value, 6)
    if attrs.has(type(value)):
        return normal(attrs.astuple(value, recurse=False))
    if isinstance(value, dict):
        return {k: normal(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return tuple(normal(v) for v in value)
    return value


@pytest.mark.parametrize("field", FIELDS)
def test_figure_matches_plain_python(whole: tuple[Figures, Figures, str], field: str) -> None:
    got, want, _out = whole
    assert normal(getattr(got, field)) == normal(getattr(want, field))


def test_the_fleet_exercises_every_figure(whole: tuple[Figures, Figures, str]) -> None:
    """Guard against a fixture so tame that the comparisons above prove little."""
    _got, want, _out = whole
    t = want.totals
    assert t["delivered"] and t["deferred"] and t["bounced"] and t["expired"] and t["queued"] and t["held"]
    assert {"delivered", "bounced", "expired", "queued", "held"} <= set(want.states)
    assert len(want.retries) >= 3 and len(want.per_hour) >= 3 and want.queue_shape
    assert len(want.top_deferrals) >= 3 and want.top_bounces and want.errors == ()


def test_tables_and_reports_are_written(spark: Any, whole: tuple[Figures, Figures, str]) -> None:
    _got, want, out = whole
    for table in ("messages", "attempts", "queue"):
        assert os.path.exists(os.path.join(out, table, "_SUCCESS"))
    messages = spark.read.parquet(os.path.join(out, "messages"))
    assert messages.count() == want.totals["received"]
    assert set(messages.columns) >= {"relay", "message_id", "sender", "rcpt_count", "size", "arrival_ms", "state",
                                     "final_ms"}
    attempts = spark.read.parquet(os.path.join(out, "attempts"))
    assert set(attempts.columns) >= {"time_ms", "next_hop", "status", "code", "enhanced", "reply", "duration_ms"}
    with open(os.path.join(out, "report.txt"), encoding="utf-8") as f:
        text = f.read()
    assert f"{want.totals['delivered']:>8}  delivered" in text and "greylisted" in text
    with open(os.path.join(out, "report.html"), encoding="utf-8") as f:
        page = f.read()
    assert page.count("<svg") == 3 and "Deferrals by domain" in page and "down.example" in page


def test_cli_with_since_until_and_a_torn_segment(spark: Any, fleet: dict[str, str], tmp_path: Any) -> None:
    """The whole command on a copy of mx1 whose live log ends in a torn write:
    the damage is reported with file and offset, the rest is read, and the
    report it prints and writes is the plain computation's, rendered."""
    spool = str(tmp_path / "mx1")
    shutil.copytree(fleet["mx1"], spool)
    last = max(glob.glob(os.path.join(spool, "log", "*.seg")))
    tail = pos_offset(list(segment_rows(last))[-1]["pos"])
    os.truncate(last, tail + 7)  # a write interrupted inside the last frame's header
    with open(last, "rb") as f:
        f.seek(tail)
        # zeros at the very end read as the log's zeroed room (format version 3): the torn bytes stop before them
        n = len(f.read().rstrip(b"\0"))
    since, until = T0 + 1800, T0 + 2 * 3600
    out = str(tmp_path / "out")
    result = CliRunner().invoke(report, ["--input", spool, "--out", out, "--master", "local[2]",
                                         "--since", str(since), "--until", str(until)])
    assert result.exit_code == 0, result.output
    assert "] writing messages/" in result.stderr and "] computing figures" in result.stderr
    assert f"mta report: warning: {last} at offset {tail}: torn tail: {n} bytes" in result.stderr
    want = ref.figures(ref.plain_records({"mx1": spool}, ends={last: tail}), int(since * 1000), int(until * 1000))
    torn = f"torn tail: {n} bytes of an interrupted write at the end of the file"
    want = attrs.evolve(want, errors=((last, tail, torn),))
    with open(os.path.join(out, "report.txt"), encoding="utf-8") as f:
        text = f.read()
    assert text == render_text(want) and result.stdout == text
    assert want.totals["queued"] > 0 and want.first_ms is not None and want.first_ms >= since * 1000
    assert want.totals["delivered"] and want.totals["deferred"]


def test_cli_says_so_when_there_are_no_segments(tmp_path: Any) -> None:
    result = CliRunner().invoke(report, ["--input", str(tmp_path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert result.output.strip() == f"mta report: no segment files (*.seg) under: {tmp_path}"


def test_missing_java_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ReportError) as info:
        make_session("local[1]")
    assert str(info.value) == JAVA_MISSING and "apt-get install default-jre-headless" in JAVA_MISSING
