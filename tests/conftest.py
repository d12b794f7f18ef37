"""Marks and fixtures shared by every folder of tests.

``slow``: a test that takes seconds (a JVM, real subprocesses restarted,
timeouts that must really pass). ``make test`` runs them all; a developer
may leave them out with ``pytest -m "not slow"``.
"""

from __future__ import annotations

import pytest
import trustme


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that needs the SparkSession (``tests/report/conftest.py``) is slow: a JVM starts for it."""
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    """A certificate authority of the test's own, for the relay's and the next hops' certificates."""
    return trustme.CA()
