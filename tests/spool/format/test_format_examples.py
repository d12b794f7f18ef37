"""docs/format.md's worked examples, rebuilt with the real code and compared byte for byte.

The hex is parsed out of the document itself (fenced blocks tagged ``hex NAME``),
so the document cannot drift from the code. Each block line is
``OFFSET  HEX BYTES  annotation``; the offsets must run on without gaps.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
from crc32c import crc32c

from spool.errors import CorruptRecord
from spool.fileio import OsFileIO
from spool.format.checkpoint import Checkpoint
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
    Status,
    decode_frame,
    decode_payload,
    encode_frame,
    format_id,
    format_pos,
    make_pos,
    payload_bytes,
    payload_type,
)
from spool.format.segment import decode_segment_header, encode_segment_header, segment_name
from spool.read.reader import LogReader

DOC = Path(__file__).resolve().parents[3] / "docs" / "format.md"
SEG = 1
T = 1700000000
BODY = b"Subject: hi\r\n\r\nhello\r\n"

# Named hex blocks (name -> offset of the first byte, bytes); the example: whole segment, pieces, records.
Blocks = dict[str, tuple[int, bytes]]
Example = tuple[bytes, Blocks, dict[str, Payload]]

_BLOCK = re.compile(r"^```hex ([\w-]+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_LINE = re.compile(r"^([0-9a-f]{4,8})  ((?:[0-9a-f]{2} )*[0-9a-f]{2})(?:  .*)?$")


def parse_blocks(text: str) -> Blocks:
    """Map block name to (offset of its first byte, bytes)."""
    blocks: Blocks = {}
    for name, body in _BLOCK.findall(text):
        start: int | None = None
        data = bytearray()
        for line in body.splitlines():
            m = _LINE.match(line)
            assert m, f"block {name}: cannot parse line {line!r}"
            off = int(m.group(1), 16)
            if start is None:
                start = off
            assert off == start + len(data), f"block {name}: offset {off:#x} does not follow on"
            data += bytes.fromhex(m.group(2))
        assert name not in blocks, f"block {name} appears twice"
        assert start is not None, f"block {name} is empty"
        blocks[name] = (start, bytes(data))
    return blocks


def build_example() -> Example:
    """The example segment as the real code writes it: whole file, named pieces, records."""
    header = encode_segment_header(SEG, T)
    pieces: Blocks = {"segment-header": (0, header)}
    records: dict[str, Payload] = {}
    out = bytearray(header)

    def add(name: str, p: Payload, time: int) -> int:
        pos = make_pos(SEG, len(out))
        frame = encode_frame(SEG, payload_type(p), payload_bytes(p), time=time)
        pieces[name] = (len(out), frame)
        records[name] = p
        out.extend(frame)
        return pos

    data = add("data", BODY, T)
    env = make_pos(SEG, len(out))
    add("envelope", Envelope(env, "a@example.org", ("b@example.net",), (data,), len(BODY), T * 1000), T)
    start = add("start", Start(env, (T + 60) * 1000), T + 60)
    outcome = Outcome("b@example.net", Status.DELIVERED, 250, "2.0.0", "OK", "mx.example.net")
    add("delivery", Delivery(start, (T + 61) * 1000, (outcome,), 850), T + 61)
    add("finish", Finish(start, (T + 61) * 1000), T + 61)

    start_off = pieces["start"][0]
    marked = encode_frame(SEG, RecordType.START, payload_bytes(records["start"]), time=T + 60, flags=1)
    pieces["start-garbage"] = (start_off, marked[:HEADER_SIZE])
    return bytes(out), pieces, records


@pytest.fixture(scope="module")
def doc_blocks() -> Blocks:
    return parse_blocks(DOC.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def example() -> Example:
    return build_example()


def test_doc_has_exactly_the_examples_the_code_builds(doc_blocks: Blocks, example: Example) -> None:
    _, pieces, _ = example
    # "marks" is the workers' marks file, asserted by tests/spool/format/test_marks.py.
    assert set(doc_blocks) == set(pieces) | {"checkpoint", "marks"}


def example_checkpoint() -> Checkpoint:
    """The checkpoint of the document's example: taken after the segment's message finished."""
    head, first = make_pos(SEG, 312), make_pos(SEG, 32)
    return Checkpoint(head, head, first, (head, first, first), (T + 62) * 1000, 1, 0)


def test_doc_checkpoint_equals_code_and_reads_back(doc_blocks: Blocks) -> None:
    doc_off, doc_bytes = doc_blocks["checkpoint"]
    cp = example_checkpoint()
    assert doc_off == 0
    assert doc_bytes.hex(" ") == cp.to_bytes().hex(" ")
    assert len(doc_bytes) == 94  # the size the document states
    assert Checkpoint.from_bytes(doc_bytes, "checkpoint") == cp


@pytest.mark.parametrize(
    "name", ["segment-header", "data", "envelope", "start", "start-garbage", "delivery", "finish"]
)
def test_doc_hex_equals_code(doc_blocks: Blocks, example: Example, name: str) -> None:
    _, pieces, _ = example
    doc_off, doc_bytes = doc_blocks[name]
    code_off, code_bytes = pieces[name]
    assert doc_off == code_off, f"{name}: doc places it at {doc_off:#x}, code at {code_off:#x}"
    assert doc_bytes.hex(" ") == code_bytes.hex(" ")


def test_doc_blocks_concatenate_to_the_whole_segment(doc_blocks: Blocks, example: Example) -> None:
    whole, _, _ = example
    names = ["segment-header", "data", "envelope", "start", "delivery", "finish"]
    assert b"".join(doc_blocks[n][1] for n in names) == whole
    assert len(whole) == 312  # the size the document states


def test_example_segment_reads_back_as_the_records(example: Example, tmp_path: Path) -> None:
    whole, pieces, records = example
    path = tmp_path / segment_name(SEG)
    path.write_bytes(whole)
    assert path.name == "0000000000000001.seg"
    assert decode_segment_header(whole, str(path), SEG) == (SEG, T)
    walk = LogReader(OsFileIO(), str(tmp_path), segments=(SEG,)).segment(SEG)
    items = list(walk)
    frames = [f for f in items if isinstance(f, Frame)]
    assert frames == items  # an anomaly would be in the walk too
    assert walk.valid_end == len(whole)
    names = ["data", "envelope", "start", "delivery", "finish"]
    assert [f.pos for f in frames] == [make_pos(SEG, pieces[n][0]) for n in names]
    assert [decode_payload(f.rtype, f.payload) for f in frames] == [records[n] for n in names]


def test_example_positions_and_queue_id_as_documented(example: Example) -> None:
    _, pieces, records = example
    env = records["envelope"]
    assert isinstance(env, Envelope)
    assert env.message_id == make_pos(SEG, pieces["envelope"][0]) == 0x100000046
    assert format_id(env.message_id) == "100000046"
    assert format_pos(env.message_id) == "1:70"
    assert [format_pos(make_pos(SEG, pieces[n][0])) for n in ["data", "start", "delivery", "finish"]] == [
        "1:32",
        "1:153",
        "1:190",
        "1:275",
    ]


@pytest.mark.parametrize("name", ["data", "envelope", "start", "delivery", "finish"])
def test_documented_checksum_recipe(doc_blocks: Blocks, name: str) -> None:
    """CRC-32C over salt, bytes 4..8, bytes 10..15, payload, computed independently of record.py."""
    _, frame = doc_blocks[name]
    salt = struct.pack("<Q", SEG)
    expected = crc32c(salt + frame[4:9] + frame[10:16] + frame[16:])
    assert struct.unpack_from("<I", frame)[0] == expected
    assert crc32c(b"123456789") == 0xE3069283


def test_documented_header_checksum_covers_bytes_0_to_27(doc_blocks: Blocks) -> None:
    _, header = doc_blocks["segment-header"]
    assert struct.unpack_from("<I", header, 28)[0] == crc32c(header[:28])


def test_garbage_mark_changes_only_the_flags_byte(example: Example) -> None:
    _, pieces, _ = example
    _, plain = pieces["start"]
    marked = bytearray(plain)
    marked[FLAGS_OFFSET] = 0x01
    assert bytes(marked[:HEADER_SIZE]) == pieces["start-garbage"][1]
    assert decode_frame(SEG, bytes(marked)).garbage
    assert not decode_frame(SEG, plain).garbage


def test_example_frame_fails_in_another_segment(example: Example) -> None:
    _, pieces, _ = example
    _, frame = pieces["envelope"]
    with pytest.raises(CorruptRecord) as info:
        decode_frame(SEG + 1, frame)
    assert "checksum mismatch" in str(info.value)
