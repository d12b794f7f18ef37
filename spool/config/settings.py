"""What a setting is: one definition that the engine, the config file, ``mta config`` and the docs all read.

Theory of operation
-------------------
A setting is a field of a frozen attrs class (the engine's ``SpoolConfig``,
the relay's sections in ``mta.config.sections``) declared with ``setting()``.
The field carries its whole definition in its metadata: the *kind* of value
(how to read it from TOML, how to check a typed value, how to write it back,
how the docs describe it), the default (or how it is derived from other
settings), and one line of help. From that one place:

- the class's own constructor checks every value (``SpoolConfig(segment_size=1)``
  raises ``ConfigError`` naming ``segment_size``), so code that builds a
  config by hand meets the same rules as the file;
- the TOML loader (``mta.config.loader``) reads every setting marked
  ``in_file`` with the kind's parser, and names ``FILE: KEY: problem``;
- ``mta config show`` writes each value back with the kind's writer, in a form
  the loader reads as the same value;
- the settings tables of docs/operations.md are generated from the help,
  kind and default (``mta.config.doc``).

The kinds here know nothing of SMTP; the relay adds its own (addresses,
networks, host names) in ``mta.config.values``. The grammar of durations and
sizes is ``spool.config.units``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import attrs

from spool.config.units import format_duration, format_size, parse_duration, parse_size
from spool.errors import ConfigError

__all__ = [
    "Boolean",
    "ConfigError",
    "Derived",
    "Duration",
    "Fraction",
    "Integer",
    "Kind",
    "ListOf",
    "OneOf",
    "Optional",
    "Path",
    "Setting",
    "Size",
    "Text",
    "TomlValue",
    "expect",
    "human_size",
    "resolve_path",
    "setting",
    "settings_of",
    "type_name",
]

T = TypeVar("T")
U = TypeVar("U")
# What a kind writes for ``mta config show``: a TOML scalar, a list of them, or an inline table.
TomlValue = str | int | float | bool | list[Any] | dict[str, Any]
METADATA_KEY = "logspool.setting"


def type_name(value: object) -> str:
    """How an error names the TOML type an operator wrote."""
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "a list", dict: "a table"}
    return names.get(type(value), type(value).__name__)


def human_size(n: int) -> str:
    """``4 KiB``, ``1 GiB``: for messages and docs (``spool.config.units.format_size`` is for the file)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


class Kind(Generic[T]):
    """What values a setting takes.

    ``convert`` turns what TOML gave into a typed value (the grammar and the
    type), ``check`` applies the limits to a typed value (also when a class is
    built in code), ``write`` gives back what ``convert`` reads as the same
    value, and ``what()`` describes the values for the docs. Every problem is a
    ``ConfigError`` with no key: the caller knows where it was.
    """

    def what(self) -> str:
        return "a value"

    def convert(self, raw: object, base_dir: str | None) -> T:
        raise NotImplementedError

    def check(self, value: T) -> None:
        """Raises ConfigError when ``value`` is outside the limits."""

    def read(self, raw: object, base_dir: str | None = None) -> T:
        value = self.convert(raw, base_dir)
        self.check(value)
        return value

    def write(self, value: T) -> TomlValue:
        assert isinstance(value, str | int | float | bool)
        return value


def expect(raw: object, kind: type[T], description: str) -> T:
    """``raw`` if it is of the TOML type ``kind`` (a boolean is not an integer), else a ConfigError."""
    if not isinstance(raw, kind) or (kind is int and isinstance(raw, bool)):
        raise ConfigError(f"expected {description}, got {type_name(raw)} {raw!r}")
    return raw


@attrs.frozen
class Integer(Kind[int]):
    low: int = 0
    high: int = 1 << 62

    def what(self) -> str:
        return f"integer ≥ {self.low}" if self.high == 1 << 62 else f"integer {self.low}–{self.high}"

    def convert(self, raw: object, base_dir: str | None) -> int:
        return expect(raw, int, "an integer")

    def check(self, value: int) -> None:
        if not self.low <= value <= self.high:
            raise ConfigError(f"must be between {self.low} and {self.high}, got {value}")


@attrs.frozen
class Boolean(Kind[bool]):
    def what(self) -> str:
        return "true or false"

    def convert(self, raw: object, base_dir: str | None) -> bool:
        return expect(raw, bool, "true or false")


