"""MTA-STS (RFC 8461): the TXT record, the policy file, MX patterns, and the on-disk policy cache.

A domain publishes ``_mta-sts.DOMAIN IN TXT "v=STSv1; id=20240101T000000;"``
and, at ``https://mta-sts.DOMAIN/.well-known/mta-sts.txt``, its policy::

    version: STSv1
    mode: enforce
    mx: mail.example.com
    mx: *.example.net
    max_age: 604800

``Policies.lookup`` gives the policy in force for a domain (RFC 8461 §5.1):
the cached one while its TXT id is unchanged and its ``max_age`` has not run
out; a new fetch when the id changes (the cached one stays in force if that
fetch fails); the cached one when the TXT record is gone or its lookup fails
(an attacker who blocks DNS must not switch the policy off). A policy is kept
in ``[tls_policy] mta_sts_cache``, one JSON file per domain written
atomically and fsynced, so a restart keeps the protection it gave.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable

import attrs
import dns.asyncresolver
import dns.exception
import dns.resolver
import trio

from mta.delivery.tlspolicy.fetch import FetchError, fetch_policy
from mta.observe.logline import event

log = logging.getLogger("mta.tlspolicy")

MAX_AGE_LIMIT = 31557600  # RFC 8461 §3.2: max_age is at most a year
_ID = re.compile(r"[A-Za-z0-9]{1,32}")
_MODES = ("enforce", "testing", "none")


class PolicyInvalid(ValueError):
    """A policy file or TXT record that RFC 8461 does not allow (TLS-RPT: ``sts-policy-invalid``)."""


@attrs.frozen
class Policy:
    """A parsed policy. ``text`` is what was served (the report's ``policy-string``)."""

    mode: str
    max_age: int
    mx: tuple[str, ...]
    text: str

    def matches(self, host: str) -> bool:
        """Whether MX ``host`` is one the policy names (RFC 8461 §4.1: ``*.`` stands for one leftmost label)."""
        return any(mx_matches(pattern, host) for pattern in self.mx)

    def lines(self) -> list[str]:
        """The policy's lines, as TLS-RPT's ``policy-string`` lists them."""
        return [line.strip() for line in self.text.splitlines() if line.strip()]


def mx_matches(pattern: str, host: str) -> bool:
    pattern = pattern.rstrip(".").lower()
    host = host.rstrip(".").lower()
    if pattern.startswith("*."):
        first, dot, rest = host.partition(".")
        return bool(first) and bool(dot) and rest == pattern[2:]
    return pattern == host


def parse_policy(text: str) -> Policy:
    """RFC 8461 §3.2: ``key: value`` lines (CRLF or LF); unknown keys are ignored. Raises PolicyInvalid."""
    fields: list[tuple[str, str]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        key, colon, value = line.partition(":")
        if not colon:
            raise PolicyInvalid(f"not a 'key: value' line: {line[:80]!r}")
        fields.append((key.strip().lower(), value.strip()))
    if not fields or fields[0] != ("version", "STSv1"):
        raise PolicyInvalid("the first line must be 'version: STSv1'")
    values = dict(fields)
    mode = values.get("mode", "")
    if mode not in _MODES:
        raise PolicyInvalid(f"mode must be one of {', '.join(_MODES)}, got {mode[:40]!r}")
    age = values.get("max_age", "")
    if not age.isdigit() or len(age) > 10 or int(age) > MAX_AGE_LIMIT:
        raise PolicyInvalid(f"max_age must be a whole number of seconds up to {MAX_AGE_LIMIT}, got {age[:40]!r}")
    mx = tuple(v.lower() for k, v in fields if k == "mx")
    if mode != "none" and not mx:
        raise PolicyInvalid(f"a policy in mode {mode} must name its MX hosts (mx: ...)")
    return Policy(mode, int(age), mx, text)


def parse_txt(strings: list[str]) -> str | None:
    """The policy id of the ``_mta-sts`` TXT records, None if there is no STSv1 record. Raises PolicyInvalid.

    RFC 8461 §3.1: records not starting ``v=STSv1`` are ignored; more than one
    that does is as if there were none... but an attacker can add none, so
    this says "invalid" and the cached policy stays.
    """
    records = [s for s in strings if s.startswith("v=STSv1")]
    if not records:
        return None
    if len(records) > 1:
        raise PolicyInvalid("more than one v=STSv1 TXT record")
    fields = dict(part.strip().partition("=")[::2] for part in records[0].split(";") if part.strip())
    policy_id = fields.get("id", "")
    if not _ID.fullmatch(policy_id):
        raise PolicyInvalid(f"the TXT record's id must be 1-32 letters and digits, got {policy_id[:40]!r}")
    return policy_id


@attrs.frozen
class Cached:
    """A policy as kept on disk: its TXT id and when it was fetched (seconds since the epoch)."""

    domain: str
    policy_id: str
    fetched: float
    policy: Policy

    def fresh(self, now: float) -> bool:
        return now < self.fetched + self.policy.max_age


@attrs.frozen
class Lookup:
    """What ``Policies.lookup`` found: the policy in force (if any), and a fetch or parse failure to report.

    ``failure`` is TLS-RPT's result type (``sts-policy-fetch-error``,
    ``sts-policy-invalid``, ``sts-webpki-invalid``) with ``detail`` in words.
    """

    policy: Policy | None
    failure: str | None = None
    detail: str = ""


class PolicyCache:
    """Policies on disk: ``DIR/<domain>.json``, each replaced atomically and fsynced. A bad file counts as absent."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def _path(self, domain: str) -> str:
        return os.path.join(self.directory, f"{domain}.json")

    def load(self, domain: str) -> Cached | None:
        try:
            with open(self._path(domain), encoding="utf-8") as f:
                data = json.load(f)
            return Cached(domain, str(data["id"]), float(data["fetched"]), parse_policy(str(data["policy"])))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            event(log, "mta_sts_cache", None, domain=domain, ignored=str(exc)[:200], level=logging.WARNING)
            return None

    def store(self, cached: Cached) -> None:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        path = self._path(cached.domain)
        tmp = f"{path}.tmp"
        data = {"domain": cached.domain, "id": cached.policy_id, "fetched": cached.fetched,
                "policy": cached.policy.text}
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Policies:
    """The MTA-STS policy in force for each domain: TXT id, cache, fetch (module docstring)."""

    def __init__(self, resolver: dns.asyncresolver.Resolver, cache_dir: str, *, port: int = 443,
                 timeout: float = 30.0, ca_file: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.resolver = resolver
        self.cache = PolicyCache(cache_dir)
        self.port = port
        self.timeout = timeout
        self.ca_file = ca_file
        self.clock = clock
        self._memory: dict[str, Cached] = {}
        self._locks: dict[str, trio.Lock] = {}
        self.fetches = 0  # HTTPS fetches made (tests: a cached policy is not fetched again)

    def _cached(self, domain: str) -> Cached | None:
        if domain not in self._memory:
            found = self.cache.load(domain)
            if found is None:
                return None
            self._memory[domain] = found
        return self._memory[domain]

    async def _txt(self, domain: str) -> tuple[str | None, str]:
        """The TXT id, or (None, why not): no record, a lookup failure, a bad record."""
        try:
            answer = await self.resolver.resolve(f"_mta-sts.{domain}", "TXT", search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return None, ""
        except dns.exception.DNSException as exc:
            return None, f"TXT lookup of _mta-sts.{domain} failed: {exc}"
        strings = [b"".join(r.strings).decode("utf-8", "replace") for r in answer]
        try:
            return parse_txt(strings), ""
        except PolicyInvalid as exc:
            return None, f"_mta-sts.{domain}: {exc}"

    async def lookup(self, domain: str) -> Lookup:
        """The policy in force for ``domain`` (None: deliver as if there were none).

        Never raises for what the domain's servers do: a failure is in the answer's ``failure``.
        """
        domain = domain.rstrip(".").lower()
        lock = self._locks.setdefault(domain, trio.Lock())
        async with lock:  # one fetch per domain at a time; the others then find it cached
            return await self._lookup(domain)

    async def _lookup(self, domain: str) -> Lookup:
        now = self.clock()
        cached = self._cached(domain)
        if cached is not None and not cached.fresh(now):
            cached = None
        policy_id, problem = await self._txt(domain)
        if policy_id is None:
            kept = cached.policy if cached is not None else None
            return Lookup(kept, "sts-policy-invalid" if problem and "TXT lookup" not in problem else None, problem)
        if cached is not None and cached.policy_id == policy_id:
            return Lookup(cached.policy)
        self.fetches += 1
        try:
            with trio.fail_after(self.timeout):
                text = await fetch_policy(self.resolver, domain, self.port, self.ca_file)
            policy = parse_policy(text)
        except trio.TooSlowError:
            return self._failed(domain, cached, "sts-policy-fetch-error", f"timed out after {self.timeout:g} s")
        except FetchError as exc:
            return self._failed(domain, cached, exc.result, str(exc))
        except PolicyInvalid as exc:
            return self._failed(domain, cached, "sts-policy-invalid", str(exc))
        fresh = Cached(domain, policy_id, now, policy)
        self._memory[domain] = fresh
        try:
            await trio.to_thread.run_sync(self.cache.store, fresh)
        except OSError as exc:  # the policy still applies; only a restart forgets it
            event(log, "mta_sts_cache", None, domain=domain, error=str(exc), level=logging.WARNING)
        event(log, "mta_sts", None, domain=domain, id=policy_id, mode=policy.mode, max_age=policy.max_age,
              mx=",".join(policy.mx))
        return Lookup(policy)

    def _failed(self, domain: str, cached: Cached | None, result: str, detail: str) -> Lookup:
        detail = f"MTA-STS policy of {domain}: {detail}"
        event(log, "mta_sts", None, domain=domain, result=result, detail=detail,
              kept="cached" if cached is not None else "none", level=logging.WARNING)
        return Lookup(cached.policy if cached is not None else None, result, detail)
