"""What a cluster's executors need, shipped with the job: the project's own packages.

On a cluster (any master but ``local``), the workers know nothing of
logspool. The job zips the ``spool`` and ``mta`` packages this process
imported (pure Python: the same code as the driver's, whatever was installed
on the workers) and hands the zip to Spark with ``addPyFile``, which puts it
on every Python worker's path, the data source planners' included. The
libraries those packages import (:data:`WORKER_LIBRARIES`) are installed on
the workers once, as docs/operations.md ("Report on a fleet") says; a job
whose workers lack one stops at once with one line naming it, before
anything is read. Why this and not a packed virtual environment: docs/design.md,
"The report on a cluster".

Only the standard library is imported at module level: the check below runs
on a worker that may lack everything else.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import tempfile
import zipfile
from typing import Any, Final

from mta.report.errors import ReportError

WORKER_LIBRARIES: Final = ("attrs", "cbor2", "crc32c", "pyarrow")
"""What the executors import beyond the shipped packages and Spark's own pyspark:
the record codec's (attrs, cbor2, crc32c) and the Arrow batches of the data
source (pyarrow). docs/operations.md gives the pip line; keep the two in step."""

SHIPPED_PACKAGES: Final = ("spool", "mta")

FLEET_DOCS: Final = "docs/operations.md, 'Report on a fleet'"


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ReportError(f"cannot find the {name} package to ship to the workers")
    return next(iter(spec.submodule_search_locations))


def project_zip(directory: str) -> str:
    """Zip the ``.py`` files of :data:`SHIPPED_PACKAGES` into ``directory``; returns the zip's path.

    The name carries a digest of the contents, so a worker that caches files
    by name never runs an older copy.
    """
    entries: list[tuple[str, str]] = []
    for package in SHIPPED_PACKAGES:
        root = _package_dir(package)
        base = os.path.dirname(root)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            entries.extend((os.path.join(dirpath, f), os.path.relpath(os.path.join(dirpath, f), base))
                           for f in sorted(filenames) if f.endswith(".py"))
    digest = hashlib.sha256()
    for path, arcname in entries:
        digest.update(arcname.encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    target = os.path.join(directory, f"logspool-{digest.hexdigest()[:12]}.zip")
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as z:
        for path, arcname in entries:
            z.write(path, arcname)
    return target


def missing_here() -> tuple[str, ...]:
    """The :data:`WORKER_LIBRARIES` this interpreter cannot import (run on a worker). A worker of
    another Python version than the driver's never gets here: PySpark refuses it as it starts."""
    return tuple(name for name in WORKER_LIBRARIES if importlib.util.find_spec(name) is None)


_REASONS: Final = (
    re.compile(r'Cannot run program "[^"\n]*"[^\n]*'),  # the JVM could not start the interpreter
    re.compile(r"\[PYTHON_VERSION_MISMATCH\][^\n]*"),  # PySpark's check as the worker starts
    re.compile(r"^\s*(?:\w+\.)*\w*(?:Error|Exception): [^\n]*", re.MULTILINE),  # the worker's own traceback
)


def _reason(exc: BaseException) -> str:
    """What went wrong on the executors, in one line, out of a Py4J error's pages."""
    text = str(exc)
    for pattern in _REASONS:
        found = pattern.findall(text)
        if found:
            return " ".join(found[-1].split())[:300]
    return text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__


def ship(spark: Any, workdir: str | None = None) -> str:
    """Ship the project's packages to the executors and check that they can run them.

    ``workdir`` holds the zip for as long as the session lives (Spark serves
    the file from where it is); by default a new temporary directory.

    Raises ReportError (one line) when the workers' Python cannot start (not
    there, another version than this one) or lacks a library of
    :data:`WORKER_LIBRARIES`.
    """
    directory = workdir or tempfile.mkdtemp(prefix="logspool-report-")
    path = project_zip(directory)
    sc = spark.sparkContext
    sc.addPyFile(path)
    python = sc.pythonExec
    try:
        seen = sc.parallelize(range(sc.defaultParallelism), sc.defaultParallelism) \
            .map(lambda _i: missing_here()).distinct().collect()
    except Exception as exc:  # a Py4J error carrying the worker's traceback or the JVM's IOException
        raise ReportError(f"the Spark workers cannot run Python {python!r} (set PYSPARK_PYTHON to their "
                          f"interpreter; {FLEET_DOCS}): {_reason(exc)}") from None
    missing = sorted({name for names in seen for name in names})
    if missing:
        raise ReportError(f"the Spark workers' Python ({python}) lacks {', '.join(missing)}: "
                          f"pip install {' '.join(WORKER_LIBRARIES)} there ({FLEET_DOCS})")
    return path
