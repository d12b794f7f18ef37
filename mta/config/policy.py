"""``[policy]``: the policy servers asked over Postfix's delegation protocol, in order, and what a failure costs.

A server is ``inet:HOST:PORT`` or ``unix:PATH``, as Postfix's
``check_policy_service`` names it. The stages are ``rcpt`` (each recipient,
``protocol_state=RCPT``) and ``data`` (the end of the message,
``protocol_state=END-OF-MESSAGE``); each server is asked at every stage
listed. What each action does is in docs/operations.md, "Policy servers".
"""

from __future__ import annotations

import attrs

from mta.config.values import parse_listen_address, text_of
from spool import Boolean, ConfigError, Duration, Kind, ListOf, OneOf, TomlValue, resolve_path, setting

__all__ = ["STAGES", "PolicyAddress", "PolicySection", "PolicyServer"]

STAGES = ("rcpt", "data")
MAX_UNIX_PATH = 107  # sun_path, less its NUL


@attrs.frozen
class PolicyAddress:
    """Where one policy server listens: a TCP ``host``/``port``, or a unix socket ``path``."""

    host: str = ""
    port: int = 0
    path: str = ""

    def __str__(self) -> str:
        if self.path:
            return f"unix:{self.path}"
        return f"inet:[{self.host}]:{self.port}" if ":" in self.host else f"inet:{self.host}:{self.port}"


@attrs.frozen
class PolicyServer(Kind[PolicyAddress]):
    def what(self) -> str:
        return "`inet:HOST:PORT` or `unix:PATH`"

    def convert(self, raw: object, base_dir: str | None) -> PolicyAddress:
        text = text_of(raw)
        kind, colon, rest = text.partition(":")
        if colon and kind == "inet":
            where = parse_listen_address(rest)
            if where.port == 0:
                raise ConfigError(f"{text!r} needs a port other than 0")
            return PolicyAddress(host=where.host, port=where.port)
        if colon and kind == "unix" and rest:
            return PolicyAddress(path=resolve_path(rest, base_dir))
        raise ConfigError(f"not a policy server: {text!r} (expected inet:HOST:PORT or unix:PATH)")

    def check(self, value: PolicyAddress) -> None:
        if len(value.path.encode()) > MAX_UNIX_PATH:
            raise ConfigError(f"the socket path is over {MAX_UNIX_PATH} bytes: {value.path!r}")

    def write(self, value: PolicyAddress) -> TomlValue:
        return str(value)


def _no_repeats(stages: tuple[str, ...]) -> str | None:
    return "a stage is named twice" if len(set(stages)) != len(stages) else None


@attrs.frozen(kw_only=True)
class PolicySection:
    """``[policy]``: policy delegation (see "Policy servers" in docs/operations.md)."""

    servers: tuple[PolicyAddress, ...] = setting(
        ListOf(PolicyServer()), "policy servers, asked in this order (the first that decides ends the asking); "
        "none: off", ())
    stages: tuple[str, ...] = setting(
        ListOf(OneOf(STAGES), rule=_no_repeats, rule_text="each once"),
        "when they are asked: `rcpt` (each recipient) and `data` (the end of the message)", ("rcpt",))
    timeout: float = setting(
        Duration(positive=True), "one request: connecting and the whole reply; over it, the failure default", 10.0)
    on_failure: str = setting(
        OneOf(("tempfail", "dunno")), "a server down, slow, broken, or answering an action the relay does not "
        "carry out: `tempfail` (`451 4.3.5`, as Postfix's smtpd_policy_service_default_action) or `dunno` (ask "
        "the next, as if it had no opinion)", "tempfail")
    max_idle: float = setting(
        Duration(positive=True), "a connection kept for the next request is closed after this long unused "
        "(Postfix's smtpd_policy_service_max_idle)", 300.0)
    skip_trusted: bool = setting(
        Boolean(), "clients in `[relay] mynetworks` and authenticated sessions are not asked (Postfix's usual "
        "permit_mynetworks, permit_sasl_authenticated before check_policy_service)", True)
