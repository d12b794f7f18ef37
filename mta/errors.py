"""Errors of the relay process that are not configuration errors (those are ``spool.errors.ConfigError``).

Here, below every package that raises them, so that no package reaches up into ``mta.process`` for an exception.
"""

from __future__ import annotations


class StartError(OSError):
    """The relay cannot start now for a reason outside its config (exit 1).

    Read as ``FILE: KEY: PROBLEM`` like a ``ConfigError``: the setting whose
    file, address or path is in the way.
    """

    def __init__(self, problem: str, file: str = "", key: str = "") -> None:
        self.file = file
        self.key = key
        self.problem = problem
        super().__init__(": ".join(part for part in (file, key, problem) if part))

    def located(self, file: str) -> StartError:
        return self if self.file else StartError(self.problem, file, self.key)
