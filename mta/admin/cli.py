"""``mta queue ...``: the click commands and how their answers are printed.

The work is ``mta.admin.shards_merge.request``; its errors are exceptions
(``mta.admin.errors``) that ``mta.cli`` turns into one line and an exit
status. A change that failed for some ids is not an error of the command:
its answer lists them, and the exit status is 1.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import click

from mta.admin.shards_merge import check_ids, request
from mta.cli_common import EXIT_FAILURE, config_option, json_option
from mta.config import load_config


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


@click.group()
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
    req = {"op": "list", "domain": domain, "sender": sender, "recipient": recipient, "held": held,
           "in_doubt": in_doubt, "limit": limit, "cursor": cursor}
    answer = request(load_config(config_path), req)

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
    answer = request(load_config(config_path), {"op": "count", "domain": domain, "held": held})
    _emit(as_json, answer, lambda: click.echo(answer["count"]))


@queue.command("show")
@config_option
@click.argument("queue_id")
@click.option("--body", is_flag=True, help="include the message data")
@json_option
def queue_show(config_path: str | None, queue_id: str, body: bool, as_json: bool) -> None:
    """Show one message."""
    check_ids((queue_id,))
    answer = request(load_config(config_path), {"op": "show", "id": queue_id, "body": body})

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
        if body and answer.get("body_error"):
            click.echo(f"{'body':>11}: cannot be read: {answer['body_error']}")
        elif body:
            click.echo("")
            click.echo(answer.get("body", ""), nl=False)

    _emit(as_json, answer, human)


def _change(op: str) -> Callable[..., None]:
    @config_option
    @click.argument("queue_ids", nargs=-1, required=op != "flush")
    @json_option
    @click.pass_context
    def command(ctx: click.Context, config_path: str | None, queue_ids: tuple[str, ...], as_json: bool) -> None:
        ids = check_ids(queue_ids)
        answer = request(load_config(config_path), {"op": op, "ids": ids})

        def human() -> None:
            done = answer["done"]
            click.echo(f"{op}: {done if isinstance(done, int) else len(done)} done")
            for i in answer["skipped"]:
                click.echo(f"{i}: nothing to do")
            for i, err in answer["errors"].items():
                click.echo(f"{i}: {err}", err=True)

        _emit(as_json, answer, human)
        if answer["errors"]:
            ctx.exit(EXIT_FAILURE)  # the answer, printed above, names each id that failed and why

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
    answer = request(load_config(config_path), {"op": "shape", "top": top})

    def human() -> None:
        heads = [f"{int(b // 60)}" if b is not None else "more" for b in answer["buckets"]]
        click.echo(f"{'domain':<32}{'T':>7}" + "".join(f"{h:>7}" for h in heads))
        for row in answer["rows"]:
            click.echo(f"{row['domain'][:31]:<32}{row['total']:>7}" + "".join(f"{c:>7}" for c in row["counts"]))

    _emit(as_json, answer, human)
