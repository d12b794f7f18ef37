"""Records: the framing of every entry in the log, and the payload of each type.

Theory of operation. The log is a sequence of frames. Each frame is a 16-byte
header and a payload::

    offset size field
    0      4    crc      CRC-32C (Castagnoli), little-endian, see below
    4      4    length   payload length in bytes, little-endian
    8      1    type     record type (RecordType)
    9      1    flags    bit 0: garbage; other bits reserved, written 0
    10     1    klass    runner class of an ENVELOPE (255: held); 0 otherwise
    11     1    reserved written 0, checked 0
    12     4    time     seconds since the Unix epoch when the record was appended
    16     n    payload  CBOR map with small integer keys (DATA: raw bytes)

The checksum covers, in this order, the segment id as 8 little-endian bytes
(a salt: a stale frame left over from an earlier life of a reused file cannot
pass), header bytes 4..8 and 10..15, and the payload. It does *not* cover the
flags byte, so the garbage mark can be set in place by a one-byte write with no
fsync: a lost mark is inferred again by recovery.

``klass`` and ``time`` sit in the header so that runners decide "is this due
for me?" without decoding CBOR: a runner decodes only the live envelopes of its
own class that it has to start.

A record's address is its *position*: ``segment_id << 32 | offset``. Positions
are monotonic over the whole life of a spool. docs/format.md is the same
description with worked examples; tests assert those examples byte for byte.
"""

from __future__ import annotations

import enum
import struct
from typing import Any, Final

import attrs
import cbor2
from crc32c import crc32c

from spool.errors import CorruptRecord, UnknownRecordType

HEADER = struct.Struct("<IIBBBBI")
HEADER_SIZE: Final = HEADER.size  # 16
FLAGS_OFFSET: Final = 9
GARBAGE: Final = 0x01
HELD_CLASS: Final = 255
MAX_PAYLOAD: Final = 16 * 1024 * 1024
_SALT = struct.Struct("<Q")


class RecordType(enum.IntEnum):
    ENVELOPE = 1
    START = 2
    DELIVERY = 3
    FINISH = 4
    DATA = 5


class Status(enum.IntEnum):
    """Per-recipient outcome in a DELIVERY record. Only DEFERRED is not final."""

    DELIVERED = 0
    DEFERRED = 1
    BOUNCED = 2
    EXPIRED = 3
    DELETED = 4

    @property
    def final(self) -> bool:
        return self is not Status.DEFERRED


class StartKind(enum.IntEnum):
    DELIVERY = 0
    ADMIN = 1
    RECOVERY = 2
    CARRY = 3  # the oldest runner carrying a held message forward


# -- positions ---------------------------------------------------------------


def make_pos(segment_id: int, offset: int) -> int:
    return (segment_id << 32) | offset


def pos_segment(pos: int) -> int:
    return pos >> 32


def pos_offset(pos: int) -> int:
    return pos & 0xFFFFFFFF


def format_pos(pos: int) -> str:
    """Human form ``segment:offset``, as spoolctl prints and accepts it."""
    return f"{pos_segment(pos)}:{pos_offset(pos)}"


def parse_pos(text: str) -> int:
    """Accept ``segment:offset`` or a plain integer position."""
    try:
        if ":" in text:
            seg, off = text.split(":", 1)
            return make_pos(int(seg), int(off))
        return int(text, 0)
    except ValueError:
        raise ValueError(f"not a position: {text!r} (want SEGMENT:OFFSET)") from None


def format_id(message_id: int) -> str:
    """Queue ids are the position of the message's first envelope, in hex."""
    return f"{message_id:X}"


def parse_id(text: str) -> int:
    try:
        return int(text, 16)
    except ValueError:
        raise ValueError(f"not a queue id: {text!r}") from None


# -- framing -----------------------------------------------------------------

# What the checksum covers, packed at once: the salt, then header bytes 4..8
# (length, type) and 10..15 (class, reserved, time). One pack and two crc32c
# calls per frame: the append and scan paths run this per record.
# Public for ``LogWriter.append``, which frames each record itself.
CRC_PREFIX: Final = struct.Struct("<QIBBBI")
_pack_header = HEADER.pack
_unpack_header = HEADER.unpack_from
_pack_crc_prefix = CRC_PREFIX.pack


