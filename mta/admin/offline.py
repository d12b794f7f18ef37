"""The offline fallback: answer a queue request from the spool on disk when no relay runs on it.

Opening the spool takes its lock (so a relay cannot start under us) and runs
recovery, exactly as a relay's start does; then the same functions as the
control socket's (``mta.admin.queue_ops``) answer the request. If the lock is
held, a relay runs but its control socket did not answer: the spool cannot be
read around its only writer.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import trio

from mta.admin.control import socket_path
from mta.admin.errors import (
    BadRequest,
    NoSuchMessage,
    RelayNotAnswering,
    RequestFailed,
    SpoolNotFound,
    SpoolUnavailable,
)
from mta.admin.queue_ops import (
    CHANGES,
    Request,
    RequestError,
    change_op,
    parse_request,
    read_op,
    selection_batches,
)
from mta.config import Config, ConfigError
from spool import NotFound, Spool, SpoolError, SpoolLocked
from spool import listing as admin


def answer_offline(config: Config, shard: int, raw: dict[str, Any]) -> dict[str, Any]:
    """Shard ``shard``'s answer to ``raw``, read from (or written to) its spool directly.

    Raises:
        BadRequest: ``raw`` fails the control socket's checks (before the spool is opened).
        NoSuchMessage: ``show`` of an id that is not queued.
        RelayNotAnswering: a relay holds the spool's lock.
        SpoolNotFound, SpoolUnavailable: the spool cannot be opened.
        RequestFailed: the spool refused the request.
        ConfigError: the spool refuses a setting of ``config``.
    """
    try:
        req = parse_request(raw)  # the same checks as the control socket's, before the spool is opened
    except RequestError as exc:
        raise BadRequest(str(exc)) from None
    sp = _open(config, shard)
    try:
        return _answer(sp, req, shard)
    except RequestError as exc:
        raise BadRequest(str(exc)) from None
    except NotFound as exc:
        raise NoSuchMessage(str(exc)) from None
    except (SpoolError, OSError) as exc:
        raise RequestFailed(str(exc)) from None
    finally:
        sp.close()


def _open(config: Config, shard: int) -> Spool:
    from mta.shards import spool_config  # here: a command that reaches a running relay never loads it

    try:
        settings = spool_config(config, shard)
    except ValueError as exc:
        raise ConfigError(str(exc), config.source, "spool") from None
    # Recovery's per-recipient in-doubt warnings belong in the relay's log, not on an admin's terminal.
    engine_log = logging.getLogger("spool")
    level = engine_log.level
    engine_log.setLevel(logging.ERROR)
    try:
        return Spool.open(config.spool.dir, settings)
    except SpoolLocked:
        raise RelayNotAnswering(f"the relay holds {config.spool.dir} but its control socket "
                                f"{socket_path(config)} does not answer") from None
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise SpoolNotFound(f"spool {config.spool.dir}: {exc.strerror or exc}") from None
    except (SpoolError, OSError) as exc:
        raise SpoolUnavailable(f"spool {config.spool.dir}: {_reason(exc)}") from None
    finally:
        engine_log.setLevel(level)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror and not isinstance(exc, SpoolError):
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return str(exc)


def _answer(sp: Spool, req: Request, shard: int) -> dict[str, Any]:
    if req.op not in CHANGES:
        return read_op(sp, req, sp.read_body, shard)

    async def apply(op: str, mid: int) -> bool:
        return sp.change(mid, op)

    async def matching(flt: admin.Filter) -> AsyncIterator[list[admin.LiveMessage]]:
        for batch in selection_batches(sp, flt, 1000):
            yield batch

    async def apply_batch(op: str, msgs: list[admin.LiveMessage]) -> list[bool | str]:
        return sp.change_batch(msgs, op)

    return trio.run(change_op, req, apply, matching, apply_batch, shard)
