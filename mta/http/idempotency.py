"""Idempotency keys of the injection API: which queue ids a key's request made, kept across crashes.

Theory of operation
-------------------
A request with an ``Idempotency-Key`` must create its messages once, however
often it is sent and whenever the relay dies. The messages carry the key in
their envelope's extra map (``idempotency_key``, with ``inject_index``, the
recipient's place in the request), so the log itself says which messages a
key made. Beside the log, an append-only file of JSON lines,
``<spool.dir>/inject-keys``, holds the keys:

- ``intent`` (key, the request's fingerprint, the log head before the
  request's first envelope), written and fdatasynced *before* the request's
  messages are appended: once any of them can be durable, the key is;
- ``done`` (key, fingerprint, ``[index, queue id]`` pairs), written after the
  request's commit, not synced of its own: the next intent's sync covers it.

At start (``KeyStore.open``) the file is read: a key with a ``done`` is known
with its ids. A key with only an ``intent`` was in flight when the relay
stopped: the log is read from the intent's head (``spool.listing.envelopes_since``,
every envelope since, delivered ones too) for envelopes with that key, so
the messages a crash left durable are found and none is made again. Then the
file is rewritten with only the keys younger than ``idempotency_window`` (temp
file, fsync, rename, fsync of the directory) and the relay serves. So a key is
known for the whole window even after its messages were delivered and their
segments reclaimed, and the file holds one line per key of the window.

A retry whose key is known gets the ids back; recipients of the request that
have no message under the key (it failed for them, or a crash left only some
of them durable) are made then, so that the result is one message per (key,
recipient). The same key with another body is refused (``KeyMismatch``, 422).
Two requests with one key at once: the second waits for the first
(``KeyStore.hold``) and then is a retry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from spool import Spool, listing

__all__ = ["KEY_FILE", "KeyMismatch", "KeyStore", "Known", "fingerprint"]

log = logging.getLogger("mta.http")

KEY_FILE = "inject-keys"
EXTRA_KEY = "idempotency_key"
EXTRA_INDEX = "inject_index"
PURGE_EVERY = 10000  # requests between walks of the keys in memory that drop the expired ones


class KeyMismatch(ValueError):
    """The key was first used with another request body (answered 422)."""


def fingerprint(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()[:32]


@attrs.define
class Known:
    """What a key made: recipient index -> queue id, and the fingerprint of its request."""

    fp: str
    at: float
    ids: dict[int, str]


class KeyStore:
    """The keys of the last ``window`` seconds, in memory, and their file. Used in the event loop only."""

    def __init__(self, path: str, window: float, known: dict[str, Known], fd: int) -> None:
        self.path = path
        self.window = window
        self._known = known
        self._fd = fd
        self._busy: dict[str, trio.Event] = {}
        self._since_purge = 0

    @classmethod
    def open(cls, spool_dir: str, core: Spool, window: float, now: float | None = None) -> KeyStore:
        """Read the file, find what in-flight requests left in the log, rewrite the file. Blocking: run in a thread.

        Raises OSError: the file cannot be read or written (the relay does not start).
        """
        now = time.time() if now is None else now
        path = os.path.join(spool_dir, KEY_FILE)
        known, pending = _read(path)
        if pending:
            start = min(head for _, head, _ in pending.values())
            wanted = {key: Known(fp, at, {}) for key, (fp, _, at) in pending.items()}
            for env in listing.envelopes_since(core, start):
                key = env.extra.get(EXTRA_KEY)
                if isinstance(key, str) and key in wanted and isinstance(env.extra.get(EXTRA_INDEX), int):
                    wanted[key].ids[env.extra[EXTRA_INDEX]] = core.queue_id(env.message_id)
            for key, k in wanted.items():
                if k.ids:
                    old = known.get(key)
                    known[key] = Known(k.fp, k.at, {**(old.ids if old else {}), **k.ids})
            log.info("idempotency keys: %d request(s) were in flight at the last stop; %d had left messages",
                     len(pending), sum(1 for k in wanted.values() if k.ids))
        known = {k: v for k, v in known.items() if now - v.at < window}
        _rewrite(path, known)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        return cls(path, window, known, fd)

    def lookup(self, key: str, fp: str, now: float | None = None) -> Known | None:
        """What ``key`` made within the window, or None.

        Raises KeyMismatch: the key was used with another body.
        """
        k = self._known.get(key)
        if k is None or (time.time() if now is None else now) - k.at >= self.window:
            return None
        if k.fp != fp:
            raise KeyMismatch("this Idempotency-Key was used with another request body")
        return k

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        """The key to this request alone: a second request with it waits here for the first to end."""
        while (busy := self._busy.get(key)) is not None:
            await busy.wait()
        event = self._busy[key] = trio.Event()
        try:
            yield
        finally:
            del self._busy[key]
            event.set()

    async def intend(self, key: str, fp: str, head: int) -> None:
        """Durably, before any message of the request is appended: the request with ``key`` may leave messages
        from log position ``head`` on."""
        line = _line({"t": "intent", "key": key, "fp": fp, "head": head, "at": time.time()})
        await trio.to_thread.run_sync(_append_synced, self._fd, line)

    def done(self, key: str, fp: str, ids: dict[int, str], at: float | None = None) -> Known:
        """The request's messages are durable: remember them (the line is written now, synced by the next intent)."""
        self._since_purge += 1
        if self._since_purge >= PURGE_EVERY:
            self._purge(time.time())
        old = self._known.get(key)
        merged = {**(old.ids if old is not None else {}), **ids}
        known = self._known[key] = Known(fp, old.at if old is not None else (at or time.time()), merged)
        line = _line({"t": "done", "key": key, "fp": fp, "at": known.at, "ids": sorted(merged.items())})
        os.write(self._fd, line)
        return known


    def _purge(self, now: float) -> None:
        """Forget the keys older than the window (memory only: the file drops them at the next start)."""
        self._since_purge = 0
        self._known = {k: v for k, v in self._known.items() if now - v.at < self.window}


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _append_synced(fd: int, line: bytes) -> None:
    os.write(fd, line)
    os.fdatasync(fd)


def _read(path: str) -> tuple[dict[str, Known], dict[str, tuple[str, int, float]]]:
    """The keys done, and those with an intent and no done after it: (fingerprint, head, time)."""
    known: dict[str, Known] = {}
    pending: dict[str, tuple[str, int, float]] = {}
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return known, pending
    lines = data.split(b"\n")
    for n, raw in enumerate(lines):
        if not raw:
            continue
        try:
            obj = json.loads(raw)
            key, kind = obj["key"], obj["t"]
            if kind == "intent":
                pending[key] = (obj["fp"], int(obj["head"]), float(obj["at"]))
            elif kind == "done":
                pending.pop(key, None)
                known[key] = Known(obj["fp"], float(obj["at"]), {int(i): str(q) for i, q in obj["ids"]})
        except (ValueError, KeyError, TypeError):
            if n < len(lines) - 1 and lines[n + 1:] != [b""]:
                log.warning("%s: line %d is unreadable and was skipped", path, n + 1)
            # else the last line, torn by a crash as it was written: its request never made a message durable
    return known, pending


def _rewrite(path: str, known: dict[str, Known]) -> None:
    tmp = path + ".tmp"
    lines: Iterable[bytes] = (_line({"t": "done", "key": key, "fp": k.fp, "at": k.at, "ids": sorted(k.ids.items())})
                              for key, k in known.items())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, b"".join(lines))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
