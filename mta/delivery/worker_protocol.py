"""What the relay and its delivery workers say to each other over their socketpair: frames, and their codec.

Theory of operation. A frame is a 4-byte big-endian length followed by that
many bytes of CBOR: a list whose first item names the message. The relay
writes ``config`` once, then ``batch`` frames (a destination, its jobs, and
the spool's log directory; a job's body is the positions of its DATA records,
which the worker reads itself, or for a body not from the spool its chunks
inline or None) and ``chunk`` frames (a piece of a body the worker asked for
with ``read``: one it was not given by position, or could not read there).
Before a job's final dot the worker sends ``dot`` (the batch, the job, its recipients) and
waits for the relay's ``dot_ok`` (the same, and None or why the point of no
return could not be made durable): the relay answers once the job's
``sending`` DELIVERY record is durable (docs/design.md, "The point of no
return"). The worker answers ``outcome`` as each job's next hop answers, then ``done``
(every job's outcomes not sent yet, the connection cache's reuses, the points it
marked itself and its marks file's fdatasyncs since its last ``done``) or
``failed`` (the transport raised: the relay defers the batch as a local
error); ``log`` and ``tls_policy`` frames carry what the transport logs and counts, so the
relay's log and metrics see them as before.

Why CBOR and not pickle for the traffic: the worker talks to the world (next
hops, DNS), and what it sends back must never be able to run code in the
relay, which holds the spool. The config alone is pickled, relay to worker:
the worker trusts its parent, and a Config is attrs records the codec does
not know.

``FrameReader`` is sans-IO (bytes in, frames out) so the tests cut frames
anywhere; ``FrameTooLong`` is a bug or a corrupt peer, never a peer on the
network: the socketpair has no one else on it.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import cbor2
import trio

from mta.delivery.transport import Destination, Job
from spool import Outcome, Status

__all__ = ["MAX_FRAME", "RECEIVE_SIZE", "FrameReader", "FrameTooLong", "ProtocolError", "SocketReceiver",
           "decode_destination", "decode_outcomes", "destination_item", "encode", "encode_outcomes", "job_from",
           "job_header"]

_LENGTH = struct.Struct(">I")
RECEIVE_SIZE = 256 * 1024  # bytes a read of the socketpair asks for
# The largest frame either side sends: a batch whose bodies are inline (bodies not from the spool) is at most
# max_messages_per_connection x INLINE_BODY; bigger bodies go in chunks of one DATA record.
MAX_FRAME = 1 << 30


class ProtocolError(Exception):
    """A frame the other side should never have sent: the worker is ended and started again."""


class FrameTooLong(ProtocolError):
    pass


def encode(message: Sequence[Any]) -> bytes:
    """One frame: the length, then the CBOR of ``message`` (a list whose first item is its kind)."""
    payload = cbor2.dumps(list(message))
    if len(payload) > MAX_FRAME:
        raise FrameTooLong(f"a {message[0]} frame of {len(payload)} bytes (at most {MAX_FRAME})")
    return _LENGTH.pack(len(payload)) + payload


class SocketReceiver:
    """Reads of one end of the socketpair (non-blocking): wait until readable, then one ``recv``.

    Why not trio's ``receive_some``: it reads until EAGAIN, and the frames of
    a wake-up (an outcome and its ``done``; a batch) come in one write, so it
    made two ``recv`` calls a wake-up where one does. A read that
    filled the buffer reads again at once, without waiting.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._full = False

    async def receive(self) -> bytes:
        """The next bytes; ``b""`` once the socket has ended (EOF, an error, or closed under the wait)."""
        while True:
            try:
                if not self._full:
                    await trio.lowlevel.wait_readable(self.sock)
                data = self.sock.recv(RECEIVE_SIZE)
            except BlockingIOError:
                self._full = False
                continue
            except (trio.ClosedResourceError, OSError):
                return b""
            self._full = len(data) == RECEIVE_SIZE
            return data


class FrameReader:
    """Bytes as they arrive -> whole frames, each a decoded list; a frame may span any number of reads.

    A read that holds whole frames (the common case: one write a wake-up) is decoded where it lies, through a
    memoryview; only the part of a frame that a later read completes is kept, and copied once.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[list[Any]]:
        if self._buffer:
            self._buffer += data
            data = bytes(self._buffer)
            self._buffer.clear()
        at, end = 0, len(data)
        with memoryview(data) as view:
            while end - at >= 4:
                (size,) = _LENGTH.unpack_from(data, at)
                if size > MAX_FRAME:
                    raise FrameTooLong(f"a frame of {size} bytes announced (at most {MAX_FRAME})")
                if end - at - 4 < size:
                    break
                try:
                    message = cbor2.loads(view[at + 4:at + 4 + size])
                except (cbor2.CBORDecodeError, ValueError) as exc:
                    raise ProtocolError(f"undecodable frame: {exc}") from None
                at += 4 + size
                if not isinstance(message, list) or not message or not isinstance(message[0], str):
                    raise ProtocolError(f"a frame that is not [kind, ...]: {type(message).__name__}")
                yield message
            self._buffer += view[at:]

    @property
    def pending(self) -> int:
        """Bytes of a frame not yet whole (EOF now cut it)."""
        return len(self._buffer)


def job_header(job: Job) -> list[Any]:
    """A job without its body: queue id, sender, recipients, size, extra (the envelope's ESMTP parameters)."""
    return [job.queue_id, job.sender, list(job.recipients), job.size, dict(job.extra)]


def job_from(header: Sequence[Any], body: Any) -> Job:
    qid, sender, rcpts, size, extra = header
    return Job(str(qid), str(sender), tuple(str(r) for r in rcpts), body, int(size), dict(extra))


def decode_destination(item: Sequence[Any]) -> Destination:
    kind, target, tls, source, helo = item
    return Destination(str(kind), str(target), str(tls), str(source), str(helo))


def destination_item(dest: Destination) -> list[str]:
    return [dest.kind, dest.target, dest.tls, dest.source, dest.helo]


def encode_outcomes(outcomes: Sequence[Outcome]) -> list[list[Any]]:
    return [o.to_list() for o in outcomes]


def decode_outcomes(items: Sequence[Any]) -> list[Outcome]:
    """Outcomes as the worker sent them; raises ProtocolError for anything that is not one."""
    try:
        return [Outcome(str(r), Status(int(s)), int(c), str(e), str(t), str(h)) for r, s, c, e, t, h in items]
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"an outcome that is not one: {exc}") from None


def marks_prefix(index: int, pid: int) -> str:
    """The name every marks file of worker ``index`` in its life as ``pid`` begins with (``spool.write.marks``):
    the relay reads a dead worker's marks by it."""
    return f"w{index}-{pid}"
