"""What ``spoolctl verify`` reports: the problems it found and what the relay will do about them.

Apart from the verifier (``spool.tools.verify``) and the plan (``spool.tools.start_plan``) because both
build it: the verifier fills in the findings, the plan reads them and adds the relay's actions.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs

from spool.format import checkpoint as ckpt
from spool.format.record import RecordType, format_pos
from spool.read.anomaly import Anomaly, Kind
from spool.read.lost import LostMessage

NAMES_SHOWN = 20  # lost messages named per action in the text (all of them in --json)


@attrs.frozen
class Action:
    """One thing the relay will do: ``when`` ("start" or "later"), ``what`` (cut, quarantine, known,
    checkpoint, scan, new segment, refuse), in words, with the damage and the messages it lost."""

    when: str
    what: str
    text: str
    anomaly: Anomaly | None = None
    lost: tuple[LostMessage, ...] = ()

    def describe(self) -> str:
        head = "at start:" if self.when == "start" else "later:   "
        lines = [f"{head} {self.text}"]
        lines += [f"            lost: {m.describe()}" for m in self.lost[:NAMES_SHOWN]]
        if len(self.lost) > NAMES_SHOWN:
            lines.append(f"            ... and {len(self.lost) - NAMES_SHOWN} more (spoolctl verify --json)")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"when": self.when, "what": self.what, "text": self.text,
                "damage": None if self.anomaly is None else self.anomaly.as_dict(),
                "lost": [m.as_dict() for m in self.lost]}


@attrs.frozen
class Problem:
    kind: str  # "damage", "payload", "reference", "segment", "checkpoint"
    message: str
    pos: int | None = None
    path: str = ""
    offset: int | None = None
    anomaly: Kind | None = None  # the reader's classification, for problems that are anomalies of the log

    @classmethod
    def of(cls, a: Anomaly) -> Problem:
        kind = {Kind.MISSING_SEGMENT: "segment", Kind.BAD_PAYLOAD: "payload"}.get(a.kind, "damage")
        if a.kind in (Kind.MISSING_SEGMENT, Kind.BAD_PAYLOAD):
            message = a.reason
        elif a.kind is Kind.DAMAGED_RECORD:
            message = a.reason + (f"; valid records resume at offset {a.resume}" if a.resume is not None
                                  else "; nothing valid follows in this segment")
        else:
            message = f"{a.kind.value}: {a.reason}"
        return cls(kind, message, a.pos, a.path, a.offset, a.kind)

    def describe(self) -> str:
        where = f"{self.path} at offset {self.offset}: " if self.path and self.offset is not None else (
            f"{self.path}: " if self.path else "")
        at = f"{format_pos(self.pos)} " if self.pos is not None else ""
        return f"{self.kind:<10} {at}{where}{self.message}"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "position": None if self.pos is None else format_pos(self.pos),
                "file": self.path or None, "offset": self.offset, "message": self.message,
                "anomaly": None if self.anomaly is None else self.anomaly.name.lower()}


@attrs.define
class VerifyReport:
    segments: int = 0
    records: int = 0
    by_type: Counter[str] = attrs.field(factory=Counter)
    references: int = 0
    reclaimed_references: int = 0
    problems: list[Problem] = attrs.field(factory=list)
    problems_total: int = 0
    torn_tail: Anomaly | None = None
    log_end: int = 0
    # For what the relay will do at start (``spool.tools.start_plan``): the checkpoint (None: missing or damaged,
    # ``checkpoint_error`` says which), the reader's anomalies (capped like the problems), and how far each
    # segment holds a garbage-marked envelope (a mark proves the log durable up to it).
    checkpoint: ckpt.Checkpoint | None = None
    checkpoint_error: str | None = None
    anomalies: list[Anomaly] = attrs.field(factory=list)
    marked_end: dict[int, int] = attrs.field(factory=dict)
    plan: list[Action] = attrs.field(factory=list)  # what the relay will do (spool.tools.start_plan)

    @property
    def clean(self) -> bool:
        return self.problems_total == 0

    def as_dict(self) -> dict[str, Any]:
        return {"clean": self.clean, "segments": self.segments, "records": self.records,
                "by_type": {t.name: self.by_type.get(t.name, 0) for t in RecordType},
                "references": self.references, "reclaimed_references": self.reclaimed_references,
                "log_end": format_pos(self.log_end),
                "torn_tail": None if self.torn_tail is None else self.torn_tail.as_dict(),
                "problems_total": self.problems_total, "problems": [p.as_dict() for p in self.problems],
                "relay_will": [a.as_dict() for a in self.plan]}
