"""Property tests of the record codec (spool/format/record.py) and of reading frames back from files."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import attrs
import cbor2
import pytest
from crc32c import crc32c
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from record_strategies import deliveries, envelopes, finishes, frame_args, offsets, records, segment_ids, starts

from spool.errors import CorruptRecord, CorruptSegment
from spool.fileio import OsFileIO
from spool.format.record import (
    FLAGS_OFFSET,
    HEADER_SIZE,
    Delivery,
    Envelope,
    Finish,
    Frame,
    Outcome,
    Payload,
    RecordType,
    Start,
    StartKind,
    Status,
    check_frame,
    decode_frame,
    decode_payload,
    encode_frame,
    envelope_payload,
    frame_payload,
    make_pos,
    payload_bytes,
    payload_type,
    pos_offset,
    pos_segment,
)
from spool.format.segment import SEGMENT_HEADER_SIZE, encode_segment_header, segment_name
from spool.read.reader import LogReader

FAST = settings(max_examples=30, deadline=None)

def frame_of(seg: int, rec: Payload, **kw: Any) -> bytes:
    return encode_frame(seg, payload_type(rec), payload_bytes(rec), **kw)


# -- codec round trip ------------------------------------------------------------


@FAST
@given(seg=segment_ids, rec=records, kw=frame_args, junk=st.binary(max_size=40), trailer=st.binary(max_size=40))
def test_round_trip_through_frame_and_payload(seg: int, rec: Payload, kw: dict[str, int], junk: bytes,
                                              trailer: bytes) -> None:
    frame_bytes = frame_of(seg, rec, **kw)
    buf = junk + frame_bytes + trailer  # the frame is found by offset; neighbours do not matter
    frame = decode_frame(seg, buf, len(junk))
    assert frame == Frame(make_pos(seg, len(junk)), payload_type(rec), kw["flags"], kw["klass"], kw["time"],
                          payload_bytes(rec))
    assert frame.size == len(frame_bytes)
    assert frame.garbage == bool(kw["flags"])
    assert decode_payload(frame.rtype, frame.payload) == rec


@FAST
@given(seg=segment_ids, off=offsets)
def test_position_splits_back_into_segment_and_offset(seg: int, off: int) -> None:
    pos = make_pos(seg, off)
    assert (pos_segment(pos), pos_offset(pos)) == (seg, off)
    if off + 1 < 2**32:  # the next offset is a position too only if it fits the offset's 32 bits
        assert make_pos(seg, off) < make_pos(seg, off + 1) < make_pos(seg + 1, 0)
    assert make_pos(seg, off) < make_pos(seg + 1, 0)


def test_envelope_defaults_leave_optional_keys_out() -> None:
    """Optional keys at their default are not written, and read back as the default."""
    import cbor2

    env = Envelope(5, "a@b", ("c@d",), (), 0, 0)
    assert sorted(cbor2.loads(env.to_payload())) == [0, 1, 2, 3, 4, 5, 6]
    assert decode_payload(RecordType.ENVELOPE, cbor2.dumps({0: 5, 1: "a@b", 2: ["c@d"], 3: [], 4: 0, 5: 0})) == env
    assert sorted(cbor2.loads(Start(1, 2).to_payload())) == [0, 1]
    assert sorted(cbor2.loads(Finish(1, 2).to_payload())) == [0, 1]
    assert sorted(cbor2.loads(Delivery(1, 2, ()).to_payload())) == [0, 1, 2]


# -- the payload encoder writes cbor2's bytes -------------------------------------------


@settings(max_examples=200, deadline=None)
@given(rec=st.one_of(envelopes, starts, deliveries, finishes))
def test_payload_bytes_are_cbor2s_encoding_of_the_map(rec: Envelope | Start | Delivery | Finish) -> None:
    """The hand-written encoder (record.py, for speed) must agree with cbor2 byte for byte."""
    assert rec.to_payload() == cbor2.dumps(rec.to_map())
    assert decode_payload(payload_type(rec), rec.to_payload()) == rec


_BOUNDARIES = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1]


@pytest.mark.parametrize("n", _BOUNDARIES)
def test_integer_and_length_boundaries_are_encoded_as_cbor2_does(n: int) -> None:
    env = Envelope(n, "x" * (n % 70000), ("\u00e9" * (n % 300),), (n,) * (n % 30), n, n, n % 2**64, replaces=n)
    assert env.to_payload() == cbor2.dumps(env.to_map())
    plain = attrs.evolve(env, replaces=None)  # the common envelope's path (no optional field)
    assert plain.to_payload() == cbor2.dumps(plain.to_map())
    d = Delivery(n, n, (Outcome("r", Status.DEFERRED, n % 600, "4.0.0", "y" * (n % 300), ""),) * (n % 30), n)
    assert d.to_payload() == cbor2.dumps(d.to_map())


def test_values_outside_the_fast_subset_are_left_to_cbor2() -> None:
    """Bignums, negative numbers and int subclasses take cbor2's path and still match."""
    env = Envelope(2**70, "s", ("r",), (-1,), StartKind.ADMIN, 0, extra={"k": [1.5, None, -3, {"x": b"b"}]})
    assert env.to_payload() == cbor2.dumps(env.to_map())
    with pytest.raises(UnicodeEncodeError):
        Envelope(1, "\udc80", ("r",), (), 0, 0).to_payload()


