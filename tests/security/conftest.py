"""Fixtures of the security tests."""

from __future__ import annotations

import pytest
import trustme


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    """A certificate authority of the test's own, for the relay's and the next hops' certificates."""
    return trustme.CA()
