"""``[bounce_classes]``: the operator's bounce-class rules, before (or instead of) the shipped ones.

The file is read and checked when the config is: a rule that cannot be used
stops ``mta config check`` and the start in one line naming the file and
the rule (``mta.bounce_class.rules``).
"""

from __future__ import annotations

import attrs

from mta.bounce_class import RulesError, load_file
from mta.config.values import ReadableFile
from spool import Boolean, ConfigError, Optional, setting

__all__ = ["BounceClassesSection", "RulesFile"]


@attrs.frozen
class RulesFile(ReadableFile):
    """A readable bounce-class rules file whose every rule can be used."""

    def what(self) -> str:
        return "path of a rules file ([[rule]] tables: class, code, enhanced, text)"

    def check(self, value: str) -> None:
        super().check(value)
        try:
            load_file(value)
        except RulesError as exc:
            where = f"{exc.key}: " if exc.key else ""
            raise ConfigError(f"{value}: {where}{exc.problem}") from None


@attrs.frozen(kw_only=True)
class BounceClassesSection:
    """``[bounce_classes]`` (see "Bounce classes" in docs/operations.md)."""

    rules_file: str | None = setting(
        Optional(RulesFile()), "the operator's rules, tried before the shipped ones (the first rule that matches "
        "gives the class); not set, the shipped rules alone")
    defaults: bool = setting(
        Boolean(), "`false`: the shipped rules are not used, only `rules_file` (an outcome it does not match is "
        "`other`)", True)
