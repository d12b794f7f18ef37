"""Bounce classes: every outcome that did not deliver gets one (bad-mailbox, mailbox-full, policy, rate-limited,
dns, tls, connection, other), from its reply, by rules shipped with the relay and the operator's own.

``for_config`` gives the classifier a config asks for (cached: every delivery line asks it).
"""

from __future__ import annotations

import functools

from mta.bounce_class.rules import (
    CLASSED,
    CLASSES,
    Classifier,
    Rule,
    RulesError,
    default_rules,
    glob_regex,
    load_file,
    parse_rules,
)

__all__ = ["CLASSED", "CLASSES", "Classifier", "Rule", "RulesError", "classifier_for", "default_rules", "glob_regex",
           "load_file", "parse_rules"]


@functools.cache
def classifier_for(rules_file: str | None = None, defaults: bool = True) -> Classifier:
    """The operator's rules (``rules_file``) before the shipped ones (unless ``defaults`` is false).

    Raises RulesError for a rules file that cannot be used.
    """
    own = load_file(rules_file) if rules_file else ()
    return Classifier(own + (default_rules() if defaults else ()))
