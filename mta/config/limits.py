"""``[limits]``: messages and recipients per time window, per client address, per authenticated user, per sender.

A rate is written ``COUNT/DURATION`` (``"100/1m"``, ``"1000/1h"``); not set,
that limit is off. The counters are shared by the relay's processes through
one file (``table``, see ``mta.limits.table``): its default sits in the
spool directory the relay was configured with, so every shard's process
finds the same file.
"""

from __future__ import annotations

import os
import re

import attrs

from mta.config.values import text_of
from spool import Boolean, ConfigError, Derived, Integer, Kind, Optional, Path, TomlValue, parse_duration, setting

__all__ = ["MAX_WINDOW", "LimitsSection", "Rate", "RateKind"]

MAX_WINDOW = 7 * 86400  # a week: a counter's two windows stay in a u32 of seconds and in an operator's head
_RATE = re.compile(r"\s*([0-9]{1,9})\s*/\s*(\S+)\s*")


def _window_text(seconds: int) -> str:
    """A window in its largest whole unit (``1h``, ``90s``), as ``parse_duration`` reads it back."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


@attrs.frozen
class Rate:
    """``count`` per ``window`` whole seconds."""

    count: int
    window: int

    def __str__(self) -> str:
        return f"{self.count}/{_window_text(self.window)}"


@attrs.frozen
class RateKind(Kind[Rate]):
    def what(self) -> str:
        return "rate `COUNT/DURATION` (`100/1m`)"

    def convert(self, raw: object, base_dir: str | None) -> Rate:
        text = text_of(raw)
        m = _RATE.fullmatch(text)
        if m is None:
            raise ConfigError(f"not a rate: {text!r} (expected COUNT/DURATION, as '100/1m' or '1000/1h')")
        seconds = parse_duration(m.group(2))
        if seconds != int(seconds):
            raise ConfigError(f"the window of {text!r} must be a whole number of seconds")
        return Rate(int(m.group(1)), int(seconds))

    def check(self, value: Rate) -> None:
        if value.count < 1:
            raise ConfigError(f"the count must be at least 1, got {value.count}")
        if not 1 <= value.window <= MAX_WINDOW:
            raise ConfigError(f"the window must be between 1s and 7d, got {value.window}s")

    def write(self, value: Rate) -> TomlValue:
        return str(value)


_OPTIONAL_RATE: Kind[Rate | None] = Optional(RateKind())


@attrs.frozen
class SlotCount(Integer):
    """The table's slots: a multiple of the bucket size (8)."""

    def what(self) -> str:
        return f"integer {self.low}–{self.high}, a multiple of 8"

    def check(self, value: int) -> None:
        super().check(value)
        if value % 8:
            raise ConfigError(f"must be a multiple of 8, got {value}")


@attrs.frozen(kw_only=True)
class LimitsSection:
    """``[limits]``: rate limits (see "Limits" in docs/operations.md for the replies and the exemptions)."""

    client_connections: Rate | None = setting(
        _OPTIONAL_RATE, "connections from one client address; over it, the connection gets `421 4.7.0` before the "
        "greeting and is closed (Postfix's smtpd_client_connection_rate_limit)")
    client_messages: Rate | None = setting(
        _OPTIONAL_RATE, "messages (MAIL commands accepted) from one client address; over it, MAIL gets `450 4.7.1`")
    client_recipients: Rate | None = setting(
        _OPTIONAL_RATE, "recipients (RCPT commands accepted) from one client address; over it, RCPT gets `450 4.7.1`")
    user_messages: Rate | None = setting(
        _OPTIONAL_RATE, "messages from one authenticated user (at MAIL, whatever the client address)")
    user_recipients: Rate | None = setting(_OPTIONAL_RATE, "recipients from one authenticated user (at RCPT)")
    sender_messages: Rate | None = setting(
        _OPTIONAL_RATE, "messages from one envelope sender address, compared without regard to case (the null "
        "sender is not counted)")
    sender_recipients: Rate | None = setting(_OPTIONAL_RATE, "recipients from one envelope sender address")
    exempt_mynetworks: bool = setting(
        Boolean(), "clients in `[relay] mynetworks` are not counted (Postfix's smtpd_client_event_limit_exceptions)",
        True)
    refusals_before_close: int = setting(
        Integer(1, 100), "a session that meets a limit this many times gets `421 4.7.0` at the last and is closed",
        3)
    table: str = setting(
        Path(), "the counters shared by the relay's processes: a file mapped into each (see \"Limits\")",
        derived=Derived("`<spool.dir>/rate-limits`", lambda r: os.path.join(r("spool.dir"), "rate-limits")))
    table_slots: int = setting(
        SlotCount(64, 1 << 24), "counters the table holds (32 bytes each); when full, the stalest are forgotten",
        65536)

    def any(self) -> bool:
        """Whether some limit is on (else no table is opened)."""
        return any(getattr(self, name) is not None for name in (
            "client_connections", "client_messages", "client_recipients", "user_messages", "user_recipients",
            "sender_messages", "sender_recipients"))
