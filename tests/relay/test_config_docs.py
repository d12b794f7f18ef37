"""The settings tables in docs/operations.md are the definitions, written out (``python -m mta.config.doc``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mta.config.doc import DOC, main, render_table, update
from mta.config.loader import definitions
from mta.config.sections import SECTIONS, SpoolSection, file_settings
from spool.config.engine import SpoolConfig
from spool.config.settings import settings_of

TEXT = Path(DOC).read_text(encoding="utf-8")


def documented(section: str) -> dict[str, str]:
    """The committed table of ``section``: key -> its row."""
    block = TEXT.split(f"<!-- settings [{section}] -->\n", 1)[1].split(f"<!-- end settings [{section}] -->", 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("| `")]
    return {re.match(r"\| `([^`]+)`", row).group(1): row for row in rows}  # type: ignore[union-attr]


def test_the_committed_tables_are_the_generated_ones() -> None:
    assert update(TEXT) == TEXT, "run: python -m mta.config.doc"
    assert main(["--check", DOC]) == 0


def test_every_setting_is_documented_with_its_default_and_every_documented_key_exists() -> None:
    for section, cls in SECTIONS:
        rows = documented(section)
        names = [s.name for s in file_settings(cls)]
        assert list(rows) == names, section
        for s in file_settings(cls):
            assert s.help in rows[s.name].replace("\\|", "|")
    assert sum(len(documented(section)) for section, _ in SECTIONS) == len(definitions())


def test_the_relays_spool_section_is_built_from_the_engines_definitions() -> None:
    """Each engine setting the file may set is a [spool] key, with the engine's own definition, and no other."""
    engine = {s.name: s for s in settings_of(SpoolConfig) if s.in_file}
    relay = {s.name: s for s in file_settings(SpoolSection)}
    assert set(relay) - set(engine) == {"dir", "queue_minfree"}
    for name, definition in engine.items():
        assert relay[name] == definition
        assert f"| `{name}` |" in render_table("spool")


def test_a_document_without_markers_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ops.md"
    path.write_text("# no tables here\n")
    with pytest.raises(ValueError, match=r"no markers <!-- settings \[server\] -->"):
        update(path.read_text())
    assert main([str(path)]) == 2
    stale = TEXT.replace("| `max_recipients` | integer ≥ 1 | `1000` |", "| `max_recipients` | integer ≥ 1 | `999` |")
    assert stale != TEXT
    path.write_text(stale)
    assert main(["--check", str(path)]) == 1
    assert main([str(path)]) == 0 and path.read_text() == TEXT
