"""The layers contract of spool's packages (pyproject.toml, checked by ``make imports``) catches an upward import.

A copy of the tree gets one planted import from the bottom layer (the format) up to the engine; import-linter,
run on the copy with the project's own contracts, must refuse it and name the arrow.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def test_an_upward_import_planted_in_the_format_fails_the_layers_contract(tmp_path: Path) -> None:
    for package in ("spool", "mta", "fault_injection"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    planted = tmp_path / "spool" / "format" / "horizon.py"
    planted.write_text(planted.read_text() + "\nfrom spool.engine import spool as _planted  # noqa: E402,F401\n")
    done = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=300, check=False)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "spool's packages are layers" in out and "BROKEN" in out, out
    assert "spool.format.horizon -> spool.engine" in out, out
