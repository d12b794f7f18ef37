"""Fixtures of the report tests: one local SparkSession, two relays' spools with history, the
local-mode report of them, and a standalone Spark cluster on 127.0.0.1 with a worker Python that
knows nothing of the project."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import report_reference as ref
from s3_server import s3_server
from spark_cluster import Cluster, start_cluster, worker_python
from spark_fixture import run_relay

from mta.report.figures import Figures
from mta.report.job import run_report


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """An S3-compatible server on 127.0.0.1 (moto), its address in the AWS variables (tests/support/s3_server.py)."""
    with s3_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def spark(s3_endpoint: str) -> Iterator[Any]:
    """One local SparkSession for every Spark test (it takes seconds to start). After the S3 server: Spark's
    Python workers take their environment, the server's address with it, from the JVM as it starts."""
    from mta.report.session import make_session

    # Two shuffle partitions: the tables hold a few thousand rows, and every
    # extra partition is one more task to schedule on a shared 2-core machine.
    session = make_session("local[2]", app="logspool-tests", conf={"spark.sql.shuffle.partitions": "2"})
    yield session
    session.stop()


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two relays' spools, ``mx1`` and ``mx2``, with deferrals, bounces, expiry and a queue left over."""
    root = tmp_path_factory.mktemp("fleet")
    dirs = {}
    for seed, relay in enumerate(("mx1", "mx2"), start=1):
        d = str(root / relay)
        run_relay(d, seed)
        dirs[relay] = d
    return dirs


@pytest.fixture(scope="session")
def whole(spark: Any, fleet: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Figures, Figures, str]:
    """The fleet's report in local mode (its figures and output directory) and the plain computation's figures."""
    out = str(tmp_path_factory.mktemp("report"))
    got = run_report(spark, list(fleet.values()), out)
    return got, ref.figures(ref.plain_records(fleet)), out


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A standalone master and one worker (2 cores) on 127.0.0.1; only their process groups are killed after."""
    cluster = start_cluster(str(tmp_path_factory.mktemp("spark-cluster")))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def bare_worker_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The workers' interpreter as docs/operations.md has the operator make it: a venv with only
    ``mta.report.shipping.WORKER_LIBRARIES``, no logspool."""
    return worker_python(str(tmp_path_factory.mktemp("worker-python") / "venv"))
