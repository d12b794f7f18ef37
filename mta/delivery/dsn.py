"""Delivery status notifications (RFC 3464): failed, delayed, and (when asked for) delivered or relayed recipients.

Theory of operation
-------------------
When a recipient fails permanently, or the message outlives
``spool.max_queue_lifetime``, or (optionally) it has been delayed for
``delivery.delay_warning``, the relay sends the envelope sender one message
built by ``build_dsn``::

    multipart/report; report-type=delivery-status
      text/plain              what happened, for a person
      message/delivery-status per-message fields, then one block per recipient
      text/rfc822-headers     the original header block; or, for a failure
                              of a message sent with RET=FULL,
      message/rfc822          the whole original message (up to FULL_RETURN_LIMIT)

Which recipients get a notice, and of which kind, follows the client's DSN
request (``mta.delivery.dsn_notify``).

The DSN itself goes out with the null envelope sender, so it can never bounce
back and loop; ``should_bounce`` refuses to make one for a message that
already had a null sender. It is marked ``Auto-Submitted: auto-replied``
(RFC 3834) so vacation responders stay quiet. All lines end in CRLF.

The per-message block names the message as Postfix's does: ``Reporting-MTA:
dns; <hostname>``, the queue id (``X-Logspool-Queue-ID``, an extension field
as RFC 3464 §3.3 allows, like Postfix's ``X-Postfix-Queue-ID``), the envelope
sender (``X-Logspool-Sender: rfc822; ...``), ``Original-Envelope-Id`` when
the client gave an ENVID, and ``Arrival-Date``. ``Remote-MTA`` is the DNS
name of the host that answered (``dns; mx.example.com``), only when one did
(``remote_mta_name``). The human part names the queue id and arrival too, so
a sender quoting the bounce gives the operator something to grep for.

Text that comes from outside (remote replies, addresses) is flattened to one
line and length-capped, so a hostile server cannot inject header fields into
the report. Non-ASCII addresses use the ``utf-8`` address type of RFC 6533.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import secrets
from collections.abc import Iterable, Sequence
from typing import Literal

import attrs

__all__ = ["FULL_RETURN_LIMIT", "HEADER_LIMIT", "RecipientFailure", "build_dsn", "extract_headers", "remote_mta_name",
           "should_bounce"]

HEADER_LIMIT = 64 * 1024
# The largest message a RET=FULL failure notice returns whole; a bigger one is returned as its headers, as
# Postfix does past its bounce_size_limit.
FULL_RETURN_LIMIT = 1024 * 1024
_MAX_FIELD = 900  # well under RFC 5322's 998-octet line limit, with room for the field name
_FOLD_AT = 78

Action = Literal["failed", "delayed", "delivered", "relayed", "expanded"]


def _status(_instance: object, _attribute: object, value: str) -> None:
    parts = value.split(".")
    if len(parts) != 3 or parts[0] not in ("2", "4", "5") or not all(p.isascii() and p.isdigit() for p in parts):
        raise ValueError(f"not an enhanced status code (RFC 3463): {value!r}")


@attrs.frozen
class RecipientFailure:
    """One recipient's block in the report.

    ``diagnostic`` is ``"smtp; 550 5.1.1 user unknown"`` (type; text), ``remote_mta``
    the host that answered (empty if none did), ``last_attempt`` when we last tried
    (the report's time if unset), ``original_recipient`` the ORCPT if the client
    gave one (``rfc822;a@b``, or a bare address taken as rfc822),
    ``will_retry_until`` for ``delayed`` reports.
    """

    recipient: str
    status: str = attrs.field(validator=_status)
    action: Action = "failed"
    diagnostic: str = ""
    remote_mta: str = ""
    last_attempt: dt.datetime | None = None
    original_recipient: str = ""
    will_retry_until: dt.datetime | None = None


def remote_mta_name(next_hop: str) -> str:
    """The DNS name in a next hop as the SMTP transport records it (``mx.example.com[192.0.2.5]:25 tls=none``).

    Empty for anything else (a Maildir, a destination that was never reached):
    RFC 3464's Remote-MTA is the host that gave the answer, and there was none.
    """
    host, bracket, _ = next_hop.partition("[")
    return host.strip() if bracket and host.strip() and " " not in host.strip() else ""


def should_bounce(sender: str) -> bool:
    """Whether a failure may be reported to ``sender``: never to the null sender (RFC 5321 §4.5.5)."""
    return sender.strip() not in ("", "<>")


def extract_headers(chunks: Iterable[bytes], limit: int = HEADER_LIMIT) -> bytes:
    """The message's header block (without the blank line after it), at most ``limit`` bytes.

    Stops reading at the blank line, so a big body is never touched. A header
    block over ``limit`` is cut after its last complete line within the limit.
    """
    buffer = bytearray()
    for chunk in chunks:
        start = max(0, len(buffer) - 3)
        buffer += chunk
        end = _blank_line(buffer, start)
        if end >= 0:
            del buffer[end:]
            break
        if len(buffer) > limit:
            break
    if len(buffer) > limit:
        cut = buffer.rfind(b"\n", 0, limit)
        del buffer[cut + 1 :]
    return bytes(buffer)


def _blank_line(buffer: bytearray, start: int) -> int:
    """Offset just past the last header line's newline, or -1 if the header block has not ended yet."""
    if buffer.startswith((b"\r\n", b"\n")):
        return 0
    hits = [i + 1 for i in (buffer.find(b"\n\r\n", start), buffer.find(b"\n\n", start)) if i >= 0]
    return min(hits) if hits else -1


def build_dsn(
    reporting_mta: str,
    original_sender: str,
    original_envelope_id: str | None,
    arrival_time: dt.datetime,
    failed: Sequence[RecipientFailure],
    original_headers: bytes,
    boundary: str | None = None,
    now: dt.datetime | None = None,
    *,
    from_address: str = "",
    queue_id: str = "",
    original_message: bytes | None = None,
) -> bytes:
    """The complete DSN message (headers and body, CRLF), addressed to ``original_sender``.

    ``original_message``: the whole message, returned as ``message/rfc822``
    in place of ``original_headers`` (a failure of a RET=FULL message).

    ``from_address`` defaults to ``MAILER-DAEMON@<reporting_mta>``; ``queue_id``
    is the failed message's, named in both the report and the text. Naive
    datetimes are taken as UTC.

    Raises:
        ValueError: no recipients, a null ``original_sender`` (see ``should_bounce``),
            or a ``boundary`` that occurs in the content.
    """
    if not failed:
        raise ValueError("a DSN needs at least one recipient")
    if not should_bounce(original_sender):
        raise ValueError("never send a DSN to the null sender")
    now = _aware(now or dt.datetime.now(dt.UTC))
    boundary = boundary or f"=_{secrets.token_hex(16)}"
    from_address = from_address or f"MAILER-DAEMON@{reporting_mta}"
    kind = _kind(failed)
    subject = _SUBJECTS[kind]

    if original_message is not None:
        returned = ("message/rfc822", _crlf(original_message))
    else:
        returned = ("text/rfc822-headers", _crlf(original_headers).rstrip(b"\r\n") + b"\r\n")
    status_part = _delivery_status(reporting_mta, original_envelope_id, arrival_time, failed, now,
                                   queue_id=queue_id, sender=original_sender)
    text_part = _human_text(reporting_mta, failed, kind, queue_id=queue_id, arrival_time=arrival_time)
    parts = [
        (_content_type("text/plain; charset=utf-8", text_part), text_part),
        (_content_type(_status_type(failed), status_part), status_part),
        (_content_type(*returned), returned[1]),
    ]
    needle = b"--" + boundary.encode("ascii")
    if any(needle in body for _, body in parts):
        raise ValueError(f"boundary {boundary!r} occurs in the report")

    top = [
        ("From", f"Mail Delivery System <{_flat(from_address)}>"),
        ("To", f"<{_flat(original_sender.removeprefix('<').removesuffix('>'))}>"),
        ("Subject", subject),
        ("Date", email.utils.format_datetime(now)),
        ("Message-ID", f"<{secrets.token_hex(12)}.dsn@{_flat(reporting_mta)}>"),
        ("Auto-Submitted", "auto-replied"),
        ("MIME-Version", "1.0"),
        ("Content-Type", f'multipart/report; report-type=delivery-status;\r\n\tboundary="{boundary}"'),
    ]
    out = [f"{name}: {value}\r\n".encode() for name, value in top]
    out.append(b"\r\nThis is a MIME-encapsulated message.\r\n")
    for part_headers, body in parts:
        out += [b"\r\n", needle, b"\r\n", part_headers, b"\r\n", body]
    out += [b"\r\n", needle, b"--\r\n"]
    return b"".join(out)


_SUBJECTS = {"failed": "Undelivered Mail Returned to Sender", "delayed": "Delayed Mail (still being retried)",
             "success": "Successful Mail Delivery Report"}
_INTROS = {
    "failed": ["I'm sorry to have to inform you that your message could not",
               "be delivered to one or more recipients. The reasons are below."],
    "delayed": ["Your message could not be delivered yet to the recipients below.",
                "It is still in the queue and will be retried; you do not need to resend it."],
    "success": ["Your message was successfully delivered to the destinations below,",
                "as you asked to be told. A \"relayed\" destination was handed to a",
                "mail server that gives no further notifications."],
}


def _kind(failed: Sequence[RecipientFailure]) -> str:
    """What the report is about as a whole: failures (if any), delays only, or successes only."""
    if all(f.action == "delayed" for f in failed):
        return "delayed"
    if all(f.action in ("delivered", "relayed", "expanded") for f in failed):
        return "success"
    return "failed"


def _content_type(content_type: str, body: bytes) -> bytes:
    encoding = "7bit" if body.isascii() else "8bit"
    return f"Content-Type: {content_type}\r\nContent-Transfer-Encoding: {encoding}\r\n".encode()


def _status_type(failed: Sequence[RecipientFailure]) -> str:
    if any(not (f.recipient + f.original_recipient).isascii() for f in failed):
        return "message/global-delivery-status"  # RFC 6533
    return "message/delivery-status"


def _delivery_status(
    reporting_mta: str,
    envelope_id: str | None,
    arrival_time: dt.datetime,
    failed: Sequence[RecipientFailure],
    now: dt.datetime,
    *,
    queue_id: str = "",
    sender: str = "",
) -> bytes:
    # In RFC 3464 §2.2's order: the envelope id, the reporting MTA, the arrival, then extension fields.
    lines = [_field("Original-Envelope-Id", envelope_id)] if envelope_id else []
    lines.append(_field("Reporting-MTA", f"dns; {reporting_mta}"))
    lines.append(_field("Arrival-Date", email.utils.format_datetime(_aware(arrival_time))))
    if queue_id:
        lines.append(_field("X-Logspool-Queue-ID", queue_id))
    if sender:
        lines.append(_field("X-Logspool-Sender", _address_field(sender)))
    for f in failed:
        lines.append("")
        if f.original_recipient:
            lines.append(_field("Original-Recipient", _typed_address(f.original_recipient)))
        lines.append(_field("Final-Recipient", _address_field(f.recipient)))
        lines.append(_field("Action", f.action))
        lines.append(_field("Status", f.status))
        if f.remote_mta:
            lines.append(_field("Remote-MTA", f"dns; {f.remote_mta}"))
        if f.diagnostic:
            lines.append(_field("Diagnostic-Code", f.diagnostic))
        lines.append(_field("Last-Attempt-Date", email.utils.format_datetime(_aware(f.last_attempt or now))))
        if f.will_retry_until is not None:
            lines.append(_field("Will-Retry-Until", email.utils.format_datetime(_aware(f.will_retry_until))))
    return ("\r\n".join(lines) + "\r\n").encode()


def _typed_address(value: str) -> str:
    """An ORCPT as the report writes it (``rfc822; a@b``): its own type if it names one, else an address."""
    kind, semi, address = value.partition(";")
    if semi and kind and all(c.isalnum() or c == "-" for c in kind):
        return f"{kind}; {address.strip()}"
    return _address_field(value)


def _address_field(address: str) -> str:
    address = address.removeprefix("<").removesuffix(">")
    return f"rfc822; {address}" if address.isascii() else f"utf-8; {address}"


def _human_text(reporting_mta: str, failed: Sequence[RecipientFailure], kind: str, *, queue_id: str = "",
                arrival_time: dt.datetime | None = None) -> bytes:
    lines = [f"This is the mail system at host {reporting_mta}.", "", *_INTROS[kind], ""]
    if queue_id:
        received = f", received {email.utils.format_datetime(_aware(arrival_time))}" if arrival_time else ""
        lines += [_flat(f"The message has queue id {queue_id}{received}."), ""]
    for f in failed:
        reason = f.diagnostic.partition(";")[2].strip() or f"status {f.status}"
        where = f" (from {f.remote_mta})" if f.remote_mta else ""
        lines.append(_flat(f"<{f.recipient}>: {f.action}: {reason}{where}"))
    return ("\r\n".join(lines) + "\r\n").encode()


def _field(name: str, value: str) -> str:
    """``Name: value``, flattened to one logical line, capped, and folded at spaces near 78 columns."""
    words = _flat(value).split(" ")
    lines: list[str] = []
    line = f"{name}:"
    for word in words:
        if not word:
            continue
        if len(line) + 1 + len(word) > _FOLD_AT and line.strip() and not line.endswith(":"):
            lines.append(line)
            line = " " + word
        else:
            line += " " + word
    lines.append(line)
    return "\r\n".join(lines)


def _flat(text: str) -> str:
    """One line of at most ``_MAX_FIELD`` characters: control characters become spaces.

    Lone surrogates (undecodable bytes smuggled through ``surrogateescape``) become U+FFFD
    so the report always encodes.
    """
    flat = "".join(
        " " if ord(c) < 0x20 or ord(c) == 0x7F else "\ufffd" if 0xD800 <= ord(c) < 0xE000 else c for c in text
    )
    flat = " ".join(flat.split())
    return flat if len(flat) <= _MAX_FIELD else flat[: _MAX_FIELD - 3] + "..."


def _crlf(data: bytes) -> bytes:
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").replace(b"\n", b"\r\n")


def _aware(moment: dt.datetime) -> dt.datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)