def checksum(segment_id: int, header: bytes | memoryview, payload: bytes | memoryview) -> int:
    _crc, length, rtype, _flags, klass, reserved, time = _unpack_header(header)
    return crc32c(payload, crc32c(_pack_crc_prefix(segment_id, length, rtype, klass, reserved, time)))


def encode_header(
    segment_id: int, rtype: int, payload: bytes, *, klass: int = 0, time: int = 0, flags: int = 0
) -> bytes:
    """The frame's header for ``payload``; the frame is this followed by the payload.

    Apart from ``encode_frame`` so that the log writer can append a 256 KiB body
    chunk to its batch without first building a copy of it with the header in front.
    """
    n = len(payload)
    if n > MAX_PAYLOAD:
        raise ValueError(f"payload of {n} bytes exceeds {MAX_PAYLOAD}")
    crc = crc32c(payload, crc32c(_pack_crc_prefix(segment_id, n, rtype, klass, 0, time)))
    return _pack_header(crc, n, rtype, flags, klass, 0, time)


def encode_frame(
    segment_id: int, rtype: int, payload: bytes, *, klass: int = 0, time: int = 0, flags: int = 0
) -> bytes:
    return encode_header(segment_id, rtype, payload, klass=klass, time=time, flags=flags) + payload


@attrs.frozen
class Frame:
    """A decoded frame: header fields plus the raw payload."""

    pos: int
    rtype: int
    flags: int
    klass: int
    time: int
    payload: bytes

    @property
    def garbage(self) -> bool:
        return bool(self.flags & GARBAGE)

    @property
    def size(self) -> int:
        return HEADER_SIZE + len(self.payload)


def check_frame(segment_id: int, buf: bytes | memoryview, offset: int) -> tuple[int, int, int, int, int]:
    """Verify the frame at ``offset`` of ``buf``; return (type, flags, class, time, end offset).

    Why apart from decode_frame: validating a log (``spool.read.reader``) and reading one
    field need no Frame and no copy of the payload. Raises CorruptRecord as
    decode_frame does.
    """
    if len(buf) - offset < HEADER_SIZE:
        raise CorruptRecord("truncated header", offset=offset)
    crc, length, rtype, flags, klass, reserved, time = _unpack_header(buf, offset)
    start = offset + HEADER_SIZE
    end = start + length
    if length > MAX_PAYLOAD or end > len(buf):
        raise CorruptRecord(f"length {length} runs past the end of the data", offset=offset)
    if crc32c(buf[start:end], crc32c(_pack_crc_prefix(segment_id, length, rtype, klass, reserved, time))) != crc:
        raise CorruptRecord("checksum mismatch", offset=offset)
    if reserved or flags & ~GARBAGE:
        raise CorruptRecord("reserved bits set", offset=offset)
    if rtype not in _TYPES:
        raise UnknownRecordType(f"unknown record type {rtype}", offset=offset)
    return rtype, flags, klass, time, end


def frame_payload(segment_id: int, buf: bytes | memoryview, offset: int) -> bytes:
    """The payload of the frame at ``offset`` of ``buf``, checksum verified.

    For a reader that has already chosen the record by its header (a runner's
    candidate envelope) and wants only its payload. Raises CorruptRecord.
    """
    end = check_frame(segment_id, buf, offset)[4]
    return bytes(buf[offset + HEADER_SIZE : end])


def decode_frame(segment_id: int, buf: bytes | memoryview, offset: int = 0, *, at: int | None = None) -> Frame:
    """Decode the frame at ``offset`` of ``buf``.

    The frame's position is ``segment_id:offset``, or ``segment_id:at`` when
    ``buf`` does not begin at segment offset 0 (a read window starting at some
    other offset): ``at`` is then the frame's offset in the segment.

    Raises CorruptRecord for a short header, a length past the buffer, a
    checksum mismatch, nonzero reserved bits or an unknown type.
    """
    rtype, flags, klass, time, end = check_frame(segment_id, buf, offset)
    return Frame(make_pos(segment_id, offset if at is None else at), rtype, flags, klass, time,
                 bytes(buf[offset + HEADER_SIZE : end]))


