"""The grammar of durations and sizes, the one place both the config file and ``spoolctl`` read and write them.

Durations: a number and a unit, ``"250ms"``, ``"30s"``, ``"5m"``, ``"1.5h"``,
``"5d"``, ``"1w"``, or a plain number of seconds (a TOML integer or float, or
a string of digits). At most a hundred years: anything longer is a typo, and
the cap keeps deadline arithmetic far from float overflow.

Sizes: a whole number and a binary unit, ``"512k"``, ``"10M"``, ``"10MB"``,
``"1GiB"`` (k = 1024, as Exim and Postfix's documentation count), or a plain
number of bytes.

``format_duration`` and ``format_size`` write a value so that the parser gives
back exactly the same number (``mta config show`` relies on it): a unit only
where it is exact, else plain seconds or bytes. ``format_age`` is for reading
only (``3d 4h``): it rounds.
"""

from __future__ import annotations

import math
import re

from spool.errors import ConfigError

__all__ = ["format_age", "format_duration", "format_size", "parse_duration", "parse_size"]

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_RE = re.compile(r"\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)
MAX_DURATION = 100 * 365 * 86400.0


def parse_duration(value: object) -> float:
    """Seconds from a duration (see the module docstring).

    Raises:
        ConfigError: not a duration, negative, not finite, or over 100 years.
    """
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION_RE.fullmatch(value)):
        seconds = float(match.group(1)) * _DURATION_UNITS[(match.group(2) or "s").lower()]
    else:
        raise ConfigError(f"not a duration: {value!r} (expected e.g. '30s', '5m', '2h', '5d' or a number of seconds)")
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"a duration must be a finite number of seconds >= 0, got {value!r}")
    if seconds > MAX_DURATION:
        raise ConfigError(f"duration {value!r} is longer than 100 years")
    return seconds


def parse_size(value: object) -> int:
    """Bytes from a size (see the module docstring).

    Raises:
        ConfigError: not a size, or negative.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (match := _SIZE_RE.fullmatch(value)):
        size = int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    else:
        raise ConfigError(f"expected a size like '10MB', '512k' or a number of bytes, got {value!r}")
    if size < 0:
        raise ConfigError(f"a size must be >= 0, got {value!r}")
    return size


def format_duration(seconds: float) -> str | float:
    """The shortest duration text that ``parse_duration`` reads back as exactly ``seconds``.

    A whole number of the largest unit that fits (``"5m"``, ``"90s"``, ``"100ms"``),
    else a decimal (``"1.5s"``), else the number of seconds itself (a
    float, for TOML). Values the parser would refuse (over 100 years, infinite) come back
    as they are, so a caller can still show them.
    """
    if not math.isfinite(seconds) or seconds < 0 or seconds > MAX_DURATION:
        return seconds
    if seconds == 0:
        return "0s"
    def whole(unit: str) -> str:
        return f"{round(seconds / _DURATION_UNITS[unit])}{unit}"

    def decimal(unit: str) -> str:
        return f"{seconds / _DURATION_UNITS[unit]:.3f}".rstrip("0").rstrip(".") + unit

    below_one = [whole("ms")] if seconds < 1 else []
    for text in (*map(whole, ("w", "d", "h", "m", "s")), *below_one, decimal("s"), decimal("ms"), whole("ms")):
        if not text.startswith("0") and parse_duration(text) == seconds:
            return text
    return seconds


def format_size(size: int) -> str | int:
    """``"64MiB"`` where a binary unit divides ``size`` exactly, else the number of bytes."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift}{unit}"
    return size


def format_age(seconds: float) -> str:
    """For reading, not for parsing: whole units where they fit (``5m``), else the two largest (``3d 4h``)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    if seconds < 60:
        return f"{seconds:g}s"
    parts = []
    rest = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if rest >= size:
            parts.append(f"{rest // size}{unit}")
            rest %= size
    return " ".join(parts[:2])
