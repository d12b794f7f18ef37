"""The ``mta`` command: run the relay and administer its queue.

Every command takes ``--config FILE`` (default ``$LOGSPOOL_CONFIG``, then
``./logspool.toml``, then the embedded defaults). Errors are one line on
stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import attrs
import click
import trio

from mta.admin.control import socket_path
from mta.admin.queue_ops import CHANGES, RequestError, change_op, parse_request, read_op
from mta.config import Config, ConfigError, load_config, parse_listen_address
from mta.config.cli import config as config_command
from mta.process.shards import all_shards, format_cursor, parse_cursor, parse_queue_id
from spool import admin
from spool.errors import SpoolError, SpoolLocked

EXIT_USAGE = 2
EXIT_ERROR = 1
SHAPE_TOP_PER_SHARD = 1000  # each shard's table before the merge: exact unless a shard sees more domains


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    click.echo(f"mta: {message}", err=True)
    sys.exit(code)


def _load(path: str | None) -> Config:
    try:
        return load_config(path)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    except OSError as exc:
        fail(f"cannot read config: {exc}", EXIT_USAGE)


config_option = click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                             help="TOML config file (default: $LOGSPOOL_CONFIG, ./logspool.toml, built-ins)")


@click.group()
def main() -> None:
    """logspool: a log-structured mail relay."""


def _interrupted(_signum: int, _frame: object) -> None:
    """SIGINT in ``mta serve``: one line and exit 130 at once (nothing to shut down: the next start recovers)."""
    os.write(2, b"mta: interrupted (SIGINT); nothing to shut down, the next start recovers\n")
    os._exit(130)


@main.command()
@config_option
@click.option("--shard", type=click.IntRange(0), default=None, hidden=True,
              help="(set by the supervisor) run only this spool shard")
@click.option("--shards", type=click.IntRange(1), default=None, hidden=True,
              help="(set by the supervisor) how many shards the relay runs")
@click.option("--supervisor", "supervisor_pid", type=int, default=None, hidden=True,
              help="(set by the supervisor) its pid: the shard exits when it dies")
@click.option("--listen", "listen", multiple=True, hidden=True,
              help="(set by the supervisor) the addresses, ports resolved")
def serve(config_path: str | None, shard: int | None, shards: int | None, supervisor_pid: int | None,
          listen: tuple[str, ...]) -> None:
    """Run the relay (crash-only: stop it with any signal; the next start recovers).

    With ``[server] processes`` above 1 (or shards on disk from an earlier
    run), this process supervises one child process per spool shard.
    """
    # Crash-only, Ctrl-C included: SIGINT ends the process at once, with no shutdown code and no
    # KeyboardInterrupt traceback. The process an operator started says so in one line and exits 130 (the
    # shell's code for Ctrl-C); a shard child (which gets the same SIGINT from the terminal) dies by the signal
    # silently, so the line is printed once. See docs/operations.md.
    signal.signal(signal.SIGINT, signal.SIG_DFL if shard is not None else _interrupted)
    from mta.process.relay import serve as run
    from mta.process.relay import serve_shard
    from mta.process.shards import shard_count
    from mta.process.startup import StartError
    from mta.process.supervisor import supervise

    config = _load(config_path)
    if listen:
        try:
            addrs = tuple(parse_listen_address(a) for a in listen)
        except ConfigError as exc:
            fail(f"--listen: {exc}", EXIT_USAGE)
        config = attrs.evolve(config, server=attrs.evolve(config.server, listen=addrs))
    if shard is not None and (shards is None or supervisor_pid is None or shard >= shards):
        fail("--shard is for the supervisor: it needs --shards (above the shard) and --supervisor", EXIT_USAGE)
    try:
        count = shards if shards is not None else shard_count(config)
    except OSError as exc:
        fail(str(exc))
    from mta.process.relay import spool_config

    try:
        spool_config(config)  # the engine's own checks, before any process or socket: one line, not a traceback
    except ValueError as exc:
        fail(f"{config.source}: spool: {exc}", EXIT_USAGE)
    # Several processes write to one stderr: each line names its process, as Postfix's do.
    fmt = "%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s" if count > 1 else \
        "%(asctime)s %(name)s %(levelname)s %(message)s"
    logging.basicConfig(level=config.log.level.upper(), stream=sys.stderr, format=fmt)
    try:
        if shard is not None:
            assert supervisor_pid is not None
            serve_shard(config, shard, count, supervisor_pid)
        elif count == 1:
            run(config)
        else:
            supervise(config)
    except SpoolLocked as exc:
        fail(f"{exc} (is another relay running on it?)")
    except ConfigError as exc:
        fail(str(exc) if exc.file else str(ConfigError(exc.problem, config.source, exc.key)), EXIT_USAGE)
    except StartError as exc:
        fail(str(exc.located(config.source)))
    except (SpoolError, OSError) as exc:
        fail(str(exc))


# -- queue administration ------------------------------------------------------


def _via_socket(path: str, req: dict[str, Any]) -> dict[str, Any] | None:
    """Ask the running relay; None when no relay listens on ``path``."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(120)
            s.connect(path)
            s.sendall(json.dumps(req).encode() + b"\n")
            buf = bytearray()
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    except OSError as exc:
        fail(f"control socket {path}: {exc}")
    try:
        answer = json.loads(buf)
    except ValueError:
        fail(f"control socket {path}: no answer from the relay (see its log)")
    if not isinstance(answer, dict):
        fail(f"control socket {path}: the relay's answer is not a JSON object")
    return answer


