"""mta.dsn: reports parsed back with the email package, field by field."""

from __future__ import annotations

import datetime as dt
import email
import email.policy
import email.utils
import re
from collections.abc import Iterator
from email.message import EmailMessage, Message

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mta.delivery.dsn import (
    HEADER_LIMIT,
    RecipientFailure,
    build_dsn,
    extract_headers,
    remote_mta_name,
    should_bounce,
)

ARRIVAL = dt.datetime(2024, 3, 1, 12, 0, 0, tzinfo=dt.UTC)
NOW = dt.datetime(2024, 3, 6, 12, 0, 5, tzinfo=dt.UTC)
ATTEMPT = dt.datetime(2024, 3, 2, 8, 30, 0, tzinfo=dt.UTC)
ORIGINAL = b"From: alice@example.org\r\nTo: bob@dest.example\r\nSubject: lunch?\r\nMessage-ID: <m1@example.org>\r\n"

FAILED = RecipientFailure(
    recipient="bob@dest.example",
    status="5.1.1",
    action="failed",
    diagnostic="smtp; 550 5.1.1 user unknown",
    remote_mta="mx.dest.example",
    last_attempt=ATTEMPT,
)
DELAYED = RecipientFailure(
    recipient="carol@slow.example",
    status="4.4.1",
    action="delayed",
    diagnostic="smtp; 421 4.4.1 try later",
    remote_mta="mx.slow.example",
    will_retry_until=NOW + dt.timedelta(days=1),
)


def parse(data: bytes) -> EmailMessage:
    message = email.message_from_bytes(data, policy=email.policy.default)
    assert isinstance(message, EmailMessage)
    return message


def report(**overrides: object) -> bytes:
    args: dict[str, object] = {
        "reporting_mta": "relay.example",
        "original_sender": "alice@example.org",
        "original_envelope_id": "ENV-42",
        "arrival_time": ARRIVAL,
        "failed": [FAILED],
        "original_headers": ORIGINAL,
        "boundary": "BOUNDARY",
        "now": NOW,
    } | overrides
    return build_dsn(**args)  # type: ignore[arg-type]


def part(message: EmailMessage, index: int) -> EmailMessage:
    parts = message.get_payload()
    assert isinstance(parts, list)
    found = parts[index]
    assert isinstance(found, EmailMessage)
    return found


def status_blocks(message: EmailMessage) -> list[Message]:
    """The per-message block, then one per recipient (the email package only splits the RFC 3464 type)."""
    status = part(message, 1)
    blocks = status.get_payload()
    assert isinstance(blocks, list)
    if status.get_content_type() == "message/global-delivery-status":
        # Parsed as one message: the per-message block is its header, the rest its body.
        (first,) = blocks
        assert isinstance(first, Message)
        body = first.get_payload()
        assert isinstance(body, str)
        text = body.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        rest = [
            email.message_from_string(b + "\n", policy=email.policy.default)
            for b in re.split(r"\r?\n\r?\n", text.strip())
        ]
        return [first, *rest]
    return [b for b in blocks if isinstance(b, Message)]


def test_top_level_headers() -> None:
    message = parse(report())
    assert email.utils.parseaddr(message["From"])[1] == "MAILER-DAEMON@relay.example"
    assert email.utils.parseaddr(message["To"])[1] == "alice@example.org"
    assert message["Subject"] == "Undelivered Mail Returned to Sender"
    assert message["Auto-Submitted"] == "auto-replied"
    assert message["MIME-Version"] == "1.0"
    assert email.utils.parsedate_to_datetime(message["Date"]) == NOW
    assert message["Message-ID"].endswith("@relay.example>")
    assert message.get_content_type() == "multipart/report"
    assert message.get_param("report-type") == "delivery-status"
    assert message.get_boundary() == "BOUNDARY"
    assert not message.defects


def test_three_parts_in_order() -> None:
    message = parse(report())
    assert [part(message, i).get_content_type() for i in range(3)] == [
        "text/plain",
        "message/delivery-status",
        "text/rfc822-headers",
    ]
    text = part(message, 0).get_content()
    assert "relay.example" in text
    assert "<bob@dest.example>: failed: 550 5.1.1 user unknown (from mx.dest.example)" in text


def test_delivery_status_fields() -> None:
    per_message, per_recipient = status_blocks(parse(report()))
    assert per_message["Reporting-MTA"] == "dns; relay.example"
    assert per_message["Original-Envelope-Id"] == "ENV-42"
    assert email.utils.parsedate_to_datetime(per_message["Arrival-Date"]) == ARRIVAL
    assert per_recipient["Final-Recipient"] == "rfc822; bob@dest.example"
    assert per_recipient["Action"] == "failed"
    assert per_recipient["Status"] == "5.1.1"
    assert per_recipient["Diagnostic-Code"] == "smtp; 550 5.1.1 user unknown"
    assert per_recipient["Remote-MTA"] == "dns; mx.dest.example"
    assert email.utils.parsedate_to_datetime(per_recipient["Last-Attempt-Date"]) == ATTEMPT
    assert per_recipient["Original-Recipient"] is None
    assert per_recipient["Will-Retry-Until"] is None


