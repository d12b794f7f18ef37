"""The house rule on module size: no module in ``spool/`` or ``mta/`` has more than 800 lines.

A module that grows past it is split by what its parts hold (``mta/inbound/session.py`` beside
``server.py``, ``mta/smtp/server_states.py`` beside ``server.py``), not trimmed to fit.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 800


def test_no_module_in_spool_or_mta_is_over_800_lines() -> None:
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
             for package in ("spool", "mta") for path in sorted((ROOT / package).rglob("*.py"))}
    assert sizes, "no modules found: the test looks in the wrong place"
    over = {name: lines for name, lines in sizes.items() if lines > MAX_LINES}
    assert not over, f"over {MAX_LINES} lines: {over}"
