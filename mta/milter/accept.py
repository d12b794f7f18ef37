"""Filtering a message as it is accepted: after its data, before the DKIM signature, the commit and the ``250``.

The body went into the spool as it arrived; here it is read back whole
(from the chunks the body writer kept when it is small, else from the log
once written, as ``mta.dkim.accept`` does), without the relay's own
``Received:`` header (the body's first record: filters do not see it, and
it stays first whatever they insert). If a filter changed a header field or
the body, everything after that first record is written anew
(``BodyWriter.rewrite``), so what the filters changed is what is stored and
delivered; the message keeps its queue id. The envelope (sender,
recipients) is the caller's to take from the result.
"""

from __future__ import annotations

import attrs

from mta.milter.apply import Message
from mta.milter.chain import FilterSession, Outcome
from spool import AsyncSpool, BodyWriter


@attrs.frozen
class Filtered:
    """What the filters made of a message: their refusal or discard, and the envelope to store."""

    outcome: Outcome
    sender: str
    recipients: tuple[str, ...]
    quarantine: str | None
    rewritten: bool


async def filter_body(filters: FilterSession, aspool: AsyncSpool, body: BodyWriter, sender: str,
                      recipients: list[str], queue_id: str) -> Filtered:
    """Ask ``filters`` about the message in ``body`` and store what they changed.

    Raises DiskFull (from ``write_through``) when the disk filled while the
    message was read back: the caller refuses the message as for any enqueue.
    """
    body.close()
    kept = body.kept
    if kept is not None:
        data = b"".join(kept[1:])
    else:
        await aspool.write_through()
        core = aspool.core
        data = b"".join(core.read_chunk(pos) for pos in body.chunks[1:])
    msg = Message.parse(sender, recipients, data)
    outcome = await filters.message(msg, queue_id)
    rewritten = False
    if outcome.reply is None and not outcome.discard and msg.changed:
        body.rewrite(msg.to_bytes())
        rewritten = True
    return Filtered(outcome, msg.sender, tuple(msg.recipients), msg.quarantine, rewritten)
