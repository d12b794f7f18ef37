"""A plain TCP session's reads and writes, without trio's per-call wrapping where it costs the most.

Why: at 20 concurrent sessions the relay's event loop thread is its
bottleneck, and a session reads and writes about seven times a
message. Trio's ``SocketStream.receive_some`` always ends with a checkpoint,
a pass of the scheduler even when the bytes were already there, and wraps
the call in two context managers; its ``send_all`` the same. Here:

- ``receive`` reads at once (``os.read`` on the non-blocking socket); only
  when nothing is there does it wait for the socket to be readable
  (``trio.lowlevel.wait_readable``, itself a checkpoint) and read again.
  Before each read it honours a cancellation already delivered
  (``checkpoint_if_cancelled``, as trio does), so the client's deadline
  stops a session exactly as before; a read that found its bytes waiting
  yields once after it (as trio's does): a client that keeps its socket
  full (a pipelining fire hose, a fast body) cannot keep the other sessions
  from running. Skipping that yield for every read was tried: the loop
  then looked idle between the clients' round trips and the group commit
  cut smaller batches (fsyncs per message 0.056 -> 0.09-0.19 at 20
  sessions). A lone client's reads (``Pace``) skip it, a bounded number
  of times in a row: with nobody else connected there is no session to be
  fair to, and the tasks that would have run in that pass (the previous
  message's delivery, above all) run instead while the session waits for
  the client's next command, off its round trip.
- ``send`` writes what fits in the socket buffer with one ``os.write`` (a
  reply nearly always does) and hands the rest to trio's ``send_all``, which
  waits under the caller's cancel scope.

A stream that is not a plain ``trio.SocketStream`` (TLS) goes through trio's
methods unchanged. An error of the socket becomes ``trio.BrokenResourceError``
(as trio's own translation does), which ends the session quietly.
"""

from __future__ import annotations

import os
from typing import Final

import trio

# The most reads in a row that may skip the yield after finding their bytes waiting (``Pace``): a lone
# client that keeps its socket full (a fast body, a pipelining fire hose) still lets the loop run the other
# tasks (the accept loop, the committer, deliveries, the deadlines' timers) at least this often.
LONE_BURST: Final = 8


class Pace:
    """How many more reads in a row may skip the yield after an immediate read; the session sets ``lone``.

    Why: that yield is a pass of the scheduler (an ``epoll_wait`` and the
    other runnable tasks' steps) between a lone client's command and its
    reply, four or five times a message. It is skipped only while
    the session says its client is the only one connected, and at most
    ``LONE_BURST`` times in a row: every read that waited, or that yielded,
    starts the count again.
    """

    __slots__ = ("left", "lone")

    def __init__(self) -> None:
        self.lone = False
        self.left = LONE_BURST


async def receive(stream: trio.abc.Stream, max_bytes: int, pace: Pace | None = None) -> bytes | bytearray:
    """Up to ``max_bytes`` from ``stream``; ``b""`` at EOF. ``pace``: a lone client's (may skip the yield)."""
    if type(stream) is not trio.SocketStream:
        return await stream.receive_some(max_bytes)
    sock = stream.socket
    await trio.lowlevel.checkpoint_if_cancelled()
    try:
        data = os.read(sock.fileno(), max_bytes)
    except BlockingIOError:
        if pace is not None:
            pace.left = LONE_BURST  # the wait below is a checkpoint
        while True:
            await trio.lowlevel.wait_readable(sock)
            try:
                return os.read(sock.fileno(), max_bytes)
            except BlockingIOError:
                continue
            except OSError as exc:
                raise trio.BrokenResourceError(f"socket read failed: {exc}") from exc
    except OSError as exc:
        raise trio.BrokenResourceError(f"socket read failed: {exc}") from exc
    if pace is not None and pace.lone and pace.left > 0:
        pace.left -= 1
        return data
    await trio.lowlevel.cancel_shielded_checkpoint()
    if pace is not None:
        pace.left = LONE_BURST
    return data


async def send(stream: trio.abc.Stream, out: bytes) -> None:
    """All of ``out`` to ``stream``: at once if it fits in the socket buffer, else waiting under the caller's scope."""
    if type(stream) is trio.SocketStream:
        # Replies nearly always fit in the socket's buffer: written at once, without trio's send (a pass
        # of the scheduler and its error translation, ~10 us of CPU a reply).
        try:
            sent = os.write(stream.socket.fileno(), out)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise trio.BrokenResourceError(f"socket write failed: {exc}") from exc
        if sent == len(out):
            return
        out = out[sent:]
    await stream.send_all(out)
