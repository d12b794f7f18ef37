"""The fault tests break the engine on purpose: its warnings about that would only be noise."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def _quiet_engine(caplog: pytest.LogCaptureFixture) -> None:
    # caplog puts the level back after the test, so later tests still see the engine's warnings.
    caplog.set_level(logging.ERROR, logger="spool")