@attrs.frozen
class Fraction(Kind[float]):
    def what(self) -> str:
        return "number 0–1"

    def convert(self, raw: object, base_dir: str | None) -> float:
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise ConfigError(f"expected a number between 0 and 1, got {type_name(raw)} {raw!r}")
        return float(raw)

    def check(self, value: float) -> None:
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"must be between 0 and 1, got {value!r}")


@attrs.frozen
class Duration(Kind[float]):
    """Seconds, written as in ``spool.config.units``. ``positive``: 0 is refused; ``at_most``: an upper bound."""

    positive: bool = False
    at_most: float | None = None

    def what(self) -> str:
        limits = ([" > 0"] if self.positive else []) + ([f" ≤ {format_duration(self.at_most)}"]
                                                       if self.at_most is not None else [])
        return "duration" + ",".join(limits)

    def convert(self, raw: object, base_dir: str | None) -> float:
        return parse_duration(raw)

    def check(self, value: float) -> None:
        if not value >= 0:  # NaN too
            raise ConfigError(f"must not be negative, got {value!r}")
        if self.positive and not value > 0:
            raise ConfigError(f"must be greater than zero, got {format_duration(value)!r}")
        if self.at_most is not None and value > self.at_most:
            raise ConfigError(f"must be at most {self.at_most:g} s, got {format_duration(value)!r}")

    def write(self, value: float) -> TomlValue:
        return format_duration(value)


@attrs.frozen
class Size(Kind[int]):
    """Bytes, written as in ``spool.config.units``."""

    low: int = 0
    high: int | None = None
    positive: bool = False

    def what(self) -> str:
        if self.high is not None:
            return f"size {human_size(self.low)}–{human_size(self.high)}"
        return "size > 0" if self.positive else "size"

    def convert(self, raw: object, base_dir: str | None) -> int:
        return parse_size(raw)

    def check(self, value: int) -> None:
        if self.positive and value <= 0:
            raise ConfigError(f"must be greater than zero, got {value!r}")
        if value < self.low or (self.high is not None and value > self.high):
            high = human_size(self.high) if self.high is not None else "any size"
            raise ConfigError(f"must be between {human_size(self.low)} and {high}, got {format_size(value)!r}")

    def write(self, value: int) -> TomlValue:
        return format_size(value)


@attrs.frozen
class Text(Kind[str]):
    """A string without NUL. ``nonempty``: "" is refused (where it cannot mean anything)."""

    nonempty: bool = False
    def what(self) -> str:
        return "text"

    def convert(self, raw: object, base_dir: str | None) -> str:
        return expect(raw, str, "a string")

    def check(self, value: str) -> None:
        if "\0" in value:
            raise ConfigError("must not contain a NUL character")
        if self.nonempty and not value:
            raise ConfigError("must not be empty")


def resolve_path(path: str, base_dir: str | None) -> str:
    """``path`` made absolute against ``base_dir`` (default: the current directory, now), ``~`` expanded."""
    if "\0" in path:
        raise ConfigError("a path cannot contain a NUL character")
    return os.path.normpath(os.path.join(base_dir or os.getcwd(), os.path.expanduser(path)))


@attrs.frozen
class Path(Kind[str]):
    """A file or directory, made absolute when the config is read, so a later ``chdir`` cannot move it."""

    def what(self) -> str:
        return "path"

    def convert(self, raw: object, base_dir: str | None) -> str:
        text = expect(raw, str, "a string")
        if not text:
            raise ConfigError("must not be empty")
        return resolve_path(text, base_dir)

    def check(self, value: str) -> None:
        if "\0" in value:
            raise ConfigError("a path cannot contain a NUL character")


@attrs.frozen
class OneOf(Kind[str]):
    """One of a few words, in any case; kept in lower case."""

    choices: tuple[str, ...]

    def what(self) -> str:
        return "one of " + ", ".join(self.choices)

    def convert(self, raw: object, base_dir: str | None) -> str:
        return expect(raw, str, "a string").lower()

    def check(self, value: str) -> None:
        if value not in self.choices:
            raise ConfigError(f"must be one of {', '.join(self.choices)}, got {value!r}")