_TYPES = frozenset(int(t) for t in RecordType)


# -- CBOR encoding ---------------------------------------------------------------
#
# Payloads are encoded here, not by cbor2.dumps: cbor2 costs about 3 us for an
# envelope map, most of the 5 us per record that 200k records/s allows, where
# these functions take about half. The bytes are exactly cbor2's (shortest
# argument form, definite lengths, map keys in insertion order; tests compare
# every payload type with cbor2.dumps of its map). Anything outside the small
# subset handled here (the relay's ``extra`` map, integers outside 0..2**64-1,
# int or str subclasses) is handed to cbor2.dumps, whose output embeds as it is
# because a CBOR item is self-delimiting.

_SHORT = tuple(tuple(bytes((major << 5 | n,)) for n in range(24)) for major in range(8))
_UINT_SHORT = _SHORT[0]
_TEXT_SHORT = _SHORT[3]
_P8, _P16, _P32, _P64 = (struct.Struct(f">B{code}").pack for code in "BHIQ")


def _cbor_head(major: int, n: int) -> bytes:
    """The initial byte(s) of an item of ``major`` type with argument ``n``."""
    if n < 24:
        return _SHORT[major][n]
    mt = major << 5
    if n < 0x100:
        return _P8(mt | 24, n)
    if n < 0x10000:
        return _P16(mt | 25, n)
    if n < 0x100000000:
        return _P32(mt | 26, n)
    return _P64(mt | 27, n)


def _cbor_uint(v: int) -> bytes:
    # _cbor_head inlined: this runs several times per record.
    if type(v) is int and v >= 0:
        if v < 24:
            return _UINT_SHORT[v]
        if v < 0x100:
            return _P8(24, v)
        if v < 0x10000:
            return _P16(25, v)
        if v < 0x100000000:
            return _P32(26, v)
        if v < 0x10000000000000000:
            return _P64(27, v)
    return cbor2.dumps(v)


def _cbor_text(v: str) -> bytes:
    if type(v) is str:
        b = v.encode()  # a lone surrogate raises UnicodeEncodeError, as in cbor2
        n = len(b)
        return (_TEXT_SHORT[n] if n < 24 else _cbor_head(3, n)) + b
    return cbor2.dumps(v)


# -- payloads ----------------------------------------------------------------


def _opt(d: dict[int, Any], key: int, default: Any) -> Any:
    return d.get(key, default)


# Decoded CBOR is checked against the schema: a payload whose checksum passes
# but whose fields have the wrong type is corrupt, not a record (TypeError here
# becomes CorruptRecord in decode_payload).


def _uint(v: Any) -> int:
    if type(v) is not int or v < 0:
        raise TypeError(f"expected an unsigned integer, got {type(v).__name__}")
    return v


def _opt_uint(v: Any) -> int | None:
    return None if v is None else _uint(v)


def _text(v: Any) -> str:
    if type(v) is not str:
        raise TypeError(f"expected text, got {type(v).__name__}")
    return v


def _bool(v: Any) -> bool:
    if type(v) is not bool:
        raise TypeError(f"expected a boolean, got {type(v).__name__}")
    return v


def _array(v: Any) -> list[Any]:
    if type(v) is not list:
        raise TypeError(f"expected an array, got {type(v).__name__}")
    return v


def _uints(v: Any) -> tuple[int, ...]:
    a = _array(v)
    for x in a:  # a loop, not a generator of _uint calls: decoding runs this per record
        if type(x) is not int or x < 0:
            raise TypeError(f"expected an unsigned integer, got {type(x).__name__}")
    return tuple(a)


def _texts(v: Any) -> tuple[str, ...]:
    a = _array(v)
    for x in a:
        if type(x) is not str:
            raise TypeError(f"expected text, got {type(x).__name__}")
    return tuple(a)