@FAST
@given(seg=segment_ids, rec=records, kw=frame_args)
def test_checksum_covers_salt_header_bytes_4_to_8_and_10_to_15_then_payload(seg: int, rec: Payload,
                                                                             kw: dict[str, int]) -> None:
    """docs/format.md's definition, computed the long way."""
    frame = frame_of(seg, rec, **kw)
    want = crc32c(frame[HEADER_SIZE:], crc32c(frame[10:16], crc32c(frame[4:9], crc32c(struct.pack("<Q", seg)))))
    assert struct.unpack_from("<I", frame)[0] == want


# -- decoder fuzz ----------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(seg=segment_ids, buf=st.binary(max_size=80), off=st.integers(0, 90))
def test_decode_frame_of_arbitrary_bytes_returns_frame_or_corrupt_record(seg: int, buf: bytes, off: int) -> None:
    try:
        frame = decode_frame(seg, buf, off)
    except CorruptRecord as exc:
        assert exc.offset == off
        # The lighter entry points give the same verdict.
        with pytest.raises(CorruptRecord):
            check_frame(seg, buf, off)
        with pytest.raises(CorruptRecord):
            frame_payload(seg, memoryview(buf), off)
    else:
        assert encode_frame(seg, frame.rtype, frame.payload, klass=frame.klass, time=frame.time,
                            flags=frame.flags) == buf[off : off + frame.size]
        assert check_frame(seg, buf, off) == (frame.rtype, frame.flags, frame.klass, frame.time, off + frame.size)
        assert frame_payload(seg, memoryview(buf), off) == frame.payload


@settings(max_examples=60, deadline=None)
@given(seg=segment_ids, rec=records, kw=frame_args, data=st.data())
def test_decode_frame_of_damaged_frames_returns_frame_or_corrupt_record(seg: int, rec: Payload,
                                                                       kw: dict[str, int], data: st.DataObject) -> None:
    """Random overwrites of a real frame (header fields included): only Frame or CorruptRecord."""
    buf = bytearray(frame_of(seg, rec, **kw))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(buf)))
    try:
        frame = decode_frame(seg, bytes(buf[:cut]))
    except CorruptRecord:
        return
    # Anything accepted must be self-consistent: it re-encodes to the very bytes it came from.
    assert encode_frame(seg, frame.rtype, frame.payload, klass=frame.klass, time=frame.time,
                        flags=frame.flags) == bytes(buf[: frame.size])


@settings(max_examples=15, deadline=None)
@given(seg=segment_ids, rec=records, kw=frame_args)
def test_no_proper_prefix_of_a_frame_decodes(seg: int, rec: Payload, kw: dict[str, int]) -> None:
    """Fed a byte at a time, the decoder answers only once the whole frame is there."""
    whole = frame_of(seg, rec, **kw)
    for n in range(len(whole)):
        with pytest.raises(CorruptRecord):
            decode_frame(seg, whole[:n])
    assert decode_frame(seg, whole).payload == payload_bytes(rec)


@settings(max_examples=100, deadline=None)
@given(rtype=st.sampled_from([t for t in RecordType if t is not RecordType.DATA]), payload=st.binary(max_size=80))
def test_decode_payload_of_arbitrary_bytes_returns_record_or_corrupt_record(rtype: RecordType,
                                                                            payload: bytes) -> None:
    try:
        rec = decode_payload(rtype, payload, path="x.seg", offset=32)
    except CorruptRecord as exc:
        assert (exc.path, exc.offset) == ("x.seg", 32)
    else:
        assert payload_type(rec) is rtype