def _offline(config: Config, shard: int, raw: dict[str, Any]) -> dict[str, Any]:
    """No relay runs on this shard: open its spool ourselves (this takes the lock and recovers)."""
    from mta.process.relay import spool_config
    from spool.spool import Spool

    req = parse_request(raw)  # the same checks as the control socket's, before the spool is opened
    # Recovery's per-recipient in-doubt warnings belong in the relay's log, not on an admin's terminal.
    engine_log = logging.getLogger("spool")
    level = engine_log.level
    engine_log.setLevel(logging.ERROR)
    try:
        sp = Spool.open(config.spool.dir, spool_config(config, shard))
    except SpoolLocked:
        fail(f"the relay holds {config.spool.dir} but its control socket {socket_path(config)} does not answer")
    finally:
        engine_log.setLevel(level)
    try:
        if req.op in CHANGES:
            async def apply(op: str, mid: int) -> bool:
                return sp.change(mid, op)

            async def deferred() -> AsyncIterator[int]:
                cursor: int | None = None
                while True:
                    msgs, cursor = admin.page(sp, None, cursor, 1000)
                    for m in msgs:
                        if m.state == "queued" and m.klass > 0:
                            yield m.message_id
                    if cursor is None:
                        return

            return trio.run(change_op, req, apply, deferred, shard)
        return read_op(sp, req, sp.read_body, shard)
    finally:
        sp.close()


def _ask(config: Config, shard: int, req: dict[str, Any]) -> dict[str, Any]:
    """One shard's answer: from its relay process if it runs, else from its spool on disk."""
    answer = _via_socket(socket_path(config), req)
    if answer is None:
        if shard and not os.path.isdir(config.spool.dir):
            return _empty_answer(req)  # configured but never started: it holds nothing
        try:
            return _offline(config, shard, req)
        except (RequestError, SpoolError, ValueError) as exc:
            fail(str(exc))
    if not answer.get("ok"):
        fail(str(answer.get("error", "request failed")))
    return answer


def _empty_answer(req: dict[str, Any]) -> dict[str, Any]:
    op = req["op"]
    if op == "list":
        return {"messages": [], "next": None}
    if op == "count":
        return {"count": 0}
    if op == "shape":
        return {"buckets": [b if b != float("inf") else None for b in admin.AGE_BUCKETS], "rows": []}
    if op == "show":
        fail(f"no queued message with id {req.get('id')}")
    ids = req.get("ids") or []
    return {"done": [] if ids else 0, "skipped": [],
            "errors": {i: f"no queued message with id {i}" for i in ids}}


def _request(config: Config, req: dict[str, Any]) -> dict[str, Any]:
    """Spread a request over every spool shard and merge the answers (see ``mta.process.shards``)."""
    try:
        shards = all_shards(config)
    except (ConfigError, OSError) as exc:
        fail(str(exc))
    op = req["op"]
    if op == "count":
        return {"ok": True, "count": sum(_ask(c, k, req)["count"] for k, c in shards)}
    if op == "list":
        return _list(shards, req)
    if op == "show":
        shard = _shard_of(str(req["id"]), len(shards))
        return _ask(shards[shard][1], shard, req)
    if op == "shape":
        return _shape(shards, req)
    return _change_all(shards, req)


