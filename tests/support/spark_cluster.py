"""A standalone Spark cluster on 127.0.0.1 for the tests, and a worker Python without the project.

``start_cluster`` starts a master and one worker from the pyspark install
(``spark-class org.apache.spark.deploy.master.Master`` and ``...Worker``),
each in a process group of its own; ``Cluster.stop`` kills exactly those
groups (the worker's executors and their Python workers are in the worker's
group). Readiness is read from the daemons' own log lines ("I have been
elected leader", "Successfully registered with master"), never waited for
by time.

``worker_python`` makes the interpreter an operator would give the workers
by following docs/operations.md ("Report on a fleet"): a fresh virtual
environment with only ``mta.report.shipping.WORKER_LIBRARIES`` installed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO

import attrs

from mta.report.shipping import WORKER_LIBRARIES

SPARK_DAEMON_JAVA_OPTS = "-XX:+UseSerialGC -XX:TieredStopAtLevel=1 -XX:CICompilerCount=1 -XX:-UsePerfData"
"""The daemons do little (a master and a worker that starts one executor): C1 alone and the serial
collector keep them off the two shared cores, as ``mta.report.session.LOCAL_JAVA_OPTIONS`` does locally."""


def spark_home() -> str:
    import pyspark

    return os.path.dirname(pyspark.__file__)


def daemon_env(workdir: str) -> dict[str, str]:
    """The daemons' environment: loopback only, nothing of the tests' Python (no PYTHONPATH, no venv)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "PYSPARK", "VIRTUAL_ENV", "SPARK_"))}
    env["PATH"] = ":".join(p for p in env.get("PATH", "").split(":") if not p.startswith(sys.prefix))
    env.update({
        "SPARK_HOME": spark_home(),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOCAL_HOSTNAME": "localhost",
        "SPARK_LOG_DIR": workdir,
        "SPARK_DAEMON_JAVA_OPTS": SPARK_DAEMON_JAVA_OPTS,
        "SPARK_DAEMON_MEMORY": "256m",
    })
    return env


@attrs.define
class Daemon:
    """One JVM daemon in its own process group, its log copied to a file by a thread."""

    proc: subprocess.Popen[bytes]
    log_path: str
    lines: list[str] = attrs.field(factory=list)
    matched: dict[str, threading.Event] = attrs.field(factory=dict)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first log line matching ``pattern``; AssertionError if the daemon exits or ``timeout`` passes."""
        event = self.matched[pattern]
        if not event.wait(timeout):
            raise AssertionError(f"no {pattern!r} in {timeout:.0f} s (exit status {self.proc.poll()}); "
                                 f"log {self.log_path}:\n" + "".join(self.lines[-30:]))
        for line in self.lines:
            m = re.search(pattern, line)
            if m:
                return m
        raise AssertionError(pattern)  # unreachable: the event is set on a matching line

    def kill(self) -> None:
        """SIGKILL to the daemon's process group (the daemon and what it started), then reap it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


def start_daemon(args: list[str], env: dict[str, str], log_path: str, patterns: list[str]) -> Daemon:
    proc = subprocess.Popen([os.path.join(spark_home(), "bin", "spark-class"), *args], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=os.path.dirname(log_path))
    daemon = Daemon(proc, log_path, matched={p: threading.Event() for p in patterns})

    def copy(stream: IO[bytes]) -> None:
        with open(log_path, "w", encoding="utf-8") as log:
            for raw in stream:
                line = raw.decode("utf-8", "replace")
                log.write(line)
                log.flush()
                daemon.lines.append(line)
                for pattern, event in daemon.matched.items():
                    if re.search(pattern, line):
                        event.set()
        for event in daemon.matched.values():  # the daemon ended: nobody should wait out a timeout
            event.set()

    assert proc.stdout is not None
    threading.Thread(target=copy, args=(proc.stdout,), daemon=True).start()
    return daemon


@attrs.define
class Cluster:
    master_url: str
    master: Daemon
    worker: Daemon
    workdir: str

    def stop(self) -> None:
        """Kill the worker's group (its executors too), then the master's: only what start_cluster started."""
        self.worker.kill()
        self.master.kill()


def start_cluster(workdir: str, cores: int = 2, memory: str = "1g", timeout: float = 300.0) -> Cluster:
    """A master and one worker on 127.0.0.1, on ports the kernel picks (read back from their logs)."""
    os.makedirs(workdir, exist_ok=True)
    env = daemon_env(workdir)
    master = start_daemon(
        ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", "0", "--webui-port", "0"],
        env, os.path.join(workdir, "master.log"),
        [r"Starting Spark master at (spark://127\.0\.0\.1:\d+)", r"I have been elected leader"])
    try:
        url = master.wait_for(r"Starting Spark master at (spark://127\.0\.0\.1:\d+)", timeout).group(1)
        master.wait_for(r"I have been elected leader", timeout)
        if master.proc.poll() is not None:
            raise AssertionError(f"the master exited: {master.log_path}")
        worker_dir = os.path.join(workdir, "work")
        worker = start_daemon(
            ["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--port", "0", "--webui-port", "0",
             "--cores", str(cores), "--memory", memory, "--work-dir", worker_dir, url],
            env, os.path.join(workdir, "worker.log"), [r"Successfully registered with master"])
    except BaseException:
        master.kill()
        raise
    try:
        worker.wait_for(r"Successfully registered with master", timeout)
        if worker.proc.poll() is not None:
            raise AssertionError(f"the worker exited: {worker.log_path}")
    except BaseException:
        worker.kill()
        master.kill()
        raise
    return Cluster(url, master, worker, workdir)


def worker_python(directory: str, run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> str:
    """A fresh venv with only the workers' documented libraries; returns its interpreter.

    The same Python version as this one (PySpark refuses a worker of another
    minor version). Raises AssertionError if pip fails.
    """
    run([sys.executable, "-m", "venv", "--without-pip", directory], check=True, timeout=120)
    python = os.path.join(directory, "bin", "python")
    # pip from this interpreter installs into the new environment (--python), so the venv needs no pip of its own.
    proc = run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--disable-pip-version-check",
                *WORKER_LIBRARIES], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    return python
