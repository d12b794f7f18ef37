"""spool's public face: what ``spool/__init__`` names is what a user of the engine imports.

The face resolves its names on first use (PEP 562); these tests hold that every name it lists
resolves to the object of its home module, that nothing else is offered, that ``import spool``
stays as light as it was, and that the import contract keeping mta on the face covers all of mta.
"""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys
import tomllib
import types

import pytest

import spool

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_name_of_the_face_imports_and_is_its_homes_object() -> None:
    homes = spool._HOMES
    assert sorted(spool.__all__) == sorted(homes)
    assert len(set(spool.__all__)) == len(spool.__all__)
    for name in spool.__all__:
        home = importlib.import_module(homes[name])
        value = getattr(spool, name)
        expected = home if isinstance(value, types.ModuleType) else getattr(home, name)
        assert value is expected, name
    star: dict[str, object] = {}
    exec("from spool import *", star)  # what __all__ promises, `import *` delivers
    assert set(spool.__all__) <= set(star)
    assert set(spool.__all__) <= set(dir(spool))


def test_a_name_not_on_the_face_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'SpoolCore'"):
        spool.SpoolCore  # noqa: B018  (the machinery is not on the face)
    assert not hasattr(spool, "no_such_name")


def test_import_spool_loads_neither_trio_nor_the_engine() -> None:
    """spoolctl and Spark's workers import parts of spool: the face costs them nothing until used."""
    code = ("import sys, spool, spool.format.record; "
            "print(sorted(m for m in sys.modules if m == 'trio' or m.startswith(('spool.engine', 'spool.aio')))); "
            "spool.AsyncSpool; print('trio' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["[]", "True"]


def test_the_contract_keeping_mta_on_the_face_names_every_part_of_mta_but_the_report() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"]
                   if c["name"].startswith("the relay uses the engine through its face")]
    parts = {f"mta.{p.stem}" for p in (ROOT / "mta").iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert set(contract["source_modules"]) == parts - {"mta.report"}
    behind = {f"spool.{p.stem}" for p in (ROOT / "spool").iterdir()
              if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert set(contract["forbidden_modules"]) == behind