def _shard_of(queue_id: str, count: int) -> int:
    try:
        shard, _ = parse_queue_id(queue_id)
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE)
    if shard >= count:
        fail(f"no queued message with id {queue_id} (the relay has no shard {shard})")
    return shard


def _list(shards: list[tuple[int, Config]], req: dict[str, Any]) -> dict[str, Any]:
    """One page over the shards in turn (shard 0's messages first, each shard oldest first).

    The cursor names the shard and the position inside it, so paging through
    every shard needs no memory beyond one page.
    """
    limit = int(req["limit"])
    try:
        shard, pos = parse_cursor(req.get("cursor"))
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE)
    messages: list[Any] = []
    nxt: int | str | None = None
    while shard < len(shards):
        answer = _ask(shards[shard][1], shard, {**req, "limit": limit - len(messages), "cursor": pos})
        messages += answer["messages"]
        if answer["next"] is not None:
            nxt = format_cursor(shard, answer["next"])
            break
        shard, pos = shard + 1, None
        if len(messages) >= limit:
            nxt = format_cursor(shard, 0) if shard < len(shards) else None
            break
    return {"ok": True, "messages": messages, "next": nxt}


def _shape(shards: list[tuple[int, Config]], req: dict[str, Any]) -> dict[str, Any]:
    """Sum the shards' tables by domain, then keep the ``top`` largest (the rest as ``(others)``)."""
    top = int(req.get("top") or 20)
    table: dict[str, list[int]] = {}
    buckets: list[Any] = []
    for k, c in shards:
        answer = _ask(c, k, {**req, "top": SHAPE_TOP_PER_SHARD})
        buckets = answer["buckets"]
        for row in answer["rows"]:
            counts = table.setdefault(row["domain"], [0] * len(row["counts"]))
            for i, n in enumerate(row["counts"]):
                counts[i] += n
    others = table.pop("(others)", None)
    rows = sorted(table.items(), key=lambda kv: (-sum(kv[1]), kv[0]))
    for _, counts in rows[top:]:
        others = [a + b for a, b in zip(others, counts, strict=True)] if others else list(counts)
    out = [{"domain": d, "total": sum(c), "counts": c} for d, c in rows[:top]]
    if others:
        out.append({"domain": "(others)", "total": sum(others), "counts": others})
    return {"ok": True, "buckets": buckets, "rows": out}


def _change_all(shards: list[tuple[int, Config]], req: dict[str, Any]) -> dict[str, Any]:
    """hold/release/delete/flush: each id to its shard; a flush of everything to every shard."""
    ids: list[str] = req["ids"]
    if not ids:
        answers = [_ask(c, k, req) for k, c in shards]
        return {"ok": True, "done": sum(a["done"] for a in answers), "skipped": [], "errors": {}}
    by_shard: dict[int, list[str]] = {}
    for i in ids:
        by_shard.setdefault(_shard_of(i, len(shards)), []).append(i)
    merged: dict[str, Any] = {"ok": True, "done": [], "skipped": [], "errors": {}}
    for k, some in sorted(by_shard.items()):
        answer = _ask(shards[k][1], k, {**req, "ids": some})
        merged["done"] += answer["done"]
        merged["skipped"] += answer["skipped"]
        merged["errors"].update(answer["errors"])
    return merged


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _emit(as_json: bool, data: Any, human: Callable[[], None]) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=None, sort_keys=True))
    else:
        human()


json_option = click.option("--json", "as_json", is_flag=True, help="machine-readable output")


@main.group()
def queue() -> None:
    """Inspect and change the queue (works while the relay runs)."""


@queue.command("list")
@config_option
@click.option("--domain")
@click.option("--sender")
@click.option("--recipient")
@click.option("--held", is_flag=True, help="only held messages")
@click.option("--in-doubt", is_flag=True, help="only messages with recipients possibly delivered before a crash")
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True)
@click.option("--cursor", default=None, help="continue where the previous page ended")
@json_option
def queue_list(config_path: str | None, domain: str | None, sender: str | None, recipient: str | None,
               held: bool, in_doubt: bool, limit: int, cursor: str | None, as_json: bool) -> None:
    """List queued messages, oldest first, one page at a time."""
    config = _load(config_path)
    req = {"op": "list", "domain": domain, "sender": sender, "recipient": recipient, "held": held,
           "in_doubt": in_doubt, "limit": limit, "cursor": cursor}
    answer = _request(config, req)

    def human() -> None:
        for m in answer["messages"]:
            doubt = f"  in doubt: {', '.join(m['in_doubt'])}" if m["in_doubt"] else ""
            click.echo(f"{m['id']:>16} {m['state']:<7} {_age(m['age']):>6} {m['size']:>9}  "
                       f"<{m['sender']}> -> {', '.join(m['recipients'])}{doubt}")
            if m["last_error"]:
                click.echo(f"{'':>16} ({m['last_error']})")
        if answer["next"] is not None:
            click.echo(f"-- more: --cursor {answer['next']}")

    _emit(as_json, answer, human)


