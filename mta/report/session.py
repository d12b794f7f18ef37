"""The Spark session of the report: Java found, local mode sized for a small machine.

Apart from the job (``mta.report.job``) because it is about where Spark runs,
not what it computes: the command checks Java here before anything starts a
JVM, and the tests and benchmarks start their sessions here. pyspark is
imported only when a session is made, so the ``mta`` command and its argument
checks import this module without the Spark extra.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import warnings
from typing import Any, Final

from mta.report.errors import ReportError


def java_available() -> bool:
    home = os.environ.get("JAVA_HOME")
    if home and os.access(os.path.join(home, "bin", "java"), os.X_OK):
        return True
    return shutil.which("java") is not None


SPARK_EXTRA: Final = ("pyspark", "pyarrow", "matplotlib")
"""What the report imports beyond the relay's own dependencies: the ``spark`` extra."""


def missing_libraries() -> list[str]:
    """The libraries of the ``spark`` extra that cannot be imported, without importing any."""
    return [name for name in SPARK_EXTRA if importlib.util.find_spec(name) is None]


JAVA_MISSING: Final = (
    "Java not found: Spark needs a Java 17 or 21 runtime. Install one "
    "(Debian/Ubuntu: sudo apt-get install default-jre-headless, or `make sysdeps`) or set JAVA_HOME."
)


def local_cores(master: str) -> int | None:
    """The thread count of a ``local``, ``local[N]`` or ``local[*]`` master; None for a cluster."""
    if master == "local":
        return 1
    if not master.startswith("local["):
        return None
    n = master[len("local["):].split("]", 1)[0].split(",", 1)[0]
    if n == "*":
        return os.cpu_count() or 1
    return max(1, int(n)) if n.isdigit() else 1


ARROW_JAVA_OPTIONS: Final = "-Darrow.enable_unsafe_memory_access=true -Darrow.enable_null_check_for_get=false"
"""Arrow Java's bounds and null checks off. The JVM turns every Arrow batch the
data source's workers send into rows, reading each of the 22 columns of each
row through Arrow's vectors; with the checks on, a quarter of that time went to
checking indexes (``ArrowBuf.chk``, a JFR profile of a ``local[2]`` read) and
the JVM's CPU per record was 1.8-2.0 µs, with them off 1.6-1.8
(docs/benchmarks.md, "The report on a fleet"). The batches come from pyarrow's own
IPC writer in the project's workers, never from outside, so the checks guard
against nothing that can happen here."""

LOCAL_JAVA_OPTIONS: Final = "-XX:+UseSerialGC -XX:TieredStopAtLevel=1 -XX:CICompilerCount=1 -XX:-UsePerfData " + \
    ARROW_JAVA_OPTIONS
"""JVM options for local mode. Measured on the project's 2-core machine: most of
a local report's JVM time is start-up (loading and compiling Spark's classes),
not the data. The C1 compiler alone and the serial collector need far less CPU
than C2 plus G1's background threads, which matters when the cores are shared;
the data-heavy part of the job runs in the Python workers anyway. (C2 makes
the JVM's row conversion cheaper once it has compiled it, after about a
million records: an operator with a larger fleet can give
``--conf spark.driver.extraJavaOptions=`` without ``TieredStopAtLevel``;
docs/benchmarks.md has the figures.) Arrow's checks: :data:`ARROW_JAVA_OPTIONS`.

The driver of a job on a cluster gets them too: there it plans and schedules,
and the rows are the executors' (the decode stage's tasks write their Parquet
themselves), so C2's and G1's background threads only take CPU from whatever
shares the driver's machine. On the benchmark's cluster, whose daemons and
executor share the driver's two cores, the decode stage read 0.97 of the
plain reader per core with them against 0.87 without (docs/benchmarks.md,
"The report on a fleet")."""


def make_session(master: str = "local[*]", app: str = "logspool-report", conf: dict[str, str] | None = None) -> Any:
    """A SparkSession with the logspool data source registered.

    Local mode binds to loopback (``SPARK_LOCAL_IP=127.0.0.1`` unless set):
    otherwise Spark picks a non-loopback address that may not even route.
    It also sizes shuffles to the local cores (Spark's default of 200 shuffle
    partitions means 200 tiny tasks per join or aggregation, each with its
    scheduling cost, for tables of a few thousand rows). The driver's JVM, in
    local mode and on a cluster, starts with :data:`LOCAL_JAVA_OPTIONS`. Its workers run this interpreter, so they
    import the same ``spool`` package. On a cluster, the executors run the
    operator's ``PYSPARK_PYTHON`` and get the project's packages shipped with
    the job (``mta.report.shipping``). ``conf`` overrides any of these.

    Raises ReportError when Java or pyspark is missing, or when a cluster's
    workers cannot run the job's Python code.
    """
    if not java_available():
        raise ReportError(JAVA_MISSING)
    # pyspark 4.x warns on every run that it "does not yet fully support pandas >= 3.0.0"; the job
    # uses pandas for nothing of its own, and an operator cannot act on the warning.
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise ReportError("pyspark is not installed: pip install 'logspool[spark]'") from None
    cores = local_cores(master)
    settings = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.session.timeZone": "UTC",
        # A starved machine can take longer than the 10 s default heartbeat to
        # bring the scheduler up; the early heartbeat then fails noisily.
        "spark.executor.heartbeatInterval": "60s",
        "spark.network.timeout": "600s",
    }
    settings["spark.driver.extraJavaOptions"] = LOCAL_JAVA_OPTIONS
    if cores is not None:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        settings.update({
            "spark.sql.shuffle.partitions": str(2 * cores),
            "spark.default.parallelism": str(cores),
        })
    settings.update(conf or {})
    if cores is not None:
        # Local mode: the workers are this machine's processes, and this interpreter has everything.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # On a cluster, the executors' Python is the operator's PYSPARK_PYTHON (Spark's default: python3 on
    # the workers' PATH); this interpreter's path means nothing on another machine.
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.master(master).appName(app)
    for k, v in settings.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    if cores is None:
        # Before the data source is registered: its Python function takes the
        # shipped files as they are at registration.
        from mta.report.shipping import ship

        try:
            ship(spark)
        except ReportError:
            spark.stop()
            raise
    from mta.report.spark_source import LogspoolDataSource

    spark.dataSource.register(LogspoolDataSource)
    return spark