def test_original_headers_part_is_the_header_block() -> None:
    message = parse(report())
    raw = part(message, 2).get_payload()
    assert isinstance(raw, str)
    assert raw.replace("\r\n", "\n").strip() == ORIGINAL.decode().replace("\r\n", "\n").strip()


def test_crlf_everywhere() -> None:
    data = report(original_headers=b"Subject: bare lf\nX-A: 1\n\n")
    assert b"\n" not in data.replace(b"\r\n", b"")
    assert b"\r" not in data.replace(b"\r\n", b"")
    assert data.endswith(b"--BOUNDARY--\r\n")
    assert b"\r\nSubject: bare lf\r\nX-A: 1\r\n" in data


def test_several_recipients_and_delay() -> None:
    plain = RecipientFailure("dave@x.example", "5.0.0", original_recipient="rfc822-style@orcpt.example")
    message = parse(report(failed=[FAILED, DELAYED, plain], original_envelope_id=None))
    per_message, first, second, third = status_blocks(message)
    assert per_message["Original-Envelope-Id"] is None
    assert [b["Final-Recipient"] for b in (first, second, third)] == [
        "rfc822; bob@dest.example",
        "rfc822; carol@slow.example",
        "rfc822; dave@x.example",
    ]
    assert second["Action"] == "delayed" and second["Status"] == "4.4.1"
    assert email.utils.parsedate_to_datetime(second["Will-Retry-Until"]) == NOW + dt.timedelta(days=1)
    assert email.utils.parsedate_to_datetime(second["Last-Attempt-Date"]) == NOW  # defaults to the report time
    assert third["Original-Recipient"] == "rfc822; rfc822-style@orcpt.example"
    assert third["Remote-MTA"] is None and third["Diagnostic-Code"] is None
    assert message["Subject"] == "Undelivered Mail Returned to Sender"


def test_delay_only_report_says_so() -> None:
    message = parse(report(failed=[DELAYED]))
    assert message["Subject"] == "Delayed Mail (still being retried)"
    assert "will be retried" in part(message, 0).get_content()


def test_hostile_diagnostic_cannot_inject_fields() -> None:
    evil = RecipientFailure("bob@dest.example", "5.7.1", diagnostic="smtp; 550 no\r\nStatus: 2.0.0\r\n\r\nX: y")
    _, block = status_blocks(parse(report(failed=[evil])))
    assert block["Status"] == "5.7.1"
    assert block["Diagnostic-Code"] == "smtp; 550 no Status: 2.0.0 X: y"
    assert block["X"] is None


def test_long_diagnostic_is_folded_and_capped() -> None:
    text = "smtp; 550 " + " ".join(f"word{i}" for i in range(400))
    data = report(failed=[RecipientFailure("bob@dest.example", "5.0.0", diagnostic=text)])
    assert max(len(line) for line in data.split(b"\r\n")) <= 998
    (_, block) = status_blocks(parse(data))
    value = " ".join(block["Diagnostic-Code"].split())
    assert value.startswith("smtp; 550 word0 word1") and value.endswith("...")
    assert len(value) <= 900


def test_utf8_recipient_uses_rfc6533_types() -> None:
    message = parse(report(failed=[RecipientFailure("jöran@dest.example", "5.1.1")]))
    assert part(message, 1).get_content_type() == "message/global-delivery-status"
    raw = report(failed=[RecipientFailure("jöran@dest.example", "5.1.1")])
    assert "Final-Recipient: utf-8; jöran@dest.example\r\n".encode() in raw


def test_naive_times_are_utc_and_custom_from() -> None:
    naive = ARRIVAL.replace(tzinfo=None)
    message = parse(report(arrival_time=naive, now=NOW.replace(tzinfo=None), from_address="postmaster@relay.example"))
    per_message, _ = status_blocks(message)
    assert email.utils.parsedate_to_datetime(per_message["Arrival-Date"]) == ARRIVAL
    assert email.utils.parseaddr(message["From"])[1] == "postmaster@relay.example"


def test_random_boundary_when_none_given() -> None:
    one, two = parse(report(boundary=None)), parse(report(boundary=None))
    assert one.get_boundary() != two.get_boundary()
    assert len(one.get_payload()) == 3


def test_refusals() -> None:
    with pytest.raises(ValueError, match="null sender"):
        report(original_sender="")
    with pytest.raises(ValueError, match="null sender"):
        report(original_sender="<>")
    with pytest.raises(ValueError, match="at least one"):
        report(failed=[])
    with pytest.raises(ValueError, match="boundary"):
        report(original_headers=b"X-Trick: --BOUNDARY\r\n", boundary="BOUNDARY")
    with pytest.raises(ValueError, match="enhanced status"):
        RecipientFailure("a@b", "550")