# -- mutation: every bit outside the flags byte is covered -------------------------


@settings(max_examples=15, deadline=None)
@given(seg=segment_ids, rec=st.one_of(envelopes, starts, deliveries, finishes, st.binary(max_size=64)),
       kw=frame_args)
def test_every_bit_flip_outside_the_flags_byte_is_detected(seg: int, rec: Payload, kw: dict[str, int]) -> None:
    good = frame_of(seg, rec, **kw)
    for i in range(len(good)):
        for bit in range(8):
            bad = bytearray(good)
            bad[i] ^= 1 << bit
            if i == FLAGS_OFFSET and bit == 0:
                # The garbage mark: outside the checksum on purpose, flips freely.
                assert decode_frame(seg, bytes(bad)).garbage != bool(kw["flags"])
                continue
            with pytest.raises(CorruptRecord):
                decode_frame(seg, bytes(bad))


def test_reserved_flag_bits_are_corruption() -> None:
    good = encode_frame(1, RecordType.START, Start(2, 3).to_payload())
    for bit in range(1, 8):
        bad = bytearray(good)
        bad[FLAGS_OFFSET] |= 1 << bit
        with pytest.raises(CorruptRecord, match="reserved"):
            decode_frame(1, bytes(bad))


# -- the salt ------------------------------------------------------------------------


@FAST
@given(seg=segment_ids, other=segment_ids, rec=records, kw=frame_args)
@example(seg=1, other=2, rec=Start(1, 2), kw={"klass": 0, "time": 0, "flags": 0})
def test_frame_from_one_segment_fails_in_another(seg: int, other: int, rec: Payload, kw: dict[str, int]) -> None:
    frame = frame_of(seg, rec, **kw)
    if other == seg:
        assert decode_frame(other, frame).payload == payload_bytes(rec)
        return
    with pytest.raises(CorruptRecord, match="checksum mismatch"):
        decode_frame(other, frame)


# -- whole buffer versus the log reader over a file -----------------------------------------


def decode_all(seg: int, data: bytes, start: int) -> list[Frame]:
    frames = []
    off = start
    while off < len(data):
        frame = decode_frame(seg, data, off)
        frames.append(frame)
        off += frame.size
    return frames


def read_with_reader(path: Path, seg: int, *, window: int = 1 << 20) -> list[Frame]:
    reader = LogReader(OsFileIO(), str(path.parent), segments=(seg,), window=window)
    return list(reader.frames(make_pos(seg, SEGMENT_HEADER_SIZE)))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seg=st.integers(0, 2**64 - 1),
    recs=st.lists(st.tuples(records, frame_args), max_size=12),
    chunk=st.sampled_from([1, 16, 17, 100, 1 << 20]),
)
def test_the_log_reader_over_a_file_equals_decoding_the_whole_buffer(
    tmp_path: Path, seg: int, recs: list[tuple[Payload, dict[str, int]]], chunk: int
) -> None:
    data = encode_segment_header(seg, 0) + b"".join(frame_of(seg, r, **kw) for r, kw in recs)
    path = tmp_path / segment_name(seg)
    path.write_bytes(data)
    expected = decode_all(seg, data, SEGMENT_HEADER_SIZE)
    assert [decode_payload(f.rtype, f.payload) for f in expected] == [r for r, _ in recs]
    # A small window makes frames straddle the reader's buffer boundaries.
    assert read_with_reader(path, seg, window=chunk) == expected


def test_frame_reader_reports_a_bad_frame_with_path_and_offset(tmp_path: Path) -> None:
    seg = 7
    frames = [frame_of(seg, Start(i, i)) for i in range(3)]
    data = bytearray(encode_segment_header(seg, 0) + b"".join(frames))
    bad_off = SEGMENT_HEADER_SIZE + len(frames[0])
    data[bad_off + HEADER_SIZE] ^= 0x40  # a payload bit of the second frame
    path = tmp_path / segment_name(seg)
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptSegment) as info:
        read_with_reader(path, seg)
    assert (info.value.path, info.value.offset) == (str(path), bad_off)
    assert str(path) in str(info.value)


# -- regression: decode_payload checks the schema, not just the CBOR ------------------------

