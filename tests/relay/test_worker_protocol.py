"""The frames between the relay and its delivery workers: cut anywhere, they come out whole and the same."""

from __future__ import annotations

import struct

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mta.delivery.transport import Destination, Job
from mta.delivery.worker_protocol import (
    MAX_FRAME,
    FrameReader,
    FrameTooLong,
    ProtocolError,
    decode_destination,
    decode_outcomes,
    destination_item,
    encode,
    encode_outcomes,
    job_from,
    job_header,
)
from spool.format.record import Outcome, Status

MESSAGES = st.lists(st.tuples(st.sampled_from(["batch", "chunk", "outcome", "log"]),
                              st.binary(max_size=3000), st.integers(0, 2**40), st.text(max_size=50)), max_size=8)


@given(MESSAGES, st.integers(1, 7000))
def test_frames_cut_anywhere_come_out_whole_and_in_order(messages: list[tuple[str, bytes, int, str]],
                                                         cut: int) -> None:
    wire = b"".join(encode(list(m)) for m in messages)
    reader = FrameReader()
    got = [frame for i in range(0, len(wire), cut) for frame in reader.feed(wire[i:i + cut])]
    assert got == [list(m) for m in messages]
    assert reader.pending == 0


def test_a_frame_cut_by_eof_is_left_pending() -> None:
    frame = encode(["chunk", 1, 0, 0, b"x" * 100, None])
    reader = FrameReader()
    assert list(reader.feed(frame[:-1])) == []
    assert reader.pending == len(frame) - 1


def test_a_frame_announced_too_long_is_refused_before_it_is_read() -> None:
    with pytest.raises(FrameTooLong):
        list(FrameReader().feed(struct.pack(">I", MAX_FRAME + 1)))


@pytest.mark.parametrize("payload", [b"\xff\xff", cbor2.dumps({"a": 1}), cbor2.dumps([]), cbor2.dumps([7, 1])])
def test_a_frame_that_is_not_a_message_is_a_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        list(FrameReader().feed(struct.pack(">I", len(payload)) + payload))


def test_jobs_destinations_and_outcomes_cross_unchanged() -> None:
    job = Job("1000A", "a@example.org", ("b@x.example", "c@x.example"), (), 4096, {"params": {"BODY": "8BITMIME"}})
    (message,) = FrameReader().feed(encode(["batch", 1, destination_item(Destination("mx", "x.example",
                                                                                      "dane")), [job_header(job)]]))
    back = job_from(message[3][0], [b"body"])
    assert (back.queue_id, back.sender, back.recipients, back.size, back.extra, back.body) == \
        (job.queue_id, job.sender, job.recipients, job.size, job.extra, [b"body"])
    assert decode_destination(message[2]) == Destination("mx", "x.example", "dane")
    outs = [Outcome("b@x.example", Status.DELIVERED, 250, "2.0.0", "ok", "mx[1.2.3.4]:25 tls=none"),
            Outcome("c@x.example", Status.DEFERRED, 0, "4.4.1", "timed out", "")]
    (frame,) = FrameReader().feed(encode(["outcome", 1, 0, encode_outcomes(outs)]))
    assert decode_outcomes(frame[3]) == outs


@pytest.mark.parametrize("items", [[["r", 9, 250, "", "", ""]], [["r", 0, 250]], ["nonsense"]])
def test_an_outcome_that_is_not_one_is_a_protocol_error(items: list[object]) -> None:
    with pytest.raises(ProtocolError):
        decode_outcomes(items)
