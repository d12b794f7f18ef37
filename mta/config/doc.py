"""The settings tables of docs/operations.md, made from the definitions: ``python -m mta.config.doc``.

Each table sits between two markers, ``<!-- settings [server] -->`` and
``<!-- end settings [server] -->``; everything else in the file is prose
kept by hand. Run with ``--check`` (as the tests do) to fail, instead of
writing, when the committed tables differ from the definitions.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

from mta.config.sections import SECTIONS, file_settings
from mta.config.show import toml_value
from spool import Setting

__all__ = ["DOC", "render_table", "update"]

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "operations.md")


def _default(s: Setting[Any]) -> str:
    if s.derived is not None:
        return s.derived.text
    if s.default is None:
        return "not set"
    return f"`{toml_value(s.kind.write(s.default))}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_table(section: str) -> str:
    """The markdown table of one section: key, values it takes, default, meaning."""
    cls = dict(SECTIONS)[section]
    rows = ["| key | value | default | meaning |", "| --- | --- | --- | --- |"]
    for s in file_settings(cls):
        what = s.kind.what() + (f" ({s.unit})" if s.unit else "") + (', or "" (the default)'
                                                                       if s.blank_is_default else "")
        rows.append(f"| `{s.name}` | {_cell(what)} | {_cell(_default(s))} | {_cell(s.help)} |")
    return "\n".join(rows) + "\n"


def update(text: str) -> str:
    """``text`` with every section's table replaced by the one the definitions give.

    Raises:
        ValueError: a section's markers are missing.
    """
    for section, _ in SECTIONS:
        begin, end = f"<!-- settings [{section}] -->\n", f"<!-- end settings [{section}] -->"
        pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.DOTALL)
        match = pattern.search(text)
        if match is None:
            raise ValueError(f"no markers {begin.strip()} ... {end} in the document")
        text = text[:match.start()] + begin + render_table(section) + end + text[match.end():]
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mta.config.doc", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the document is not up to date")
    parser.add_argument("path", nargs="?", default=os.path.normpath(DOC))
    args = parser.parse_args(argv)
    with open(args.path, encoding="utf-8") as f:
        text = f.read()
    try:
        updated = update(text)
    except ValueError as exc:
        print(f"{args.path}: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if updated != text:
            print(f"{args.path}: the settings tables differ from the definitions; run python -m mta.config.doc",
                  file=sys.stderr)
            return 1
        return 0
    if updated != text:
        with open(args.path, "w", encoding="utf-8") as f:
            f.write(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
