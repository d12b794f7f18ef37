"""``[dkim]``: which header fields are signed, and the signing keys (``[[dkim.key]]``, one table per key).

The section's own settings (``headers``, ``oversign``) are defined like every
other section's; the keys are an array of tables, each read with the settings
of ``DkimKey``, so an entry's unknown key or bad value is named
``dkim.key[1].selector`` like any other. The key files themselves are read
at start (``mta.dkim.keys``): a file the config names but the relay cannot
use stops the start, in one line naming the domain and the file.

Rules that span keys: a domain has at most two keys (two selectors: the
current and the next while a key is rotated, or an RSA and an Ed25519 key
side by side, RFC 8463 §4), and no (domain, selector) twice.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs

from mta.config.routes import check_domain
from mta.config.values import text_of
from spool import Boolean, ConfigError, Kind, ListOf, Path, expect, setting, settings_of, type_name

__all__ = ["DEFAULT_HEADERS", "MAX_KEYS_PER_DOMAIN", "DkimKey", "DkimSection", "parse_dkim_keys"]

# RFC 6376 §5.4.1's recommended fields and the list headers receivers look at (RFC 8058's one-click
# unsubscribe above all); each is signed as many times as the message has it, and only if it has it.
DEFAULT_HEADERS = (
    "From", "Reply-To", "Subject", "Date", "To", "Cc", "Message-ID", "In-Reply-To", "References", "Sender",
    "MIME-Version", "Content-Type", "Content-Transfer-Encoding", "Resent-Date", "Resent-From", "Resent-To",
    "Resent-Cc", "List-Id", "List-Unsubscribe", "List-Unsubscribe-Post",
)
# Fields a signer must not sign (RFC 6376 §5.4: trace fields change in transit; Bcc is removed); dkimpy refuses them.
NOT_SIGNED = ("return-path", "received", "comments", "keywords", "bcc", "resent-bcc", "dkim-signature")
MAX_KEYS_PER_DOMAIN = 2
_FIELD_NAME = re.compile(r"[!-9;-~]+")  # RFC 5322 §3.6.8: printable ASCII but the colon
# RFC 6376 §3.1: a selector is one or more dot-separated labels (letters, digits, hyphens inside).
_SELECTOR = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}"
                       r"[A-Za-z0-9])?)*")


@attrs.frozen
class HeaderName(Kind[str]):
    """A header field name as the operator spelt it (compared without regard to case)."""

    def what(self) -> str:
        return "header field name"

    def convert(self, raw: object, base_dir: str | None) -> str:
        return text_of(raw)

    def check(self, value: str) -> None:
        if not _FIELD_NAME.fullmatch(value):
            raise ConfigError(f"{value!r} is not a header field name")
        if value.lower() in NOT_SIGNED:
            raise ConfigError(f"{value} must not be signed (RFC 6376 §5.4: it changes in transit or is removed)")


@attrs.frozen
class MailDomain(Kind[str]):
    """One domain (no ``.domain`` wildcard): the ``d=`` of a signature; kept in lower case."""

    def what(self) -> str:
        return "domain"

    def convert(self, raw: object, base_dir: str | None) -> str:
        text = text_of(raw)
        if text.startswith("."):
            raise ConfigError(f"{text!r} is not one domain (a key signs for exactly the domain it names)")
        try:
            return check_domain(text)
        except ConfigError:
            raise ConfigError(f"{text!r} is not a domain") from None

    def check(self, value: str) -> None:
        if value.startswith(".") or check_domain(value) != value:
            raise ConfigError(f"{value!r} is not a domain in lower case without a final dot")


@attrs.frozen
class Selector(Kind[str]):
    def what(self) -> str:
        return "selector (DNS labels)"

    def convert(self, raw: object, base_dir: str | None) -> str:
        return text_of(raw)

    def check(self, value: str) -> None:
        if not _SELECTOR.fullmatch(value) or len(value) > 200:
            raise ConfigError(f"{value!r} is not a selector (letters, digits and hyphens, dot-separated labels)")


def _has_from(headers: tuple[str, ...]) -> str | None:
    return None if any(h.lower() == "from" for h in headers) else "must include From (RFC 6376 §5.4)"


@attrs.frozen(kw_only=True)
class DkimSection:
    """``[dkim]``: what is signed. The keys are ``[[dkim.key]]`` tables (``DkimKey``)."""

    headers: tuple[str, ...] = setting(
        ListOf(HeaderName(), rule=_has_from, rule_text="From among them"),
        "header fields signed, each as often as the message has it (fields it lacks are not signed)",
        DEFAULT_HEADERS)
    oversign: tuple[str, ...] = setting(
        ListOf(HeaderName()),
        "fields listed in the signature once more than the message has them, so that one added in transit breaks "
        "the signature (RFC 6376 §8.15)", ("From",))


@attrs.frozen(kw_only=True)
class DkimKey:
    """``[[dkim.key]]``: one signing key. Its algorithm (RSA or Ed25519) is the key file's."""

    domain: str = setting(MailDomain(), "the signing domain (`d=`): mail whose From: is at this domain is signed")
    selector: str = setting(Selector(), "the selector (`s=`): the key is published at "
                                        "`SELECTOR._domainkey.DOMAIN` (`mta dkim keygen` prints the record)")
    key_file: str = setting(Path(), "the private key: PEM (RSA of 1024 bits or more, or Ed25519), or an Ed25519 "
                                    "key as base64 of its 32 bytes; mode 0600 or 0400")
    active: bool = setting(Boolean(), "`false`: loaded and checked at start but not used to sign (the next key "
                                      "of a rotation, published and waiting)", True)


