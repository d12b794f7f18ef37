"""``POST /api/inject/v1``: a request's messages made, enqueued and committed together, and the answer.

``200`` means every message the answer names is durable: all of a request's
messages are appended and then one commit covers them (one group commit,
shared with whatever else is being committed). The answer is KumoMTA's
(``success_count``, ``fail_count``, ``failed_recipients``, ``errors``) with
``ids``: one ``{"email", "queue_id"}`` per recipient whose message was made,
in the request's order. The messages of a request of more than
``INLINE_RECIPIENTS`` are composed in a worker thread (``trio.to_thread``),
so that a large templated request does not hold the event loop that the
SMTP sessions share.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import attrs
import trio

from mta.http.compose import Composer, RecipientFailed
from mta.http.idempotency import EXTRA_INDEX, EXTRA_KEY, KeyStore, fingerprint
from mta.http.inject_request import InjectRequest, parse_request
from mta.observe.logline import event
from spool import AsyncSpool, DiskFull

__all__ = ["Injector", "Outcome"]

log = logging.getLogger("mta.http")

# Requests of at most this many recipients are composed in the event loop (~0.1 ms a recipient): a worker
# thread's round trip would cost more than the work. Larger ones go to a thread, so the loop is not held.
INLINE_RECIPIENTS = 8


@attrs.frozen
class Outcome:
    """The answer to one request: status and JSON."""

    status: int
    body: dict[str, Any]
    headers: tuple[tuple[str, str], ...] = ()


@attrs.frozen
class _Made:
    index: int
    data: bytes


class Injector:
    """Makes a request's messages and enqueues them; ``keys``: the idempotency keys (``mta.http.idempotency``)."""

    def __init__(self, aspool: AsyncSpool, keys: KeyStore, *, hostname: str, max_recipients: int,
                 max_message_size: int) -> None:
        self.aspool = aspool
        self.keys = keys
        self.hostname = hostname
        self.max_recipients = max_recipients
        self.max_message_size = max_message_size

    async def inject(self, body: bytes, key: str | None, client: str) -> Outcome:
        """Raises BadInjection (400), KeyMismatch (422), DiskFull (503)."""
        request = parse_request(body, self.max_recipients)
        if key is None:
            return await self._make(request, None, "", {}, client)
        fp = fingerprint(body)
        async with self.keys.hold(key):
            known = self.keys.lookup(key, fp)
            done = known.ids if known is not None else {}
            if known is not None and len(done) == len(request.recipients):
                return _answer(request, done, {})
            return await self._make(request, key, fp, done, client)

    async def _make(self, request: InjectRequest, key: str | None, fp: str, have: dict[int, str],
                    client: str) -> Outcome:
        """Make the messages of the recipients ``have`` (index -> queue id, made by an earlier try) lacks."""
        composer = Composer(request, self.hostname, client, self.max_message_size)  # BadInjection: templates
        wanted = [i for i in range(len(request.recipients)) if i not in have]
        if len(wanted) <= INLINE_RECIPIENTS:
            made, failed = _compose_all(composer, request, wanted)
        else:
            made, failed = await trio.to_thread.run_sync(_compose_all, composer, request, wanted)
        ids: dict[int, str] = {}
        if made:
            # Shielded: once the intent is durable the request sees its commit through, so that a deadline or a
            # client gone cannot leave messages committed by the next commit whose key this relay forgot.
            with trio.CancelScope(shield=True):
                ids = await self._enqueue(request, made, key, fp, client)
        all_ids = self.keys.done(key, fp, ids).ids if key is not None and ids else {**have, **ids}
        event(log, "injected", next(iter(ids.values()), None), from_=f"<{request.envelope_sender}>",
              nrcpt=len(ids), failed=len(failed), client=client, key=key)
        return _answer(request, all_ids, failed)

    async def _enqueue(self, request: InjectRequest, made: list[_Made], key: str | None, fp: str,
                       client: str) -> dict[int, str]:
        if key is not None:
            await self.keys.intend(key, fp, self.aspool.core.head)
        extras = [_extra(request, m.index, key, client) for m in made]
        try:
            mids = await self.aspool.enqueue_many(
                ((request.envelope_sender, (request.recipients[m.index].email,), m.data) for m in made),
                extras=extras)
        except DiskFull:
            if key is not None:
                self.keys.done(key, fp, {})  # cancelled, all of them: the intent made nothing
            raise
        return {m.index: self.aspool.core.queue_id(mid) for m, mid in zip(made, mids, strict=True)}


def _extra(request: InjectRequest, index: int, key: str | None, client: str) -> dict[str, Any]:
    """The envelope's extra map: where it came from, its key and place in the request, the recipient's metadata."""
    extra: dict[str, Any] = {"client": client, "via": "http"}
    if key is not None:
        extra[EXTRA_KEY] = key
        extra[EXTRA_INDEX] = index
    metadata = request.recipients[index].metadata
    if metadata:
        extra["metadata"] = dict(metadata)
    return extra


def _compose_all(composer: Composer, request: InjectRequest, wanted: Sequence[int]
                 ) -> tuple[list[_Made], dict[int, str]]:
    made: list[_Made] = []
    failed: dict[int, str] = {}
    for i in wanted:
        try:
            made.append(_Made(i, composer.compose(request.recipients[i])))
        except RecipientFailed as exc:
            failed[i] = str(exc)
    return made, failed


def _answer(request: InjectRequest, ids: dict[int, str], failed: dict[int, str]) -> Outcome:
    rcpts = request.recipients
    missing = [i for i in range(len(rcpts)) if i not in ids]
    return Outcome(200, {
        "success_count": len(ids),
        "fail_count": len(missing),
        "failed_recipients": [rcpts[i].email for i in missing],
        "errors": [f"{rcpts[i].email}: {failed[i]}" for i in missing if i in failed],
        "ids": [{"email": rcpts[i].email, "queue_id": ids[i]} for i in sorted(ids)],
    })


def dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode() + b"\n"
