"""Hypothesis strategies for the spool's records: positions, each record type, frames' header fields.

The codec tests (``tests/spool/format/test_record.py``) and the bulk decoder's tests
(``test_record_fields.py``) draw from the same strategies.
"""

from __future__ import annotations

from hypothesis import strategies as st

from spool.format.record import (
    GARBAGE,
    Delivery,
    Envelope,
    Finish,
    Outcome,
    Payload,
    Start,
    StartKind,
    Status,
    make_pos,
)

segment_ids = st.integers(0, 2**64 - 1)
offsets = st.integers(0, 2**32 - 1)
positions = st.builds(make_pos, segment_ids, offsets)
uints = st.integers(0, 2**64 - 1)
times_ms = st.integers(0, 2**48)
texts = st.text(max_size=20)
addresses = st.text(max_size=12).map(lambda s: s + "@example.org")

json_leaves = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8)
json_values = st.recursive(
    json_leaves,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)

envelopes = st.builds(
    Envelope,
    message_id=positions,
    sender=st.just("") | addresses,
    recipients=st.lists(addresses, min_size=1, max_size=4).map(tuple),
    body=st.lists(positions, max_size=4).map(tuple),
    body_size=uints,
    arrival_ms=times_ms,
    attempts=st.integers(0, 1000),
    replaces=st.none() | positions,
    held=st.booleans(),
    in_doubt=st.lists(addresses, max_size=3).map(tuple),
    extra=st.dictionaries(st.text(max_size=8), json_values, max_size=4),
)
starts = st.builds(Start, envelope=positions, time_ms=times_ms, kind=st.sampled_from(StartKind))
outcomes = st.builds(
    Outcome,
    recipient=addresses,
    status=st.sampled_from(Status),
    code=st.integers(0, 599),
    enhanced=texts,
    reply=texts,
    next_hop=texts,
)
deliveries = st.builds(
    Delivery,
    start=positions,
    time_ms=times_ms,
    outcomes=st.lists(outcomes, min_size=1, max_size=4).map(tuple),
    duration_ms=st.integers(0, 2**32),
    source=st.sampled_from(["", "192.0.2.10", "2001:db8::1"]),
)
finishes = st.builds(Finish, start=positions, time_ms=times_ms, replacement=st.none() | positions)
data_chunks = st.binary(max_size=300)
records: st.SearchStrategy[Payload] = st.one_of(envelopes, starts, deliveries, finishes, data_chunks)

frame_args = st.fixed_dictionaries(
    {"klass": st.integers(0, 255), "time": st.integers(0, 2**32 - 1), "flags": st.sampled_from([0, GARBAGE])}
)
