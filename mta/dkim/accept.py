"""Signing a message as it is accepted: after its data, before the enqueue's commit and the ``250``.

Why then: the signature is made once and stored with the message, so every
attempt (a retry after a ``451``, a delivery after a restart) sends the same
bytes, and the log needs no record rewritten. It goes into the spool as a
DATA record of its own, listed second in the body, after the ``Received:``
header (``spool.write.bodies.BodyWriter.add_header``); the client's data is never
changed. The enqueue's commit makes it durable with the envelope.

The message is read whole for the signer (canonicalisation works on the whole body): from
the chunks the body writer kept for the body cache when the message is small
(up to a quarter of ``spool.body_cache``), else read back from the log once
it is written (``write_through``, no fsync). A message in memory of at most
``INLINE_BYTES`` is signed on the event loop: at most about half a
millisecond, most of it OpenSSL's signature (the body's passes are C and
OpenSSL's SHA-256, ``mta.dkim.canon``), and handing it to a thread and back
cost more than that: the thread holds the GIL through the signature, and at
100 KB the relay signing in a thread did 0.87 of its rate signing on the
loop (benchmarks.md, "Signed mail"). Larger ones, and every one read back
from the log (blocking reads), are signed in a worker thread, at most
``SIGNING_THREADS`` at once, so the event loop keeps serving while a large
body is canonicalised and hashed (both let go of the GIL), and the memory of
messages read whole for signing stays bounded by that many.

A message that cannot be signed is accepted unsigned and logged, as
OpenDKIM's default does: a signer fault must not stop the mail.
"""

from __future__ import annotations

import logging

import trio

from mta.dkim.signer import Signature, Signer, Unsigned
from mta.observe.logline import event
from spool import AsyncSpool, BodyWriter

__all__ = ["INLINE_BYTES", "SIGNING_THREADS", "AcceptSigner"]

log = logging.getLogger("mta.dkim")
SIGNING_THREADS = 2
INLINE_BYTES = 128 * 1024  # a message in memory up to this size is signed on the event loop: about 0.5 ms at most


class AcceptSigner:
    """The receiving side's signer: the keys and policy (``Signer``) and the threads it may use.

    Made inside the relay's event loop (its limiter belongs to that loop).
    """

    def __init__(self, signer: Signer) -> None:
        self.signer = signer
        self.limiter = trio.CapacityLimiter(SIGNING_THREADS)

    async def sign(self, aspool: AsyncSpool, body: BodyWriter, queue_id: str | None) -> Signature | Unsigned:
        """Sign the message being accepted into ``body`` and add the signature to it; returns what happened.

        Raises DiskFull (from ``write_through``) when the disk filled while the
        message was read back: the caller refuses the message as for any enqueue.
        """
        body.close()  # its last chunk into the log (and into ``kept``): the message is whole
        kept = body.kept
        if kept is not None:
            def read() -> bytes:
                return b"".join(kept)
        else:
            await aspool.write_through()  # so that every chunk can be read back
            positions, core = tuple(body.chunks), aspool.core

            def read() -> bytes:
                return b"".join(core.read_chunk(p) for p in positions)

        signer = self.signer

        def work() -> Signature | Unsigned:
            return signer.sign(read())

        if kept is not None and body.size <= INLINE_BYTES:
            result = work()  # cheaper than the hand-off to a thread and back (benchmarks.md, "Signed mail")
        else:
            result = await trio.to_thread.run_sync(work, limiter=self.limiter)
        if isinstance(result, Signature):
            body.add_header(result.header)
        elif result.reason == "error":
            event(log, "dkim_failed", queue_id, level=logging.WARNING, domain=result.domain or None,
                  error=result.detail)
        return result