def test_should_bounce_never_for_null_sender() -> None:
    assert not should_bounce("")
    assert not should_bounce("<>")
    assert not should_bounce(" ")
    assert should_bounce("alice@example.org")
    assert should_bounce("MAILER-DAEMON@other.example")


# ---------------------------------------------------------------- extract_headers

BODY = b"body line\r\n" * 10


def test_extract_headers_stops_at_blank_line() -> None:
    assert extract_headers([ORIGINAL + b"\r\n" + BODY]) == ORIGINAL
    assert extract_headers([b"A: 1\nB: 2\n\nbody\n"]) == b"A: 1\nB: 2\n"
    assert extract_headers([b"\r\nbody"]) == b""
    assert extract_headers([b"A: 1\r\n"]) == b"A: 1\r\n"  # no body at all
    assert extract_headers([]) == b""


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7])
def test_extract_headers_same_answer_whatever_the_chunking(size: int) -> None:
    data = ORIGINAL + b"\r\n" + BODY
    chunks = [data[i : i + size] for i in range(0, len(data), size)]
    assert extract_headers(chunks) == ORIGINAL


def test_extract_headers_does_not_read_the_body() -> None:
    def chunks() -> Iterator[bytes]:
        yield ORIGINAL + b"\r\nfirst body chunk"
        raise AssertionError("read past the header block")

    assert extract_headers(chunks()) == ORIGINAL


def test_extract_headers_is_bounded() -> None:
    line = b"X-Filler: " + b"y" * 100 + b"\r\n"

    def endless() -> Iterator[bytes]:
        while True:
            yield line

    headers = extract_headers(endless(), limit=1000)
    assert len(headers) <= 1000
    assert headers == line * (1000 // len(line))
    assert len(extract_headers(endless())) <= HEADER_LIMIT


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.lists(st.integers(min_value=1, max_value=50), max_size=20))
def test_extract_headers_chunking_never_matters(data: bytes, cuts: list[int]) -> None:
    chunks, pos = [], 0
    for cut in cuts:
        chunks.append(data[pos : pos + cut])
        pos += cut
    chunks.append(data[pos:])
    whole = extract_headers([data], limit=200)
    assert extract_headers(chunks, limit=200) == whole
    assert len(whole) <= 200
    assert data.startswith(whole)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.builds(
            RecipientFailure,
            recipient=st.text(min_size=1, max_size=40),
            status=st.sampled_from(["5.1.1", "4.4.1", "5.7.1"]),
            action=st.sampled_from(["failed", "delayed"]),
            diagnostic=st.text(max_size=200),
            remote_mta=st.text(max_size=30),
        ),
        min_size=1,
        max_size=4,
    ),
    st.binary(max_size=200),
)
def test_any_input_gives_a_parsable_report(failed: list[RecipientFailure], headers: bytes) -> None:
    data = report(failed=failed, original_headers=headers, boundary=None)
    assert b"\n" not in data.replace(b"\r\n", b"")
    message = parse(data)
    blocks = status_blocks(message)
    assert len(blocks) == 1 + len(failed)
    assert [b["Status"] for b in blocks[1:]] == [f.status for f in failed]
    assert [b["Action"] for b in blocks[1:]] == [f.action for f in failed]


def test_the_report_names_the_queue_id_the_sender_and_the_arrival() -> None:
    message = parse(report(queue_id="1000004BC"))
    per_message, _ = status_blocks(message)
    assert per_message["X-Logspool-Queue-ID"] == "1000004BC"
    assert per_message["X-Logspool-Sender"] == "rfc822; alice@example.org"
    assert email.utils.parsedate_to_datetime(per_message["Arrival-Date"]) == ARRIVAL
    raw = part(message, 1).get_payload()
    text = str(raw[0]) if isinstance(raw, list) else str(raw)
    # RFC 3464 §2.2's order: Original-Envelope-Id, Reporting-MTA, Arrival-Date, then extension fields.
    order = [text.index(f) for f in ("Original-Envelope-Id", "Reporting-MTA", "Arrival-Date", "X-Logspool-Queue-ID")]
    assert order == sorted(order), text
    assert "queue id 1000004BC" in part(message, 0).get_content()


@pytest.mark.parametrize(("next_hop", "name"), [
    ("mx.dest.example[192.0.2.5]:25 tls=encrypted", "mx.dest.example"),
    ("mx.dest.example[192.0.2.5]:25", "mx.dest.example"),
    ("127.0.0.1[127.0.0.1]:2525 tls=none", "127.0.0.1"),
    ("smtp:10.0.0.5:25", ""),  # a destination no host of which answered
    ("mx:dest.example", ""),
    ("maildir:/var/mail", ""),
    ("", ""),
])
def test_remote_mta_is_the_dns_name_of_the_host_that_answered(next_hop: str, name: str) -> None:
    assert remote_mta_name(next_hop) == name