@attrs.frozen
class Optional(Kind[T | None]):
    """Not set is ``None``, spelt ``""`` in the file (as the operator's template does)."""

    kind: Kind[T]

    def what(self) -> str:
        return f'{self.kind.what()}, or "" (not set)'

    def convert(self, raw: object, base_dir: str | None) -> T | None:
        return None if raw == "" else self.kind.convert(raw, base_dir)

    def check(self, value: T | None) -> None:
        if value is not None:
            self.kind.check(value)

    def write(self, value: T | None) -> TomlValue:
        return "" if value is None else self.kind.write(value)


@attrs.frozen
class ListOf(Kind[tuple[T, ...]]):
    """A TOML list of one kind; an item's problem is named by its index (``key[2]``).

    ``least``: how many items at least (with the problem ``needed`` when there
    are fewer); ``rule``: a check of the whole list, returning a problem or None.
    """

    item: Kind[T]
    least: int = 0
    needed: str = ""
    rule: Callable[[tuple[T, ...]], str | None] | None = None
    rule_text: str = ""

    def what(self) -> str:
        return f"list of {self.item.what()}" + (f" ({self.rule_text})" if self.rule_text else "")

    def convert(self, raw: object, base_dir: str | None) -> tuple[T, ...]:
        items = expect(raw, list, "a list")
        result = []
        for i, item in enumerate(items):
            try:
                result.append(self.item.read(item, base_dir))
            except ConfigError as e:
                raise ConfigError(e.problem, key=f"[{i}]") from None
        return tuple(result)

    def check(self, value: tuple[T, ...]) -> None:
        for i, item in enumerate(value):
            try:
                self.item.check(item)
            except ConfigError as e:
                raise ConfigError(e.problem, key=f"[{i}]") from None
        if len(value) < self.least:
            raise ConfigError(self.needed or f"at least {self.least} needed")
        if self.rule is not None and (problem := self.rule(value)):
            raise ConfigError(problem)

    def write(self, value: tuple[T, ...]) -> TomlValue:
        return [self.item.write(item) for item in value]


class Resolver(Protocol):
    """What a derived default may look at: the effective value of another setting, by dotted key."""

    base_dir: str | None

    def __call__(self, key: str) -> Any: ...


@attrs.frozen
class Derived:
    """A default computed from other settings when the config is read; ``text`` states it for the docs."""

    text: str
    compute: Callable[[Resolver], Any]


@attrs.frozen
class Setting(Generic[T]):
    """One setting's whole definition. ``name`` is its field's (filled in by ``settings_of``).

    ``in_file``: read from the config file (else the engine's tuning, set in
    code and by benchmarks only); ``unit``: what a bare number means, where
    the kind does not say it; ``blank_is_default``: ``""`` in the file means
    the default (for the derived ones an operator may want to spell out).
    """

    kind: Kind[T]
    help: str
    default: T | None = None
    derived: Derived | None = None
    in_file: bool = True
    unit: str = ""
    blank_is_default: bool = False
    name: str = ""

    def default_for(self, resolve: Resolver) -> T:
        """The value when the file does not set it."""
        if self.derived is not None:
            value: T = self.derived.compute(resolve)
            return value
        return self.default  # type: ignore[return-value]


def setting(kind: Kind[T], help: str, default: T | None = None, *, derived: Derived | None = None,
            in_file: bool = True, unit: str = "", blank_is_default: bool = False,
            converter: Callable[[Any], T] | None = None) -> Any:
    """An attrs field that carries its definition and checks its value with ``kind``.

    With ``derived`` the field has no default of its own and must be given by
    keyword (the loader computes it); its value is checked when it is read
    from the file, not when it is derived, so a default follows the value it
    comes from as it always did (``postmaster@<hostname>`` for a host name
    that is no mail domain).
    """
    definition = Setting(kind, help, default, derived, in_file, unit, blank_is_default)

    def validate(instance: object, attribute: attrs.Attribute[T], value: T) -> None:
        try:
            kind.check(value)
        except ConfigError as e:
            raise e.at(attribute.name) from None

    metadata = {METADATA_KEY: definition}
    if derived is not None:
        return attrs.field(converter=converter, metadata=metadata, kw_only=True)
    return attrs.field(default=default, validator=validate, converter=converter, metadata=metadata)


def settings_of(cls: type) -> Sequence[Setting[Any]]:
    """The settings a class declares, in field order, each with its name."""
    return tuple(attrs.evolve(field.metadata[METADATA_KEY], name=field.name)
                 for field in attrs.fields(cls) if METADATA_KEY in field.metadata)
