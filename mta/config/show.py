"""``mta config show``: the effective config as TOML that the loader reads back as the same ``Config``.

Every value is written by its setting's kind (``spool.config.settings``), so a
duration comes out as ``"5m"``, a size as ``"10MiB"``, a path absolute, a
derived default (the host name, ``queue_minfree``, ...) as the value it took.
With ``only_changed`` (``-n``, as ``postconf -n``) a setting is left out when
it equals its default, the derived ones judged against the values they follow;
``[routes]`` is written whole or not at all, since a ``[routes]`` table
replaces the default routes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mta.config.dkim import DkimKey
from mta.config.loader import key_name
from mta.config.model import Config
from mta.config.routes import DEFAULT_ROUTES, format_route, parse_route
from mta.config.sections import SECTIONS, file_settings
from spool import TomlValue, settings_of

__all__ = ["show_config", "toml_value"]


def toml_value(value: TomlValue) -> str:
    """One TOML value: a basic string (with escapes), a number, a boolean, an inline list or table of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(_escape(c) for c in value) + '"'
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key_name(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    return "[" + ", ".join(toml_value(item) for item in value) + "]"


def _escape(c: str) -> str:
    if c in '"\\':
        return "\\" + c
    if c < " " or c == "\x7f":  # TOML forbids control characters in a basic string
        return f"\\u{ord(c):04x}"
    return c


class _Effective:
    """A resolver over a built config: what a derived default follows is the value it has now."""

    def __init__(self, config: Config, base_dir: str | None) -> None:
        self.config = config
        self.base_dir = base_dir

    def __call__(self, key: str) -> Any:
        section, name = key.split(".", 1)
        return getattr(getattr(self.config, section), name)


def show_config(config: Config, *, only_changed: bool = False, base_dir: str | None = None) -> str:
    """The TOML text. ``base_dir``: where the defaults' relative paths resolve (as the loader did)."""
    what = "that differ from the defaults" if only_changed else "in effect"
    return f"# mta config show: the settings of {config.source} {what}\n" + "".join(
        _lines(config, only_changed, base_dir))


def _lines(config: Config, only_changed: bool, base_dir: str | None) -> Iterator[str]:
    effective = _Effective(config, base_dir)
    for section, cls in SECTIONS:
        values = getattr(config, section)
        lines = []
        for s in file_settings(cls):
            value = getattr(values, s.name)
            if only_changed and value == s.default_for(effective):
                continue
            lines.append(f"{s.name} = {toml_value(s.kind.write(value))}\n")
        if lines:
            yield f"\n[{section}]\n"
            yield from lines
    for key in config.dkim_keys:
        yield "\n[[dkim.key]]\n"
        for s in settings_of(DkimKey):
            yield f"{s.name} = {toml_value(s.kind.write(getattr(key, s.name)))}\n"
    defaults = {domain: parse_route(route, base_dir) for domain, route in DEFAULT_ROUTES.items()}
    if not only_changed or dict(config.routes) != defaults:
        yield "\n[routes]\n"
        for domain, route in config.routes.items():
            yield f"{key_name(domain)} = {toml_value(format_route(route))}\n"
