"""LogWriter.append frames records itself (the framing of encode_header inlined, the current
segment's buffer kept at hand): its bytes must be encode_frame's, across rotations, batches taken in the
middle, and batches put back after a write that found no room."""

from __future__ import annotations

import os
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

from spool.fileio import OsFileIO
from spool.format.record import HEADER_SIZE, RecordType, encode_frame, make_pos
from spool.format.segment import SEGMENT_HEADER_SIZE, encode_segment_header, segment_path
from spool.write.log import OWN_BUFFER, LogWriter

SEGMENT = 600
T0 = 1_800_000_000

records = st.tuples(st.sampled_from(list(RecordType)), st.binary(max_size=250), st.integers(0, 255),
                    st.integers(-3, 3))
# After each record: nothing, take a batch and write it (with or without sync), or take one and put it back
# (what a write that found no room does).
steps = st.lists(st.tuples(records, st.sampled_from(["", "", "", "write", "write_nosync", "restore"])),
                 max_size=40)


class Model:
    """The log as it must be: segment id -> bytes, built from encode_frame and encode_segment_header."""

    def __init__(self, segment_size: int = SEGMENT) -> None:
        self.segment_size = segment_size
        self.segments = {1: bytearray(encode_segment_header(1, T0))}
        self.seg = 1
        self.last = T0

    def append(self, rtype: int, payload: bytes, klass: int, now: int) -> int:
        t = max(now, self.last)
        self.last = t
        buf = self.segments[self.seg]
        if len(buf) + HEADER_SIZE + len(payload) > self.segment_size and len(buf) > SEGMENT_HEADER_SIZE:
            self.seg += 1
            buf = self.segments[self.seg] = bytearray(encode_segment_header(self.seg, t, len(buf)))
        pos = make_pos(self.seg, len(buf))
        buf += encode_frame(self.seg, rtype, payload, klass=klass, time=t)
        return pos


@settings(max_examples=150, deadline=None)
@given(steps=steps)
def test_appended_bytes_are_encode_frames_across_rotations_batches_and_restores(
        steps: list[tuple[tuple[RecordType, bytes, int, int], str]]) -> None:
    io = OsFileIO()
    with tempfile.TemporaryDirectory() as d:
        fd = io.open(segment_path(d, 1), create=True)
        io.write(fd, encode_segment_header(1, T0), 0)
        io.close(fd)
        w = LogWriter(io, d, SEGMENT, 1, SEGMENT_HEADER_SIZE, T0)
        model = Model()
        clock = T0
        try:
            for (rtype, payload, klass, dt), then in steps:
                clock = max(T0, clock + dt)  # the clock may step back: a record's time never does
                assert w.append(rtype, payload, klass=klass, now=clock + 0.5) == model.append(rtype, payload, klass,
                                                                                             clock)
                if then == "restore":
                    w.restore(w.take_batch())
                elif then:
                    w.write_batch(w.take_batch(sync=then == "write"))
            w.write_batch(w.take_batch())
            assert w.head == make_pos(model.seg, len(model.segments[model.seg]))
            for seg, data in model.segments.items():
                with open(segment_path(d, seg), "rb") as f:
                    assert f.read() == bytes(data), seg
            assert sorted(int(n[:16], 16) for n in os.listdir(d)) == sorted(model.segments)
        finally:
            w.close()


def test_a_body_chunk_is_buffered_alone_in_a_buffer_of_its_size_and_lands_where_the_model_says() -> None:
    """Why (docs/design.md, "Memory while a body streams"): a 50 MB body's chunks grew one shared buffer by
    realloc to megabytes, batch after batch, and left the loop's heap holes of every size; each now gets a
    buffer of exactly its frame's size, and the small records around it still share theirs."""
    io = OsFileIO()
    big = 1 << 20
    with tempfile.TemporaryDirectory() as d:
        fd = io.open(segment_path(d, 1), create=True)
        io.write(fd, encode_segment_header(1, T0), 0)
        io.close(fd)
        w = LogWriter(io, d, 4 * big, 1, SEGMENT_HEADER_SIZE, T0)
        model = Model(4 * big)
        try:
            payloads = [b"a" * 10, bytes([1]) * OWN_BUFFER, bytes([2]) * (256 * 1024), b"b" * 20, b"c" * 30,
                        bytes([3]) * (OWN_BUFFER - 1), bytes([4]) * big]
            for p in payloads:
                assert w.append(RecordType.DATA, p, now=T0) == model.append(RecordType.DATA, p, 0, T0)
            batch = w.take_batch()
            assert [len(data) for _, _, data in batch.chunks] == [
                HEADER_SIZE + 10, HEADER_SIZE + OWN_BUFFER, HEADER_SIZE + 256 * 1024,
                3 * HEADER_SIZE + 20 + 30 + OWN_BUFFER - 1, HEADER_SIZE + big]
            w.restore(batch)  # a write that found no room puts it back: the same bytes, the same places
            w.write_batch(w.take_batch())
            with open(segment_path(d, 1), "rb") as f:
                assert f.read() == bytes(model.segments[1])
        finally:
            w.close()