REQUIRED = ("domain", "selector", "key_file")


def parse_dkim_keys(raw: object, base_dir: str | None) -> tuple[tuple[DkimKey, ...], list[ConfigError]]:
    """The ``[[dkim.key]]`` tables: the keys read, and the problems found, each named ``key[i].name``."""
    problems: list[ConfigError] = []
    try:
        entries = expect(raw, list, "an array of tables ([[dkim.key]])")
    except ConfigError as e:
        return (), [e.at("key")]
    keys: list[tuple[int, DkimKey]] = []  # with its index in the file, for the problems' names
    for i, entry in enumerate(entries):
        where = f"key[{i}]"
        if not isinstance(entry, dict):
            problems.append(ConfigError(f"expected a table, got {type_name(entry)} {entry!r}").at(where))
            continue
        key = _one_key(entry, base_dir, where, problems)
        if key is not None:
            keys.append((i, key))
    problems += _rules(keys)
    return tuple(key for _, key in keys), problems


def _one_key(entry: Mapping[str, Any], base_dir: str | None, where: str,
             problems: list[ConfigError]) -> DkimKey | None:
    values: dict[str, Any] = {}
    known = settings_of(DkimKey)
    before = len(problems)
    for s in known:
        if s.name in entry:
            try:
                values[s.name] = s.kind.read(entry[s.name], base_dir)
            except ConfigError as e:
                problems.append(e.at(f"{where}.{s.name}"))
        elif s.name in REQUIRED:
            problems.append(ConfigError("is required").at(f"{where}.{s.name}"))
    problems.extend(ConfigError("unknown key").at(f"{where}.{name}")
                    for name in sorted(set(entry) - {s.name for s in known}))
    if len(problems) > before:
        return None
    return DkimKey(**values)


def _rules(keys: list[tuple[int, DkimKey]]) -> list[ConfigError]:
    problems: list[ConfigError] = []
    seen: dict[tuple[str, str], int] = {}
    per_domain: dict[str, int] = {}
    for i, key in keys:
        if (key.domain, key.selector.lower()) in seen:
            problems.append(ConfigError(f"selector {key.selector!r} of {key.domain} is already key "
                                        f"[{seen[key.domain, key.selector.lower()]}]").at(f"key[{i}].selector"))
        seen.setdefault((key.domain, key.selector.lower()), i)
        per_domain[key.domain] = per_domain.get(key.domain, 0) + 1
        if per_domain[key.domain] == MAX_KEYS_PER_DOMAIN + 1:
            problems.append(ConfigError(f"{key.domain} has more than {MAX_KEYS_PER_DOMAIN} keys (two selectors: "
                                        "the current one and the next)").at(f"key[{i}].domain"))
    return problems
