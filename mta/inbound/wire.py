"""A plain TCP session's reads and writes, without trio's per-call wrapping where it costs the most.

Why: at 20 concurrent sessions the relay's event loop thread is its
bottleneck (issue 18), and a session reads and writes about seven times a
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
  from running. Skipping that yield too was tried: the loop then looked
  idle between the clients' round trips and the group commit cut smaller
  batches (fsyncs per message 0.056 -> 0.09-0.19 at 20 sessions).
- ``send`` writes what fits in the socket buffer with one ``os.write`` (a
  reply nearly always does) and hands the rest to trio's ``send_all``, which
  waits under the caller's cancel scope.

A stream that is not a plain ``trio.SocketStream`` (TLS) goes through trio's
methods unchanged. An error of the socket becomes ``trio.BrokenResourceError``
(as trio's own translation does), which ends the session quietly.
"""

from __future__ import annotations

import os

import trio


async def receive(stream: trio.abc.Stream, max_bytes: int) -> bytes | bytearray:
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
                return os.read(sock.fileno(), max_bytes)
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
