"""The message as filters see it, and the one place their changes are made.

Why one place: milters and rspamd's HTTP answer ask for the same kinds of
change (``mta.milter.changes``); whichever asked, the result is what is
stored and delivered. Each filter in a chain sees the message as the ones
before it left it.

Header fields are kept with their raw bytes, so a field no filter touched is
written back exactly as the client sent it. A value is shown to a filter as
milters expect it (Postfix's and sendmail's way): after the colon and the one
space that follows it, folded lines joined by a bare LF; a value a filter
gives back is written with CRLF line ends and a space after the colon.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from mta.milter.changes import (
    AddHeader,
    AddRecipient,
    Change,
    ChangeHeader,
    ChangeSender,
    DeleteRecipient,
    InsertHeader,
    Quarantine,
    ReplaceBody,
)


@attrs.frozen
class Field:
    name: str
    raw: bytes  # the whole field, name to its last CRLF

    @property
    def value(self) -> str:
        """The value as a filter is shown it: after ``name:`` and one space, folding as LF, no final line end."""
        text = self.raw.decode("utf-8", "surrogateescape")[len(self.name) + 1:]
        if text[:1] in (" ", "\t"):
            text = text[1:]
        return text.removesuffix("\r\n").replace("\r\n", "\n")

    @classmethod
    def make(cls, name: str, value: str) -> Field:
        lines = value.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        text = "\r\n".join(lines)
        sep = "" if text[:1] in (" ", "\t") else " "
        return cls(name, f"{name}:{sep}{text}\r\n".encode("utf-8", "surrogateescape"))


@attrs.define
class Message:
    """One message between its data and its commit: the envelope, the header fields and the body.

    ``changed``: a header field or the body is not the client's any more (the body is then written anew).
    """

    sender: str
    recipients: list[str]
    fields: list[Field]
    body: bytes
    changed: bool = False
    quarantine: str | None = None

    @classmethod
    def parse(cls, sender: str, recipients: Iterable[str], data: bytes) -> Message:
        fields, body = split_header(data)
        return cls(sender, list(recipients), fields, body)

    def to_bytes(self) -> bytes:
        return b"".join(f.raw for f in self.fields) + b"\r\n" + self.body

    def apply(self, changes: Iterable[Change]) -> None:
        """Make ``changes`` in order: header fields, body (the pieces of a new body joined), envelope, hold."""
        new_body: list[bytes] | None = None
        for change in changes:
            if isinstance(change, ReplaceBody):
                new_body = [] if new_body is None else new_body
                new_body.append(change.data)
            else:
                self._apply_one(change)
        if new_body is not None:
            self.body = crlf_body(b"".join(new_body))
            self.changed = True

    def _apply_one(self, change: Change) -> None:
        if isinstance(change, AddHeader):
            self.fields.append(Field.make(change.name, change.value))
            self.changed = True
        elif isinstance(change, InsertHeader):
            self.fields.insert(min(change.index, len(self.fields)), Field.make(change.name, change.value))
            self.changed = True
        elif isinstance(change, ChangeHeader):
            self._change_header(change)
        elif isinstance(change, ChangeSender):
            self.sender = change.address
        elif isinstance(change, AddRecipient):
            if change.address not in self.recipients:
                self.recipients.append(change.address)
        elif isinstance(change, DeleteRecipient):
            wanted = change.address.lower()
            self.recipients = [r for r in self.recipients if r.lower() != wanted]
        elif isinstance(change, Quarantine):
            self.quarantine = change.reason or "quarantined by a filter"

    def _change_header(self, change: ChangeHeader) -> None:
        """The ``index``-th field of that name (from 1); an empty value deletes it; beyond the last, one is added
        (libmilter's rule for ``smfi_chgheader``)."""
        seen = 0
        for i, f in enumerate(self.fields):
            if f.name.lower() == change.name.lower():
                seen += 1
                if seen == max(change.index, 1):
                    if change.value:
                        self.fields[i] = Field.make(f.name, change.value)
                    else:
                        del self.fields[i]
                    self.changed = True
                    return
        if change.value:
            self.fields.append(Field.make(change.name, change.value))
            self.changed = True

    def header(self, name: str) -> str | None:
        for f in self.fields:
            if f.name.lower() == name.lower():
                return f.value
        return None


def split_header(data: bytes) -> tuple[list[Field], bytes]:
    """The header fields and the body. A line that is neither a field nor a continuation ends the header
    (it is the body's first line), as a receiver reads a message with no empty line."""
    fields: list[Field] = []
    pos = 0
    n = len(data)
    while pos < n:
        end = data.find(b"\n", pos)
        end = n if end < 0 else end + 1
        line = data[pos:end]
        if line in (b"\r\n", b"\n"):
            return fields, data[end:]
        if line[:1] in (b" ", b"\t") and fields:
            last = fields[-1]
            fields[-1] = Field(last.name, last.raw + line)
        else:
            colon = line.find(b":")
            name = line[:colon]
            if colon <= 0 or not all(33 <= c <= 126 for c in name):
                return fields, data[pos:]
            fields.append(Field(name.decode("ascii"), line))
        pos = end
    return fields, b""


def crlf_body(body: bytes) -> bytes:
    """A filter's body with CRLF line ends throughout and a final one (a body is lines)."""
    text = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n").replace(b"\n", b"\r\n")
    return text if not text or text.endswith(b"\r\n") else text + b"\r\n"