# Values of the wrong CBOR type for each field kind of _SCHEMA.
_WRONG: dict[str, list[object]] = {
    "uint": ["7", -1, 1.5, None, True, [1], b"\x01"],
    "opt_uint": ["7", -1, 1.5, True, [1], b"\x01"],  # null reads as absent
    "text": [7, None, b"a", ["a"], True],
    "bool": [1, 0, "yes", None],
    "array": ["abc", 5, {0: 1}, None, b"ab"],
    "map": [[["k", 1]], "k", 5, {1: "non-text key"}],
}
_SCHEMA: dict[RecordType, dict[int, str]] = {
    RecordType.ENVELOPE: {0: "uint", 1: "text", 2: "array", 3: "array", 4: "uint", 5: "uint", 6: "uint",
                          7: "opt_uint", 8: "bool", 9: "array", 10: "map"},
    RecordType.START: {0: "uint", 1: "uint", 2: "uint"},
    RecordType.DELIVERY: {0: "uint", 1: "uint", 2: "array", 3: "uint"},
    RecordType.FINISH: {0: "uint", 1: "uint", 2: "opt_uint"},
}


@settings(max_examples=60, deadline=None)
@given(rec=st.one_of(envelopes, starts, deliveries, finishes), data=st.data())
def test_decode_payload_rejects_ill_typed_fields(rec: Payload, data: st.DataObject) -> None:
    """Once decode_payload accepted any CBOR value in any field (Envelope(message_id='x'));
    a payload that passes its checksum but breaks the schema must be CorruptRecord."""
    import cbor2

    rtype = payload_type(rec)
    d = cbor2.loads(payload_bytes(rec))
    key = data.draw(st.sampled_from(sorted(_SCHEMA[rtype])), label="key")
    d[key] = data.draw(st.sampled_from(_WRONG[_SCHEMA[rtype][key]]), label="value")
    with pytest.raises(CorruptRecord):
        decode_payload(rtype, cbor2.dumps(d))


@settings(max_examples=80, deadline=None)
@given(d=deliveries, data=st.data())
def test_decode_payload_rejects_ill_typed_outcomes(d: Delivery, data: st.DataObject) -> None:
    import cbor2

    m = cbor2.loads(d.to_payload())
    outcome = m[2][0]
    i = data.draw(st.integers(0, 6), label="item")
    if i == 6:
        outcome.append("a seventh item")
    else:
        outcome[i] = data.draw(st.sampled_from(_WRONG["uint" if i in (1, 2) else "text"]), label="value")
    with pytest.raises(CorruptRecord):
        decode_payload(RecordType.DELIVERY, cbor2.dumps(m))
    with pytest.raises(CorruptRecord):
        decode_payload(RecordType.DELIVERY, cbor2.dumps({0: 1, 1: 2, 2: ["abcdef"]}))


@pytest.mark.parametrize("rtype", [0, 6, 255])
def test_decode_payload_of_an_unknown_type_is_corrupt_record(rtype: int) -> None:
    """Frames read with verify=False carry unchecked types; decode_payload must still say CorruptRecord."""
    with pytest.raises(CorruptRecord, match=f"type {rtype}"):
        decode_payload(rtype, b"\xa0", path="x.seg", offset=48)


# -- envelope_payload: the envelope encoded from its fields ------------------------


def _envelope_payload_before_issue_18(env: Envelope) -> bytes:
    """Envelope.to_payload as it was before envelope_payload (fae3ac8): the reference the new encoder must match."""
    from spool.format.record import _SHORT, _cbor_head, _cbor_text, _cbor_uint

    def uints(vs: tuple[int, ...]) -> bytes:
        return _cbor_head(4, len(vs)) + b"".join(map(_cbor_uint, vs))

    def texts(vs: tuple[str, ...]) -> bytes:
        return _cbor_head(4, len(vs)) + b"".join(map(_cbor_text, vs))

    common = (b"\x00", _cbor_uint(env.message_id), b"\x01", _cbor_text(env.sender),
              b"\x02", texts(env.recipients), b"\x03", uints(env.body),
              b"\x04", _cbor_uint(env.body_size), b"\x05", _cbor_uint(env.arrival_ms),
              b"\x06", _cbor_uint(env.attempts))
    if env.replaces is None and not env.held and not env.in_doubt and not env.extra:
        return b"\xa7" + b"".join(common)
    options: list[bytes] = []
    n = 7
    if env.replaces is not None:
        options += (b"\x07", _cbor_uint(env.replaces))
        n += 1
    if env.held:
        options.append(b"\x08\xf5")
        n += 1
    if env.in_doubt:
        options += (b"\x09", texts(env.in_doubt))
        n += 1
    if env.extra:
        options += (b"\x0a", cbor2.dumps(env.extra))
        n += 1
    return b"".join((_SHORT[5][n], *common, *options))