def _text_map(v: Any) -> dict[str, Any]:
    if type(v) is not dict or not all(type(k) is str for k in v):
        raise TypeError("expected a map with text keys")
    return v


def _enum_value(v: Any, members: tuple[Any, ...], name: str) -> int:
    """``v`` checked as a value of an IntEnum whose values are 0..n-1, kept an int
    (indexing ``members`` is the enum member, without the cost of calling the enum)."""
    n = _uint(v)
    if n >= len(members):
        raise ValueError(f"{n} is not a valid {name}")
    return n


# Field tuples: each payload's fields checked against the schema, in the order of
# the record class's attributes, as plain values (outcomes as 6-tuples, status and
# kind as ints). from_map builds the record from them, and decode_fields returns
# them to bulk readers: one reading of the schema serves both.


def _envelope_fields(d: dict[int, Any]) -> tuple[Any, ...]:
    return (_uint(d[0]), _text(d[1]), _texts(d[2]), _uints(d[3]), _uint(d[4]), _uint(d[5]), _uint(_opt(d, 6, 0)),
            _opt_uint(_opt(d, 7, None)), _bool(_opt(d, 8, False)), _texts(_opt(d, 9, [])),
            dict(_text_map(_opt(d, 10, {}))))


def _start_fields(d: dict[int, Any]) -> tuple[Any, ...]:
    return _uint(d[0]), _uint(d[1]), _enum_value(_opt(d, 2, 0), _START_KINDS, "StartKind")


def _outcome_fields(v: Any) -> tuple[Any, ...]:
    if len(_array(v)) != 6:
        raise ValueError(f"an outcome has 6 items, not {len(v)}")
    return (_text(v[0]), _enum_value(v[1], _STATUSES, "Status"), _uint(v[2]), _text(v[3]), _text(v[4]),
            _text(v[5]))


def _delivery_fields(d: dict[int, Any]) -> tuple[Any, ...]:
    return (_uint(d[0]), _uint(d[1]), tuple(map(_outcome_fields, _array(d[2]))), _uint(_opt(d, 3, 0)),
            _texts(_opt(d, 4, [])), _text(_opt(d, 5, "")))


def _finish_fields(d: dict[int, Any]) -> tuple[Any, ...]:
    return _uint(d[0]), _uint(d[1]), _opt_uint(_opt(d, 2, None))


_STATUSES: Final = tuple(Status)
_START_KINDS: Final = tuple(StartKind)
assert all(m.value == i for members in (_STATUSES, _START_KINDS) for i, m in enumerate(members))


# Positions (segment ids 1 .. 2**32-1) and times in milliseconds (2**32 ms is 1970-02-19) are
# 8-byte CBOR integers: the envelope's fixed parts are packed with one struct call each.
_U32: Final = 1 << 32
_U64: Final = 1 << 64
_MAP_SHORT = _SHORT[5]
_ARRAY_SHORT = _SHORT[4]
_MAP_ID = struct.Struct(">BBBQB").pack  # map head, key 0, uint64 head, the message id, key 1
_UINT64 = struct.Struct(">BQ").pack  # uint64 head, the value
_ARRIVAL = struct.Struct(">BBQB").pack  # key 5, uint64 head, arrival_ms, key 6
_KEY2_ARRAY = tuple(b"\x02" + head for head in _ARRAY_SHORT)  # key 2 (recipients) and a short array's head
_KEY3_ARRAY = tuple(b"\x03" + head for head in _ARRAY_SHORT)  # key 3 (body)


