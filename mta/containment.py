"""Where a failure stops: what a per-peer boundary contains, and what it must let end the process.

Crash-only has two halves (docs/design.md, "Containment"). Whatever one
peer can cause — its bytes, its slowness, a bug that its input reaches —
ends that peer's unit of work only: one SMTP session, one delivery batch,
one control request. Each such unit has one boundary that catches the
unexpected exception, logs it once with its traceback, and lets the rest of
the relay go on.

A failure of the spool is not a peer's doing and must not be contained: a
failed fsync (``SyncFailed``; after PostgreSQL's fsyncgate nothing written
since the last good sync can be trusted) and any error once the log writer
is poisoned end the process, and the next start recovers from what is
really on disk. ``is_fatal`` is the one place that tells the two apart;
every boundary asks it and re-raises what it calls fatal.
"""

from __future__ import annotations

from mta.smtp.common import printable
from spool import Spool, SyncFailed


def is_fatal(exc: BaseException, spool: Spool | None = None) -> bool:
    """Must ``exc`` end the process rather than one peer's unit of work?

    Yes for ``SyncFailed`` anywhere in it (its cause or context chain, or a
    group's members), and for anything at all once ``spool``'s log writer is
    poisoned. No for everything else a boundary sees (``Exception`` only:
    cancellation and KeyboardInterrupt are never caught by one).
    """
    if spool is not None and spool.writer.poisoned is not None:
        return True
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, SyncFailed):
            return True
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return False


def local_error(exc: BaseException) -> str:
    """A one-line reason for a delivery record or a log line: the exception's type and message, no raw bytes."""
    text = str(exc)
    return f"local error: {type(exc).__name__}" + (f": {printable(text, 200)}" if text else "")
