"""Spool shards: how several relay processes on one host split the queue.

Theory of operation
-------------------
One relay process is one trio event loop: on a machine with several cores it
is CPU-bound on one of them. ``[server] processes = N`` runs N complete relays
(SMTP server, spool, scheduler, control socket), each the only writer of its
own spool, its *shard*. They listen on the same addresses with SO_REUSEPORT,
so the kernel spreads incoming connections over them; nothing is shared
between them at run time, so a crash of one costs only its own connections.

Layout. Shard 0 is ``spool.dir`` itself, exactly the single-process layout,
so ``processes = 1`` is today's relay and raising N later keeps shard 0's
queue where it was. Shard k >= 1 lives in ``spool.dir/shards/k`` (a spool of
its own: segments, checkpoint, lock, ``control.sock``). The number of shards
is max(N, shards found on disk): lowering N never strands queued mail, the
extra shards keep running (and delivering) until an operator removes their
directories while the relay is stopped.

Queue ids. A spool's message id is a log position, unique only inside its
spool. Shard 0 keeps the plain hex id (``1000001A4``); shard k >= 1 appends
``-k`` (``1000001A4-1``). A hex id never holds a ``-``, so the text names the
shard unambiguously and the admin commands route on it.

Per-shard values (``shard_config``): spool and archive directories, the
control socket, the metrics port (port + k; port 0 stays 0) and the delivery
limits. ``delivery.concurrency`` and ``delivery.per_destination`` are divided
by the number of shards, rounded up, so a remote sees about the configured
total however many processes deliver to it.
"""

from __future__ import annotations

import math
import os
import re

import attrs

from mta.config import Config, ConfigError
from spool import SpoolConfig

SHARDS_DIR = "shards"
_SHARD_NAME = re.compile(r"[1-9][0-9]{0,5}")
_ID = re.compile(r"([0-9A-Fa-f]+)(?:-([1-9][0-9]{0,5}))?")


def shard_dir(spool_dir: str, shard: int) -> str:
    """Where shard ``shard``'s spool lives: ``spool_dir`` for shard 0, ``spool_dir/shards/K`` otherwise."""
    if shard < 0:
        raise ValueError(f"no shard {shard}")
    return spool_dir if shard == 0 else os.path.join(spool_dir, SHARDS_DIR, str(shard))


def shards_on_disk(spool_dir: str) -> int:
    """How many shards the spool has: 1 + the highest ``shards/K`` directory (1 if there is none)."""
    try:
        names = os.listdir(os.path.join(spool_dir, SHARDS_DIR))
    except (FileNotFoundError, NotADirectoryError):
        return 1
    found = [int(n) for n in names if _SHARD_NAME.fullmatch(n)
             and os.path.isdir(os.path.join(spool_dir, SHARDS_DIR, n))]
    return 1 + max(found, default=0)


def shard_count(config: Config) -> int:
    """Processes to run: the configured number, or more if the disk holds more shards (their mail must go out)."""
    return max(config.server.processes, shards_on_disk(config.spool.dir))


def id_suffix(shard: int) -> str:
    """What shard K's spool appends to its hex queue ids (``SpoolConfig.id_suffix``)."""
    return f"-{shard}" if shard else ""


def format_queue_id(message_id: int, shard: int) -> str:
    """The queue id an operator sees: hex for shard 0, ``HEX-K`` for shard K."""
    return f"{message_id:X}{id_suffix(shard)}"


def parse_queue_id(text: str) -> tuple[int, int]:
    """``(shard, message_id)`` from a queue id. Raises ValueError (one line) for anything else."""
    m = _ID.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"not a queue id: {text!r}")
    return (int(m.group(2)) if m.group(2) else 0), int(m.group(1), 16)


Cursor = tuple[int, int, int]  # (arrival_ms, shard, message_id): where a listing is, over every shard
_CURSOR = re.compile(r"([0-9]{1,15})\.(.{1,40})")


def format_cursor(cursor: Cursor) -> str:
    """A list cursor: the last listed message's arrival time (ms) and queue id, ``1732356000123.1000001A4-1``.

    A listing is oldest first over every shard (``mta.admin.shards_merge``),
    so its cursor is a place in that order, not a position in one log: it
    stays right when a hold or release rewrites a message's envelope.
    """
    arrival_ms, shard, message_id = cursor
    return f"{arrival_ms}.{format_queue_id(message_id, shard)}"


def parse_cursor(text: object) -> Cursor | None:
    """The ``(arrival_ms, shard, message_id)`` of a list cursor; None (no cursor) starts at the oldest.

    Raises ValueError (one line) for anything else.
    """
    if text is None:
        return None
    m = _CURSOR.fullmatch(text.strip()) if isinstance(text, str) else None
    try:
        if m is None:
            raise ValueError
        shard, message_id = parse_queue_id(m.group(2))
    except ValueError:
        raise ValueError(f"not a list cursor: {text!r}") from None
    return int(m.group(1)), shard, message_id


def _divided(total: int, shards: int) -> int:
    return max(1, math.ceil(total / shards))


def shard_config(config: Config, shard: int, shards: int) -> Config:
    """The config of one shard's relay process (see the module docstring for what changes).

    With one shard this is ``config`` unchanged.
    """
    if shards == 1 and shard == 0:
        return config
    spool_dir = shard_dir(config.spool.dir, shard)
    archive = config.spool.archive_dir
    if archive and shard:
        archive = os.path.join(archive, SHARDS_DIR, str(shard))
    control = config.server.control_socket
    if shard:
        default_control = os.path.join(config.spool.dir, "control.sock")
        control = os.path.join(spool_dir, "control.sock") if control == default_control else f"{control}.{shard}"
    metrics = config.server.metrics_listen
    if metrics is not None and metrics.port and shard:
        if metrics.port + shard > 65535:
            raise ConfigError(f"port {metrics.port} + shard {shard} is over 65535", config.source,
                              "server.metrics_listen")
        metrics = attrs.evolve(metrics, port=metrics.port + shard)
    d = config.delivery
    return attrs.evolve(
        config,
        server=attrs.evolve(config.server, control_socket=control, metrics_listen=metrics),
        spool=attrs.evolve(config.spool, dir=spool_dir, archive_dir=archive),
        delivery=attrs.evolve(d, concurrency=_divided(d.concurrency, shards),
                              per_destination=_divided(d.per_destination, shards)),
    )


def all_shards(config: Config) -> list[tuple[int, Config]]:
    """Every shard's config, for the admin commands: (shard, config) for shard 0..count-1."""
    n = shard_count(config)
    return [(k, shard_config(config, k, n)) for k in range(n)]


def spool_config(config: Config, shard: int = 0) -> SpoolConfig:
    """The engine's config for shard K, whose spool names its messages ``HEX-K`` in replies, logs and DSNs."""
    return config.spool.engine(id_suffix=id_suffix(shard))
