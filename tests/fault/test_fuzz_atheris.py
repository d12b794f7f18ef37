"""A bounded atheris (libFuzzer) run over the on-disk decoders; the long run is `make crashtest`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decoders_survive_a_bounded_coverage_guided_run(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fault_injection.fuzz_decoder", "-runs=4000", "-seed=1",
         f"-artifact_prefix={tmp_path}/"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Done 4000 runs" in proc.stderr
    assert not list(tmp_path.glob("crash-*"))