def _fields(env: Envelope) -> tuple[Any, ...]:
    return attrs.astuple(env, recurse=False)


# Every CBOR argument boundary (1, 2, 4 and 8 bytes), one either side, for integers and for lengths.
_EDGES = sorted({max(0, b + d) for b in (0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1)
                 for d in (-1, 0, 1)} - {2**64})
_LENGTHS = [0, 1, 22, 23, 24, 25, 254, 255, 256, 257, 65535, 65536]
edge_uints = st.sampled_from(_EDGES) | st.integers(0, 2**64 - 1)
edge_texts = st.builds(lambda n, c: c * n, st.sampled_from(_LENGTHS),
                       st.sampled_from(["a", "\u00e9", "\u20ac", "\U0001f600"]))
edge_envelopes = st.builds(
    Envelope,
    message_id=edge_uints,
    sender=edge_texts,
    recipients=st.integers(1, 26).flatmap(lambda n: st.lists(st.text(max_size=3), min_size=n, max_size=n)).map(tuple),
    body=st.sampled_from([0, 1, 23, 24, 25]).flatmap(lambda n: st.lists(edge_uints, min_size=n, max_size=n)).map(tuple),
    body_size=edge_uints,
    arrival_ms=edge_uints,
    attempts=edge_uints,
    replaces=st.none() | edge_uints,
    held=st.booleans(),
    in_doubt=st.lists(st.text(max_size=3), max_size=25).map(tuple),
    extra=st.just({}) | st.dictionaries(st.text(max_size=4), st.integers(0, 2**64 - 1) | st.text(max_size=4),
                                        max_size=3),
)


@settings(max_examples=400, deadline=None)
@given(env=st.one_of(envelopes, edge_envelopes))
def test_envelope_payload_writes_the_bytes_of_the_encoder_before_it_and_of_cbor2(env: Envelope) -> None:
    """Same bytes, so no format change: the new encoder against the old one and against cbor2, over generated
    envelopes and every CBOR length boundary of every field (integers, texts, arrays)."""
    new = envelope_payload(*_fields(env))
    assert new == _envelope_payload_before_issue_18(env) == cbor2.dumps(env.to_map())
    assert env.to_payload() == new
    assert decode_payload(RecordType.ENVELOPE, new) == env


@pytest.mark.parametrize("n", _EDGES)
def test_envelope_payload_at_each_integer_boundary_in_each_field(n: int) -> None:
    base = Envelope(make_pos(1, 32), "s@x", ("r@y",), (make_pos(1, 0),), 4096, 1_800_000_000_000)
    for name in ("message_id", "body_size", "arrival_ms", "attempts", "replaces"):
        env = attrs.evolve(base, **{name: n})  # type: ignore[arg-type]
        assert envelope_payload(*_fields(env)) == _envelope_payload_before_issue_18(env) == cbor2.dumps(env.to_map())
    env = attrs.evolve(base, body=(n, make_pos(2**32 - 1, 2**32 - 1), n))
    assert envelope_payload(*_fields(env)) == cbor2.dumps(env.to_map())


def test_envelope_payload_outside_its_fast_subset_is_cbor2s() -> None:
    """Bignums, negative numbers, bools and int or str subclasses in any field go to cbor2 and still match."""
    odd = [2**64, 2**70, -1, True, StartKind.ADMIN]
    for v in odd:
        for name in ("message_id", "body_size", "arrival_ms", "attempts", "replaces"):
            env = attrs.evolve(Envelope(make_pos(1, 32), "s", ("r",), (), 1, 2**40), **{name: v})  # type: ignore[arg-type]
            assert envelope_payload(*_fields(env)) == cbor2.dumps(env.to_map())
        env = Envelope(make_pos(1, 32), "s", ("r",), (v, make_pos(1, 0)), 1, 2**40)
        assert envelope_payload(*_fields(env)) == cbor2.dumps(env.to_map())

    class Name(str):
        pass

    env = Envelope(make_pos(1, 32), Name("s"), (Name("r"),), (), 1, 2**40, in_doubt=(Name("r"),))
    assert envelope_payload(*_fields(env)) == cbor2.dumps(env.to_map())
    with pytest.raises(UnicodeEncodeError):
        envelope_payload(1, "s", ("\udc80",), (), 0, 0)
