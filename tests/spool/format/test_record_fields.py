"""``decode_fields``: the bulk readers' decode path is the same codec as ``decode_payload``."""

from __future__ import annotations

from typing import Any

import attrs
import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from record_strategies import deliveries, envelopes, finishes, starts

from spool.errors import CorruptRecord
from spool.format.record import (
    Delivery,
    Outcome,
    Payload,
    RecordType,
    Start,
    StartKind,
    Status,
    decode_fields,
    decode_payload,
    payload_bytes,
    payload_type,
)

NON_DATA = [t for t in RecordType if t is not RecordType.DATA]


def plain(rec: Any) -> tuple[Any, ...]:
    """A record's attributes as decode_fields gives them: outcomes as tuples, enums as ints."""

    def value(v: Any) -> Any:
        if isinstance(v, Outcome):
            return plain(v)
        if isinstance(v, tuple):
            return tuple(value(x) for x in v)
        if isinstance(v, (Status, StartKind)):
            return int(v)
        return v

    return tuple(value(getattr(rec, a.name)) for a in attrs.fields(type(rec)))


def types_of(fields: tuple[Any, ...]) -> list[type]:
    out: list[type] = []
    for f in fields:
        if isinstance(f, tuple):
            for x in f:
                out.extend(types_of(x) if isinstance(x, tuple) else [type(x)])
        else:
            out.append(type(f))
    return out


@settings(max_examples=80, deadline=None)
@given(rec=st.one_of(envelopes, starts, deliveries, finishes))
def test_fields_are_the_records_attributes_as_plain_values(rec: Payload) -> None:
    fields = decode_fields(payload_type(rec), payload_bytes(rec))
    assert fields == plain(rec)
    assert all(t in (int, str, bool, dict, type(None)) for t in types_of(fields))  # no enum, no record object
    assert decode_fields(payload_type(rec), memoryview(payload_bytes(rec))) == fields


@settings(max_examples=150, deadline=None)
@given(rtype=st.sampled_from(NON_DATA), payload=st.binary(max_size=80))
def test_fields_fail_exactly_when_decode_payload_fails(rtype: RecordType, payload: bytes) -> None:
    try:
        rec = decode_payload(rtype, payload, path="x.seg", offset=32)
    except CorruptRecord as exc:
        with pytest.raises(CorruptRecord) as info:
            decode_fields(rtype, payload, path="x.seg", offset=32)
        assert (info.value.path, info.value.offset, str(info.value)) == (exc.path, exc.offset, str(exc))
    else:
        assert decode_fields(rtype, payload) == plain(rec)


WRONG = ["x", -1, 2**64, 1.5, None, True, [1], {0: 1}, b"ab"]


@settings(max_examples=120, deadline=None)
@given(rec=st.one_of(envelopes, starts, deliveries, finishes), data=st.data())
def test_an_ill_typed_field_is_corrupt_for_both(rec: Payload, data: st.DataObject) -> None:
    rtype = payload_type(rec)
    d = cbor2.loads(payload_bytes(rec))
    key = data.draw(st.integers(0, 10), label="key")
    d[key] = data.draw(st.sampled_from(WRONG), label="value")
    payload = cbor2.dumps(d)
    try:
        rec2 = decode_payload(rtype, payload)
    except CorruptRecord:
        with pytest.raises(CorruptRecord):
            decode_fields(rtype, payload)
    else:
        assert decode_fields(rtype, payload) == plain(rec2)


@pytest.mark.parametrize(("rtype", "m"), [
    (RecordType.DELIVERY, {0: 1, 1: 2, 2: [["a@b", len(Status), 250, "", "", ""]]}),
    (RecordType.DELIVERY, {0: 1, 1: 2, 2: [["a@b", 0, 250, "", ""]]}),
    (RecordType.START, {0: 1, 1: 2, 2: len(StartKind)}),
    (RecordType.DATA, {0: 1}),
    (RecordType.FINISH, [1, 2]),
])
def test_out_of_range_enums_short_outcomes_data_and_non_maps_are_corrupt(rtype: RecordType, m: Any) -> None:
    payload = cbor2.dumps(m)
    with pytest.raises(CorruptRecord):
        decode_fields(rtype, payload)
    if rtype is not RecordType.DATA:
        with pytest.raises(CorruptRecord):
            decode_payload(rtype, payload)


def test_the_largest_enum_values_decode_as_the_records_do() -> None:
    d = Delivery(7, 8, (Outcome("a@b", Status.DELETED, 550, "5.0.0", "gone", "mx"),), 3)
    assert decode_fields(RecordType.DELIVERY, d.to_payload()) == \
        (7, 8, (("a@b", 4, 550, "5.0.0", "gone", "mx"),), 3, (), "")
    assert decode_payload(RecordType.DELIVERY, d.to_payload()) == d
    s = Start(5, 6, StartKind.CARRY)
    assert decode_fields(RecordType.START, s.to_payload()) == (5, 6, 3)
    assert decode_payload(RecordType.START, s.to_payload()) == s
