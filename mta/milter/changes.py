"""What a filter answered: verdicts, and the changes it asked for at the end of a message.

The same records stand for a milter's replies (``mta.milter.protocol``
decodes them) and for rspamd's HTTP answer (``mta.milter.rspamd`` maps its
JSON onto them), so one piece of code (``mta.milter.apply``) makes every
change and the session reads one kind of verdict.
"""

from __future__ import annotations

import attrs

from mta.smtp.common import Reply


@attrs.frozen
class Accept:
    """Take the message (or the connection) without asking this filter anything more about it."""


@attrs.frozen
class Continue:
    """Go on to the next step."""


@attrs.frozen
class Reject:
    """Refuse (the recipient at RCPT, else the message): ``5.7.1``."""


@attrs.frozen
class Tempfail:
    """Refuse for now: ``4.7.1``."""


@attrs.frozen
class CustomReply:
    """Refuse with the filter's own reply (a 4xx or 5xx)."""

    reply: Reply


@attrs.frozen
class Discard:
    """Answer ``250`` but store nothing: the message is dropped."""


@attrs.frozen
class Progress:
    """The filter is still working: its deadline starts again."""


@attrs.frozen
class Skip:
    """No more body chunks, please (protocol step ``SKIP``)."""


@attrs.frozen
class Negotiated:
    """The filter's answer to option negotiation: what it may do, the steps it wants, the macros it asks for."""

    version: int
    actions: int
    protocol: int
    macros: dict[bytes, tuple[str, ...]] = attrs.field(factory=dict)


@attrs.frozen
class AddHeader:
    name: str
    value: str


@attrs.frozen
class InsertHeader:
    """A header field put at ``index`` (0: first) among the message's fields."""

    index: int
    name: str
    value: str


@attrs.frozen
class ChangeHeader:
    """The ``index``-th (from 1) field called ``name`` changed to ``value``; an empty value deletes it."""

    index: int
    name: str
    value: str


@attrs.frozen
class ReplaceBody:
    """A piece of the new body; the pieces of one message, in order, make it whole."""

    data: bytes


@attrs.frozen
class ChangeSender:
    address: str
    params: str = ""


@attrs.frozen
class AddRecipient:
    address: str
    params: str = ""


@attrs.frozen
class DeleteRecipient:
    address: str


@attrs.frozen
class Quarantine:
    """Keep the message but hold it for the operator (the relay's hold, ``mta queue release`` lets it go)."""

    reason: str


Verdict = Accept | Continue | Reject | Tempfail | CustomReply | Discard
Change = AddHeader | InsertHeader | ChangeHeader | ReplaceBody | ChangeSender | AddRecipient | DeleteRecipient | \
    Quarantine
Response = Verdict | Change | Progress | Skip | Negotiated
HeaderChange = AddHeader | InsertHeader | ChangeHeader
