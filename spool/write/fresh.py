"""New envelopes kept in memory from their append to their claim, so that the claim need not decode them.

Why: at one message a connection the runner claims each envelope moments after
its commit, and decoding the CBOR it was encoded from a moment earlier was the
largest single part of a claim (~6 us of the loop's time a message).

What stays as it was: the runner still finds every envelope by reading the log
(a crash loses this memory and recovery reads everything from disk as
before), the frame's checksum is still verified, and a kept envelope is used
only when the payload the runner read is byte for byte the one appended from
these fields; anything else (no entry, other bytes, an ``extra`` holding a
value that a CBOR round trip would not give back as it is) is decoded as
before. Bounded: the oldest entries go first (``LIMIT``); an envelope that
is never claimed here (cancelled, or claimed after a restart) costs its
entry until then.
"""

from __future__ import annotations

from typing import Any, Final

from spool.format.record import Envelope

LIMIT: Final = 1024  # entries (~0.3 KB each): more than the messages a relay holds between commit and claim
_SCALARS: Final = (str, int, bool, type(None))
_Fields = tuple[bytes, int, str, tuple[str, ...], tuple[int, ...], int, int, "dict[str, Any]"]


def _plain_copy(extra: dict[str, Any] | None) -> dict[str, Any] | None:
    """A copy of ``extra`` equal to what decoding its CBOR gives, or None when that is not sure.

    Scalars (text, integers, booleans, null) and maps of them with text keys
    come back as they went; a tuple would come back a list, a float might
    come back narrower: those envelopes are decoded.
    """
    if not extra:
        return {}
    out: dict[str, Any] = {}
    for k, v in extra.items():
        if type(k) is not str:
            return None
        if type(v) in _SCALARS:
            out[k] = v
        elif type(v) is dict and all(type(ik) is str and type(iv) in _SCALARS for ik, iv in v.items()):
            out[k] = dict(v)
        else:
            return None
    return out


class FreshEnvelopes:
    """Envelopes appended by ``append_message`` and not yet claimed, by position."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._kept: dict[int, _Fields] = {}
        self.hits = 0

    def __len__(self) -> int:
        return len(self._kept)

    def add(self, pos: int, payload: bytes, message_id: int, sender: str, recipients: tuple[str, ...],
            body: tuple[int, ...], body_size: int, arrival_ms: int, extra: dict[str, Any] | None) -> None:
        """Keep what ``payload`` was encoded from; ``extra`` is copied now (the caller may change its dict)."""
        copied = _plain_copy(extra)
        if copied is None:
            return
        kept = self._kept
        kept[pos] = (payload, message_id, sender, recipients, body, body_size, arrival_ms, copied)
        if len(kept) > self.limit:
            del kept[next(iter(kept))]

    def take(self, pos: int, payload: bytes) -> Envelope | None:
        """The envelope at ``pos`` if it was appended here with exactly ``payload``; forgotten either way."""
        f = self._kept.pop(pos, None)
        if f is None or f[0] != payload:
            return None
        self.hits += 1
        return Envelope(f[1], f[2], f[3], f[4], f[5], f[6], extra=f[7])
