"""Coverage-guided fuzzing of everything that parses bytes from disk, with atheris (libFuzzer).

``python -m fault_injection.fuzz_decoder [-runs=N] [-max_total_time=S] [CORPUS_DIR ...]``

Hypothesis already throws damaged segments and checkpoints at the engine
(tests/fault/test_fault_corrupt.py); libFuzzer adds what random damage rarely
reaches: inputs that pass one check and fail a deeper one, such as a frame
whose checksum is right but whose CBOR payload breaks the schema. The first
input byte picks the target; the rest is the bytes on disk. A target may
return a value or raise a ``SpoolError`` (a clear message naming file and
offset); any other exception is a bug and stops the run with the input saved
by libFuzzer as ``crash-*``.

Frames are given their correct checksum half of the time (bit 0 of the
selector byte), so the fuzzer explores the payload decoders instead of
stopping at the CRC.
"""

from __future__ import annotations

import struct
import sys

import atheris

with atheris.instrument_imports(include=["spool"]):
    from spool.errors import SpoolError
    from spool.format.checkpoint import Checkpoint
    from spool.format.record import HEADER, HEADER_SIZE, RecordType, checksum, decode_frame, decode_payload
    from spool.format.segment import segment_header_fields
    from spool.read.reader import check_buffer

SEG = 7
_TYPES = [int(t) for t in RecordType]


def _with_crc(body: bytes) -> bytes:
    """Treat ``body`` as a frame and give it a correct length and checksum."""
    if len(body) < HEADER_SIZE:
        body = body + bytes(HEADER_SIZE - len(body))
    header, payload = bytearray(body[:HEADER_SIZE]), body[HEADER_SIZE:]
    struct.pack_into("<I", header, 4, len(payload))
    crc = checksum(SEG, bytes(header), payload)
    struct.pack_into("<I", header, 0, crc)
    return bytes(header) + payload


def one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    selector, rest = data[0], data[1:]
    target = selector >> 1
    fix_crc = bool(selector & 1)
    try:
        if target % 5 == 0:
            decode_payload(_TYPES[rest[0] % len(_TYPES)], rest[1:], path="fuzz", offset=0)
        elif target % 5 == 1:
            frame = _with_crc(rest) if fix_crc else rest
            f = decode_frame(SEG, frame, 0)
            decode_payload(f.rtype, f.payload, path="fuzz", offset=0)
        elif target % 5 == 2:
            body = _with_crc(rest) if fix_crc else rest
            for anomaly in check_buffer(SEG, body, 0, "fuzz", last=bool(selector & 2)):
                if not 0 <= anomaly.offset <= anomaly.offset + anomaly.length <= len(body):
                    raise AssertionError(f"the reader placed {anomaly} outside {len(body)} bytes")
        elif target % 5 == 3:
            Checkpoint.from_bytes(rest, "fuzz")
        else:
            segment_header_fields(rest, "fuzz", SEG)
    except SpoolError:
        pass


def main(argv: list[str] | None = None) -> None:
    assert HEADER.size == HEADER_SIZE
    atheris.Setup(sys.argv if argv is None else argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