@queue.command("count")
@config_option
@click.option("--domain")
@click.option("--held", is_flag=True)
@json_option
def queue_count(config_path: str | None, domain: str | None, held: bool, as_json: bool) -> None:
    """Count queued messages."""
    answer = _request(_load(config_path), {"op": "count", "domain": domain, "held": held})
    _emit(as_json, answer, lambda: click.echo(answer["count"]))


def _check_ids(ids: tuple[str, ...]) -> list[str]:
    for i in ids:
        try:
            parse_queue_id(i)
        except ValueError as exc:
            fail(str(exc), EXIT_USAGE)
    return list(ids)


@queue.command("show")
@config_option
@click.argument("queue_id")
@click.option("--body", is_flag=True, help="include the message data")
@json_option
def queue_show(config_path: str | None, queue_id: str, body: bool, as_json: bool) -> None:
    """Show one message."""
    _check_ids((queue_id,))
    answer = _request(_load(config_path), {"op": "show", "id": queue_id, "body": body})

    def human() -> None:
        for key in ("id", "state", "class", "sender", "recipients", "size", "age", "attempts", "in_doubt",
                    "last_error"):
            value = answer[key]
            if key == "age":
                value = _age(value)
            if isinstance(value, list):
                value = ", ".join(value)
            click.echo(f"{key:>11}: {value}")
        click.echo(f"{'arrival':>11}: {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(answer['arrival']))}")
        if body:
            click.echo("")
            click.echo(answer.get("body", ""), nl=False)

    _emit(as_json, answer, human)


def _change(op: str) -> Callable[..., None]:
    @config_option
    @click.argument("queue_ids", nargs=-1, required=op != "flush")
    @json_option
    def command(config_path: str | None, queue_ids: tuple[str, ...], as_json: bool) -> None:
        answer = _request(_load(config_path), {"op": op, "ids": _check_ids(queue_ids)})

        def human() -> None:
            done = answer["done"]
            click.echo(f"{op}: {done if isinstance(done, int) else len(done)} done")
            for i in answer["skipped"]:
                click.echo(f"{i}: nothing to do")
            for i, err in answer["errors"].items():
                click.echo(f"{i}: {err}", err=True)

        _emit(as_json, answer, human)
        if answer["errors"]:
            sys.exit(EXIT_ERROR)

    command.__doc__ = {"hold": "Hold messages: no delivery until released.",
                       "release": "Release held messages (due at once).",
                       "delete": "Delete messages without a bounce.",
                       "flush": "Make deferred messages due now (all of them with no id)."}[op]
    return command


for _op in ("hold", "release", "delete", "flush"):
    queue.command(_op)(_change(_op))


@queue.command("shape")
@config_option
@click.option("--top", type=click.IntRange(1, 1000), default=20, show_default=True)
@json_option
def queue_shape(config_path: str | None, top: int, as_json: bool) -> None:
    """Queued messages by destination domain and age bucket (minutes), as Postfix's qshape."""
    answer = _request(_load(config_path), {"op": "shape", "top": top})

    def human() -> None:
        heads = [f"{int(b // 60)}" if b is not None else "more" for b in answer["buckets"]]
        click.echo(f"{'domain':<32}{'T':>7}" + "".join(f"{h:>7}" for h in heads))
        for row in answer["rows"]:
            click.echo(f"{row['domain'][:31]:<32}{row['total']:>7}" + "".join(f"{c:>7}" for c in row["counts"]))

    _emit(as_json, answer, human)


def _register_report() -> None:
    try:
        from mta.report.cli import report
    except ImportError:  # the Spark extra is not installed
        return
    main.add_command(report)


_register_report()
main.add_command(config_command)
