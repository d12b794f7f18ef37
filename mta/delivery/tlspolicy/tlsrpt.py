"""TLS reporting (RFC 8460): each session under a policy counted, and written out as daily JSON reports.

Theory of operation
-------------------
Each new connection made under an MTA-STS or DANE policy (``plan.HopTls``
with a ``report`` reference) ends in one ``record``: a success, or a failure
with RFC 8460's result type (``starttls-not-supported``,
``certificate-host-mismatch``, ``certificate-not-trusted``,
``validation-failure``, ``sts-policy-fetch-error``, ...). A record is one
JSON line appended to the day's journal, ``<spool.dir>/tls-report/DAY.jsonl``
(UTC days), so the counts survive a restart with no shutdown path. Journal
lines are not fsynced: a power cut may lose the last few counts of a report,
never a message.

Once a day has ended (at start, and after each UTC midnight) its journal is
rolled up: one report per policy domain, written atomically into
``[tls_policy] report_dir`` as ``ORG!DOMAIN!BEGIN!END!ID.json`` (RFC 8460
§5.3's naming; ``ID`` tells the spool shards apart), then the journal is
removed. A crash between the two writes the same reports again, byte for
byte, from the same journal. Sending the reports to the domains' ``rua``
is not done here.
"""

from __future__ import annotations

import collections
import datetime as dt
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import trio

from mta.observe.logline import event

log = logging.getLogger("mta.tlspolicy")

JOURNAL_SUFFIX = ".jsonl"


@attrs.frozen
class PolicyRef:
    """The policy a session was made under, as the report names it (RFC 8460 §4.4 ``policy``)."""

    kind: str  # "sts" or "tlsa"
    domain: str
    strings: tuple[str, ...] = ()
    mx_host: tuple[str, ...] = ()


def _day(moment: float) -> str:
    return dt.datetime.fromtimestamp(moment, dt.UTC).strftime("%Y-%m-%d")


class Reporter:
    """Counts sessions into the day's journal and rolls finished days up into reports."""

    def __init__(self, journal_dir: str, report_dir: str, organization: str, contact: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.journal_dir = journal_dir
        self.report_dir = report_dir
        self.organization = organization
        self.contact = contact
        self.clock = clock
        # The shard's journal directory names its reports, so shards never write over each other's.
        self.unique = hashlib.sha256(os.path.abspath(journal_dir).encode()).hexdigest()[:8]

    def record(self, ref: PolicyRef, *, result: str | None, mx_host: str, address: str, local: str = "",
               detail: str = "") -> None:
        """One session: ``result`` None for a success, else its RFC 8460 result type."""
        line = {"kind": ref.kind, "domain": ref.domain, "policy": list(ref.strings), "mx_host": list(ref.mx_host),
                "result": result, "mx": mx_host, "ip": address, "local": local, "detail": detail[:300]}
        try:
            os.makedirs(self.journal_dir, mode=0o700, exist_ok=True)
            path = os.path.join(self.journal_dir, _day(self.clock()) + JOURNAL_SUFFIX)
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a", encoding="utf-8") as f:
                f.write(json.dumps(line, sort_keys=True) + "\n")
        except OSError as exc:  # a report is worth less than the delivery it describes
            event(log, "tls_report", None, error=str(exc), level=logging.WARNING)

    def roll_up(self) -> list[str]:
        """Reports for every journal of a day before today; the paths written."""
        today = _day(self.clock())
        try:
            names = sorted(os.listdir(self.journal_dir))
        except FileNotFoundError:
            return []
        written: list[str] = []
        for name in names:
            day = name.removesuffix(JOURNAL_SUFFIX)
            if not name.endswith(JOURNAL_SUFFIX) or day >= today:
                continue
            path = os.path.join(self.journal_dir, name)
            try:
                start = dt.datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=dt.UTC)
            except ValueError:
                continue
            with open(path, encoding="utf-8") as f:
                lines = list(_lines(f))
            by_domain: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
            for line in lines:
                by_domain[str(line["domain"])].append(line)
            os.makedirs(self.report_dir, exist_ok=True)
            for domain, records in sorted(by_domain.items()):
                written.append(self._write(domain, start, records))
            os.unlink(path)
            event(log, "tls_report", None, day=day, reports=len(by_domain), sessions=len(lines))
        return written

    def report(self, domain: str, start: dt.datetime, records: list[dict[str, Any]]) -> dict[str, Any]:
        """RFC 8460 §4.4's report of one policy domain for the day that begins at ``start``."""
        end = start + dt.timedelta(days=1) - dt.timedelta(seconds=1)
        policies: dict[tuple[Any, ...], list[dict[str, Any]]] = collections.defaultdict(list)
        for r in records:
            policies[(r["kind"], tuple(r["policy"]), tuple(r["mx_host"]))].append(r)
        out = []
        for (kind, strings, mx_host), rs in sorted(policies.items()):
            failures: collections.Counter[tuple[str, str, str, str, str]] = collections.Counter(
                (r["result"], r["local"], r["mx"], r["ip"], r["detail"]) for r in rs if r["result"])
            policy: dict[str, Any] = {"policy-type": kind, "policy-string": list(strings), "policy-domain": domain}
            if mx_host:
                policy["mx-host"] = list(mx_host)
            out.append({
                "policy": policy,
                "summary": {"total-successful-session-count": sum(1 for r in rs if not r["result"]),
                            "total-failure-session-count": sum(failures.values())},
                "failure-details": [_failure(result, local, mx, ip, detail, n)
                                    for (result, local, mx, ip, detail), n in sorted(failures.items())],
            })
        return {
            "organization-name": self.organization,
            "date-range": {"start-datetime": start.strftime("%Y-%m-%dT%H:%M:%SZ"),
                           "end-datetime": end.strftime("%Y-%m-%dT%H:%M:%SZ")},
            "contact-info": self.contact,
            "report-id": f"{start:%Y-%m-%d}.{domain}.{self.unique}@{self.organization}",
            "policies": out,
        }

    def _write(self, domain: str, start: dt.datetime, records: list[dict[str, Any]]) -> str:
        begin = int(start.timestamp())
        name = f"{self.organization}!{domain}!{begin}!{begin + 86400}!{self.unique}.json"
        path = os.path.join(self.report_dir, name)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.report(domain, start, records), f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Roll up at start, then just after each UTC midnight."""
        task_status.started()
        while True:
            try:
                await trio.to_thread.run_sync(self.roll_up)
            except OSError as exc:
                event(log, "tls_report", None, error=str(exc), level=logging.WARNING)
            now = self.clock()
            await trio.sleep(86400 - now % 86400 + 60)


def _failure(result: str, local: str, mx: str, ip: str, detail: str, n: int) -> dict[str, Any]:
    """One ``failure-details`` entry; RFC 8460 §4.3 makes the IP fields addresses, so one no session had (an MX
    skipped by policy, a failed TLSA lookup) is left out rather than written empty."""
    entry: dict[str, Any] = {"result-type": result, "failed-session-count": n, "failure-reason-code": detail}
    if local:
        entry["sending-mta-ip"] = local
    if mx:
        entry["receiving-mx-hostname"] = mx
    if ip:
        entry["receiving-ip"] = ip
    return entry


def _lines(f: Any) -> Iterator[dict[str, Any]]:
    """The journal's records; a line cut short by a crash (or otherwise unreadable) is skipped."""
    for text in f:
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if isinstance(line, dict) and {"kind", "domain", "policy", "mx_host", "result", "mx", "ip", "local",
                                       "detail"} <= line.keys():
            yield line