def envelope_payload(message_id: int, sender: str, recipients: tuple[str, ...], body: tuple[int, ...],
                     body_size: int, arrival_ms: int, attempts: int = 0, replaces: int | None = None,
                     held: bool = False, in_doubt: tuple[str, ...] = (), extra: dict[str, Any] | None = None) -> bytes:
    """The ENVELOPE payload of these fields: ``Envelope(...).to_payload()`` without building the record.

    Why a function of the fields: a new message's envelope is encoded once and
    never read back, so its append (``SpoolCore.append_message``) need not
    build the frozen attrs record first (about 1 us of the 3 us a batched
    append took). The bytes are cbor2's of ``Envelope.to_map()``
    (tests compare them over generated envelopes and every length boundary).
    """
    if replaces is None and not held and not in_doubt and not extra:
        n = 7  # a new message: the common case, tested first so that it adds nothing up
    else:
        n = 7 + (replaces is not None) + bool(held) + bool(in_doubt) + bool(extra)
    if type(message_id) is int and _U32 <= message_id < _U64:
        parts = [_MAP_ID(0xA0 | n, 0, 0x1B, message_id, 1)]
    else:
        parts = [_MAP_SHORT[n], b"\x00", _cbor_uint(message_id), b"\x01"]
    add = parts.append
    add(_cbor_text(sender))
    k = len(recipients)
    add(_KEY2_ARRAY[k] if k < 24 else b"\x02" + _cbor_head(4, k))
    parts += map(_cbor_text, recipients)
    k = len(body)
    add(_KEY3_ARRAY[k] if k < 24 else b"\x03" + _cbor_head(4, k))
    for p in body:
        add(_UINT64(0x1B, p) if type(p) is int and _U32 <= p < _U64 else _cbor_uint(p))
    add(b"\x04")
    add(_cbor_uint(body_size))
    if type(arrival_ms) is int and _U32 <= arrival_ms < _U64:
        add(_ARRIVAL(5, 0x1B, arrival_ms, 6))
    else:
        parts += (b"\x05", _cbor_uint(arrival_ms), b"\x06")
    add(_cbor_uint(attempts))
    if n == 7:
        return b"".join(parts)
    if replaces is not None:
        parts += (b"\x07", _cbor_uint(replaces))
    if held:
        add(b"\x08\xf5")
    if in_doubt:
        k = len(in_doubt)
        add(b"\x09" + (_ARRAY_SHORT[k] if k < 24 else _cbor_head(4, k)))
        parts += map(_cbor_text, in_doubt)
    if extra:
        parts += (b"\x0a", cbor2.dumps(extra))
    return b"".join(parts)


@attrs.frozen
class Envelope:
    """A message waiting in the queue: who from, who to, where its body lies.

    ``message_id`` stays the same across replacements (it is the position of the
    first envelope). ``recipients`` are those still to be tried. ``extra`` is the
    relay's own metadata (ESMTP parameters, client address, last error); the
    spool stores it and never interprets it.
    """

    message_id: int
    sender: str
    recipients: tuple[str, ...]
    body: tuple[int, ...]
    body_size: int
    arrival_ms: int
    attempts: int = 0
    replaces: int | None = None
    held: bool = False
    in_doubt: tuple[str, ...] = ()
    extra: dict[str, Any] = attrs.field(factory=dict, hash=False)

    def to_map(self) -> dict[int, Any]:
        """The CBOR map; to_payload writes the same bytes that cbor2.dumps of it would."""
        d: dict[int, Any] = {
            0: self.message_id,
            1: self.sender,
            2: list(self.recipients),
            3: list(self.body),
            4: self.body_size,
            5: self.arrival_ms,
            6: self.attempts,
        }
        if self.replaces is not None:
            d[7] = self.replaces
        if self.held:
            d[8] = True
        if self.in_doubt:
            d[9] = list(self.in_doubt)
        if self.extra:
            d[10] = self.extra
        return d

    def to_payload(self) -> bytes:
        return envelope_payload(self.message_id, self.sender, self.recipients, self.body, self.body_size,
                                self.arrival_ms, self.attempts, self.replaces, self.held, self.in_doubt, self.extra)

    @classmethod
    def from_map(cls, d: dict[int, Any]) -> Envelope:
        return cls(*_envelope_fields(d))


