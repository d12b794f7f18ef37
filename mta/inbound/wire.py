"""A plain TCP session's reads and writes, without trio's per-call wrapping where it costs the most.

Why: at 20 concurrent sessions the relay's event loop thread is its
bottleneck (issue 18), and a session reads and writes about seven times a
message. Trio's ``SocketStream.receive_some`` always ends with a checkpoint,
a pass of the scheduler even when the bytes were already there, and wraps
the call in two context managers; its ``send_all`` the same. Here:

- ``Reader.receive`` reads at once (``os.read`` on the non-blocking socket);
  only when nothing is there does it wait for the socket to be readable
  (``trio.lowlevel.wait_readable``) and read again. Before each read it
  honours a cancellation already delivered (``checkpoint_if_cancelled``, as
  trio does), so the client's deadline stops a session exactly as before,
  and after ``EAGER_READS`` reads in a row that did not wait it yields once
  (``checkpoint``): a client that keeps its socket full (a pipelining
  fire hose, a fast body) cannot keep the other sessions from running, and
  the deadline's cancellation is delivered to it (trio marks a scope
  cancelled only when the scheduler runs).
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

EAGER_READS: Final = 8  # reads in a row that found bytes waiting, before the session lets the others run


class Reader:
    """One session's reads; ``streak`` counts the reads in a row that did not wait."""

    __slots__ = ("streak",)

    def __init__(self) -> None:
        self.streak = 0

    async def receive(self, stream: trio.abc.Stream, max_bytes: int) -> bytes | bytearray:
        """Up to ``max_bytes`` from ``stream``; ``b""`` at EOF."""
        if type(stream) is not trio.SocketStream:
            return await stream.receive_some(max_bytes)
        sock = stream.socket
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            data = os.read(sock.fileno(), max_bytes)
        except BlockingIOError:
            while True:
                await trio.lowlevel.wait_readable(sock)
                try:
                    data = os.read(sock.fileno(), max_bytes)
                    break
                except BlockingIOError:
                    continue
                except OSError as exc:
                    raise trio.BrokenResourceError(f"socket read failed: {exc}") from exc
        except OSError as exc:
            raise trio.BrokenResourceError(f"socket read failed: {exc}") from exc
        await trio.lowlevel.cancel_shielded_checkpoint()
        return data


async def send(stream: trio.abc.Stream, out: bytes) -> None:
    """All of ``out`` to ``stream``: at once if it fits in the socket buffer, else waiting under the caller's scope."""
    if type(stream) is trio.SocketStream:
        # Replies nearly always fit in the socket's buffer: written at once, without trio's send (a pass
        # of the scheduler and its error translation, ~10 us of CPU a reply; issue 18).
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
