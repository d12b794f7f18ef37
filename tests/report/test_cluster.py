"""``mta report`` on a standalone Spark cluster whose workers know nothing of the project.

The master and the worker are started from the pyspark install on 127.0.0.1
(tests/support/spark_cluster.py); the executors' Python is a fresh virtual
environment holding only what docs/operations.md tells an operator to
install on the workers, so ``spool`` and ``mta`` reach them only as the job
ships them (mta/report/shipping.py). Every table and both reports must be
the local-mode run's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pyarrow.parquet as pq
import pytest
from spark_cluster import Cluster, daemon_env

from mta.report.figures import Figures
from mta.report.shipping import FLEET_DOCS, WORKER_LIBRARIES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

TABLES = ("records", "messages", "attempts", "queue")

# What the job would otherwise spend on a few thousand rows: Spark's 200 shuffle partitions.
SMALL = ("--conf", "spark.sql.shuffle.partitions=2")


def mta_report(cluster: Cluster, worker_python: str, args: list[str], cwd: str) -> subprocess.CompletedProcess[str]:
    """``mta report --master spark://...`` as a child process, its executors on ``worker_python``."""
    env = dict(os.environ, PYSPARK_PYTHON=worker_python, SPARK_LOCAL_IP="127.0.0.1")
    return subprocess.run([sys.executable, "-m", "mta", "report", "--master", cluster.master_url, *SMALL, *args],
                          env=env, cwd=cwd, capture_output=True, text=True, timeout=1500, check=False)


def rows(out: str, table: str) -> list[tuple[Any, ...]]:
    """A Parquet table's rows, sorted (Spark writes them in whatever order its tasks ended)."""
    t = pq.read_table(os.path.join(out, table))
    names = sorted(t.column_names)
    return sorted(tuple(repr(r[n]) for n in names) for r in t.to_pylist())


def test_the_worker_python_has_no_logspool(bare_worker_python: str, spark_cluster: Cluster) -> None:
    """The premise: in the workers' environment, the interpreter imports the documented
    libraries and neither of the project's packages."""
    env = daemon_env(spark_cluster.workdir)
    code = ("import importlib.util, sys\n"
            "print(sorted(n for n in sys.argv[1:] if importlib.util.find_spec(n) is None))\n")
    proc = subprocess.run([bare_worker_python, "-c", code, *WORKER_LIBRARIES, "spool", "mta", "logspool"],
                          env=env, cwd=spark_cluster.workdir, capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip() == "['logspool', 'mta', 'spool']"


def test_report_on_a_cluster_equals_local_mode(spark_cluster: Cluster, bare_worker_python: str,
                                               fleet: dict[str, str], whole: tuple[Figures, Figures, str],
                                               tmp_path: Any) -> None:
    _got, _want, local_out = whole
    out = str(tmp_path / "out")
    inputs = [a for d in fleet.values() for a in ("--input", d)]
    proc = mta_report(spark_cluster, bare_worker_python, [*inputs, "--out", out], str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"starting Spark ({spark_cluster.master_url})" in proc.stderr
    # The executors ran on the worker, from the zip the job shipped.
    work = os.path.join(spark_cluster.workdir, "work")
    shipped = [f for _d, _s, files in os.walk(work) for f in files if f.startswith("logspool-") and f.endswith(".zip")]
    assert shipped, os.listdir(work)
    for table in TABLES:
        got, want = rows(out, table), rows(local_out, table)
        assert len(got) == len(want) > 0, table
        assert got == want, table
    for report in ("report.txt", "report.html"):
        with open(os.path.join(out, report), encoding="utf-8") as a, \
                open(os.path.join(local_out, report), encoding="utf-8") as b:
            assert a.read() == b.read(), report
    with open(os.path.join(out, "report.txt"), encoding="utf-8") as f:
        assert proc.stdout == f.read()


def test_workers_without_the_libraries_are_named_in_one_line(spark_cluster: Cluster, fleet: dict[str, str],
                                                             tmp_path: Any) -> None:
    """A worker Python missing the documented libraries: one line naming them and the pip command,
    exit status 2, before anything is read or written."""
    empty = str(tmp_path / "empty-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", empty], check=True, timeout=120)
    python = os.path.join(empty, "bin", "python")
    out = str(tmp_path / "out")
    proc = mta_report(spark_cluster, python, ["--input", fleet["mx1"], "--out", out], str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"mta report: the Spark workers' Python ({python}) lacks {', '.join(sorted(WORKER_LIBRARIES))}: "
                    f"pip install {' '.join(WORKER_LIBRARIES)} there ({FLEET_DOCS})")
    assert not os.path.exists(os.path.join(out, "records"))


def test_a_worker_python_that_is_not_there_is_named_in_one_line(spark_cluster: Cluster, fleet: dict[str, str],
                                                                tmp_path: Any) -> None:
    """PYSPARK_PYTHON naming no interpreter on the workers: one line with the JVM's reason, exit status 2."""
    python = str(tmp_path / "no-such-venv" / "bin" / "python")
    out = str(tmp_path / "out")
    proc = mta_report(spark_cluster, python, ["--input", fleet["mx1"], "--out", out], str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"mta report: the Spark workers cannot run Python '{python}' (set PYSPARK_PYTHON to their "
                    f"interpreter; {FLEET_DOCS}): Cannot run program \"{python}\": error=2, No such file or directory")
    assert not os.path.exists(os.path.join(out, "records"))