@attrs.frozen
class Start:
    """A claim on an envelope: a delivery attempt (or an admin change) began."""

    envelope: int
    time_ms: int
    kind: StartKind = StartKind.DELIVERY

    def to_map(self) -> dict[int, Any]:
        d: dict[int, Any] = {0: self.envelope, 1: self.time_ms}
        if self.kind is not StartKind.DELIVERY:
            d[2] = int(self.kind)
        return d

    def to_payload(self) -> bytes:
        if self.kind is not StartKind.DELIVERY:
            return b"".join((b"\xa3\x00", _cbor_uint(self.envelope), b"\x01", _cbor_uint(self.time_ms),
                             b"\x02", _cbor_uint(int(self.kind))))
        return b"".join((b"\xa2\x00", _cbor_uint(self.envelope), b"\x01", _cbor_uint(self.time_ms)))

    @classmethod
    def from_map(cls, d: dict[int, Any]) -> Start:
        envelope, time_ms, kind = _start_fields(d)
        return cls(envelope, time_ms, _START_KINDS[kind])


@attrs.frozen
class Outcome:
    """What happened to one recipient in one attempt."""

    recipient: str
    status: Status
    code: int = 0
    enhanced: str = ""
    reply: str = ""
    next_hop: str = ""

    def to_list(self) -> list[Any]:
        return [self.recipient, int(self.status), self.code, self.enhanced, self.reply, self.next_hop]

    def to_cbor(self) -> bytes:
        """CBOR of to_list()."""
        return b"".join((b"\x86", _cbor_text(self.recipient), _cbor_uint(int(self.status)), _cbor_uint(self.code),
                         _cbor_text(self.enhanced), _cbor_text(self.reply), _cbor_text(self.next_hop)))

    @classmethod
    def from_list(cls, v: list[Any]) -> Outcome:
        return cls._from_fields(_outcome_fields(v))

    @classmethod
    def _from_fields(cls, f: tuple[Any, ...]) -> Outcome:
        return cls(f[0], _STATUSES[f[1]], f[2], f[3], f[4], f[5])


@attrs.frozen
class Delivery:
    """A delta: outcomes for some recipients of the attempt begun by ``start``.

    ``sending``: recipients whose data's end (the final dot) is about to be
    written to the next hop. A DELIVERY that names them (with no outcomes) is
    the attempt's *point of no return*: it is durable before that write, so
    recovery holds in doubt exactly the recipients it names that have no
    outcome (docs/design.md, "The point of no return").
    """

    start: int
    time_ms: int
    outcomes: tuple[Outcome, ...]
    duration_ms: int = 0
    sending: tuple[str, ...] = ()
    source: str = ""  # the local address the attempt was sent from (``[egress]``), "" for the system's choice

    def to_map(self) -> dict[int, Any]:
        d: dict[int, Any] = {0: self.start, 1: self.time_ms, 2: [o.to_list() for o in self.outcomes]}
        if self.duration_ms:
            d[3] = self.duration_ms
        if self.sending:
            d[4] = list(self.sending)
        if self.source:
            d[5] = self.source
        return d

    def to_payload(self) -> bytes:
        n = 3 + bool(self.duration_ms) + bool(self.sending) + bool(self.source)
        parts = [_MAP_SHORT[n] + b"\x00", _cbor_uint(self.start),
                 b"\x01", _cbor_uint(self.time_ms), b"\x02", _cbor_head(4, len(self.outcomes))]
        parts += [o.to_cbor() for o in self.outcomes]
        if self.duration_ms:
            parts += (b"\x03", _cbor_uint(self.duration_ms))
        if self.sending:
            parts += (b"\x04", _cbor_head(4, len(self.sending)), *map(_cbor_text, self.sending))
        if self.source:
            parts += (b"\x05", _cbor_text(self.source))
        return b"".join(parts)

    @classmethod
    def from_map(cls, d: dict[int, Any]) -> Delivery:
        start, time_ms, outcomes, duration_ms, sending, source = _delivery_fields(d)
        return cls(start, time_ms, tuple(map(Outcome._from_fields, outcomes)), duration_ms, sending, source)


