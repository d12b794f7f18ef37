"""``processes = "auto"`` counts the CPUs the relay may run on (its affinity), not the host's."""

from __future__ import annotations

import os
import subprocess
import sys

from mta.config.loader import parse_config
from mta.config.sections import AUTO_DELIVERY_PROCESSES, delivery_workers
from mta.config.values import usable_cpus


def test_auto_is_the_affinity_mask() -> None:
    assert usable_cpus() == len(os.sched_getaffinity(0))
    assert parse_config('[server]\nprocesses = "auto"').server.processes == usable_cpus()
    assert delivery_workers(AUTO_DELIVERY_PROCESSES, 1) == usable_cpus() - 1


def test_a_relay_pinned_to_one_cpu_runs_one_process_and_no_worker() -> None:
    """As under ``taskset -c 0`` or a cpuset: the host may have more CPUs, the relay gets one of them."""
    code = ("from mta.config.sections import AUTO_DELIVERY_PROCESSES, delivery_workers\n"
            "from mta.config.loader import parse_config\n"
            "c = parse_config('[server]\\nprocesses = \"auto\"')\n"
            "print(c.server.processes, delivery_workers(AUTO_DELIVERY_PROCESSES, c.server.processes))\n")
    first = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                         preexec_fn=lambda: os.sched_setaffinity(0, {first}),
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.stdout.split() == ["1", "0"]