@attrs.frozen
class Finish:
    """The attempt begun by ``start`` is over; ``replacement`` names the envelope
    that carries the message on, if any."""

    start: int
    time_ms: int
    replacement: int | None = None

    def to_map(self) -> dict[int, Any]:
        d: dict[int, Any] = {0: self.start, 1: self.time_ms}
        if self.replacement is not None:
            d[2] = self.replacement
        return d

    def to_payload(self) -> bytes:
        if self.replacement is not None:
            return b"".join((b"\xa3\x00", _cbor_uint(self.start), b"\x01", _cbor_uint(self.time_ms),
                             b"\x02", _cbor_uint(self.replacement)))
        return b"".join((b"\xa2\x00", _cbor_uint(self.start), b"\x01", _cbor_uint(self.time_ms)))

    @classmethod
    def from_map(cls, d: dict[int, Any]) -> Finish:
        return cls(*_finish_fields(d))


Payload = Envelope | Start | Delivery | Finish | bytes

_DECODERS: dict[int, Any] = {
    RecordType.ENVELOPE: Envelope.from_map,
    RecordType.START: Start.from_map,
    RecordType.DELIVERY: Delivery.from_map,
    RecordType.FINISH: Finish.from_map,
}


def decode_payload(rtype: int, payload: bytes, *, path: str = "", offset: int = -1) -> Payload:
    """Decode a payload whose frame checksum already passed.

    A payload that passes its checksum but does not match its schema is still
    corrupt (written by a bug, or by a newer version): CorruptRecord.
    """
    if rtype == RecordType.DATA:
        return payload
    result: Payload = _decode_map(_DECODERS, rtype, payload, path, offset)
    return result


def _decode_map(table: dict[int, Any], rtype: int, payload: bytes | memoryview, path: str, offset: int) -> Any:
    """CBOR map -> ``table[rtype](map)``; any schema or CBOR failure is CorruptRecord at ``path``, ``offset``."""
    try:
        d = cbor2.loads(payload)
        if not isinstance(d, dict):
            raise TypeError("payload is not a map")
        return table[rtype](d)
    except (cbor2.CBORDecodeError, KeyError, TypeError, ValueError, IndexError) as exc:
        name = RecordType(rtype).name if rtype in _TYPES else f"type {rtype}"
        raise CorruptRecord(f"bad {name} payload: {exc}", path, offset) from None


_FIELDS: dict[int, Any] = {
    RecordType.ENVELOPE: _envelope_fields,
    RecordType.START: _start_fields,
    RecordType.DELIVERY: _delivery_fields,
    RecordType.FINISH: _finish_fields,
}


FIELD_READERS: Final[dict[int, Any]] = dict(_FIELDS)
"""``rtype`` -> the function that checks a decoded CBOR map (a ``dict``) and returns its field tuple, as
decode_fields does after ``cbor2.loads``. Why public: a bulk reader's loop (``spool.export.rows``) calls the two
itself on its good path, and leaves a failure to decode_fields, which names it."""


def decode_fields(rtype: int, payload: bytes | memoryview, *, path: str = "", offset: int = -1) -> tuple[Any, ...]:
    """The fields of a non-DATA payload as a plain tuple, checked as decode_payload checks them.

    The order is the record class's attributes; a DELIVERY's outcomes are
    6-tuples; status and kind are ints. Why: a bulk reader that builds columns
    (the Spark data source) spends more on making record objects than on the
    CBOR itself. ``cls(*fields)`` is the record, up to those ints and tuples.
    Raises CorruptRecord, as decode_payload does (DATA too: it has no fields).
    """
    result: tuple[Any, ...] = _decode_map(_FIELDS, rtype, payload, path, offset)
    return result


def payload_type(p: Payload) -> RecordType:
    if isinstance(p, Envelope):
        return RecordType.ENVELOPE
    if isinstance(p, Start):
        return RecordType.START
    if isinstance(p, Delivery):
        return RecordType.DELIVERY
    if isinstance(p, Finish):
        return RecordType.FINISH
    return RecordType.DATA


def payload_bytes(p: Payload) -> bytes:
    return p if isinstance(p, bytes) else p.to_payload()
