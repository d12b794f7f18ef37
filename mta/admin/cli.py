"""``mta queue ...``: the click commands and how their answers are printed.

The work is ``mta.admin.shards_merge.request``; its errors are exceptions
(``mta.admin.errors``) that ``mta.cli`` turns into one line and an exit
status. A change that failed for some ids is not an error of the command:
its answer lists them, and the exit status is 1.

What people read is shaped on Postfix's: ``list`` as ``postqueue -p``
(a header, ``*`` for a message being delivered and ``!`` for a held one, the
last error in parentheses, a ``-- N Kbytes in M Requests.`` totals line,
``Mail queue is empty``), ``shape`` as ``qshape`` (a TOTAL row, a T column).
Times are UTC, ISO 8601, with the age beside them. ``--json`` prints the
answer itself (docs/operations.md, "Queue administration").
"""

from __future__ import annotations

import itertools
import json
import math
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import click

from mta.admin.queue_ops import MAX_ERRORS_LISTED, MAX_LIMIT
from mta.admin.shards_merge import check_ids, request
from mta.bounce_class import Classifier, classifier_for
from mta.cli_common import EXIT_FAILURE, config_option, json_option
from mta.config import Config, load_config
from spool import format_age

DEFAULT_LIMIT = 100
EMPTY = "Mail queue is empty"
NO_MATCH = "No queued message matches"
_ID_WIDTH = 19  # a queue id and its mark: 16 hex digits, a shard suffix (-K) or two
_LIST_HEAD = f"{'-Queue ID-':<{_ID_WIDTH}}{'--Size--':>9} {'----Arrival Time----':<21} -Sender/Recipient-------"
_INDENT = " " * (_ID_WIDTH + 9 + 1 + 21 + 1)
_MARKS = {"active": "*", "held": "!"}  # postqueue -p's: * being delivered, ! held


def utc(seconds: float) -> str:
    """A time for people: UTC, ISO 8601, to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def when(seconds: float, now: float) -> str:
    """``utc`` and how long ago (or how soon) that is: ``2026-11-23T10:00:00Z (3h 12m ago)``, ``... (in 5m)``."""
    delta = round(now - seconds)
    if delta == 0:
        return f"{utc(seconds)} (now)"
    return f"{utc(seconds)} ({format_age(delta)} ago)" if delta > 0 else f"{utc(seconds)} (in {format_age(-delta)})"


def kbytes(size: int) -> int:
    """postqueue's unit: kilobytes, rounded up."""
    return math.ceil(size / 1024)


def requests(n: int) -> str:
    return f"{n} Request{'' if n == 1 else 's'}"


def status_words(m: dict[str, Any]) -> str:
    """Where a message stands, in words (the numbers stay in --json)."""
    if m["state"] == "active":
        return "being delivered"
    if m["state"] == "held":
        return f"held (mta queue release {m['id']} lets it go)"
    if m["class"] == 0:
        return "new" if not m["attempts"] else "due now (released or flushed)"
    every = f", every {format_age(m['retry_every'])}" if m.get("retry_every") else ""
    return f"deferred (retry class {m['class']}{every})"


def reply_text(row: dict[str, Any]) -> str:
    return " ".join(str(part) for part in (row["code"] or "", row["enhanced"], row["reply"]) if part)


_RECIPIENT_WORDS = {"in_doubt": "in doubt (perhaps delivered before a crash; it will be tried again)",
                    "active": "being delivered", "new": "not tried yet"}


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
@click.option("--limit", type=click.IntRange(1, MAX_LIMIT), default=None,
              help=f"messages per page  [default: {DEFAULT_LIMIT}; --json without --limit or --cursor: every message]")
@click.option("--cursor", default=None, help="continue where the previous page ended")
@json_option
def queue_list(config_path: str | None, domain: str | None, sender: str | None, recipient: str | None,
               held: bool, in_doubt: bool, limit: int | None, cursor: str | None, as_json: bool) -> None:
    """List queued messages, oldest first, one page at a time (--json alone: every message, in one object)."""
    req = {"op": "list", "domain": domain, "sender": sender, "recipient": recipient, "held": held,
           "in_doubt": in_doubt, "limit": limit or DEFAULT_LIMIT, "cursor": cursor}
    config = load_config(config_path)
    if as_json and limit is None and cursor is None:
        emit_whole_list(stream_list(config, req))
        return
    limit = limit or DEFAULT_LIMIT
    answer = request(config, req)

    def human() -> None:
        if not answer["total"]:
            filtered = any((domain, sender, recipient, held, in_doubt))
            click.echo(NO_MATCH if filtered else EMPTY)
            return
        # The next page's command repeats what selected this one.
        again = ["mta queue list", *(f"--{name} {shlex.quote(value)}" for name, value in
                                     (("config", config_path), ("domain", domain), ("sender", sender),
                                      ("recipient", recipient)) if value is not None),
                 *(flag for flag, on in (("--held", held), ("--in-doubt", in_doubt)) if on),
                 *([f"--limit {limit}"] if limit != DEFAULT_LIMIT else [])]
        print_list(answer, " ".join(again))

    _emit(as_json, answer, human)


def emit_whole_list(messages: Iterator[dict[str, Any]]) -> None:
    """Every message as one JSON object of a page's shape (``messages``, ``next``: null, ``total``,
    ``total_bytes``), written as it is read: a script reads the whole queue as it reads one page, and memory
    stays one page."""
    total = size = 0
    first = next(messages, None)  # the first page asked before any output: an error is the answer alone
    click.echo('{"messages": [', nl=False)
    for message in itertools.chain(() if first is None else (first,), messages):
        click.echo(("," if total else "") + "\n" + json.dumps(message, sort_keys=True), nl=False)
        total += 1
        size += message["size"]
    click.echo(("\n" if total else "") + f'], "next": null, "ok": true, "total": {total}, "total_bytes": {size}}}')


def stream_list(config: Config, req: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every message ``req`` selects, oldest first: the pages of ``MAX_LIMIT`` followed cursor to cursor.

    Memory: one page, whatever the queue holds.
    """
    cursor = None
    while True:
        answer = request(config, {**req, "limit": MAX_LIMIT, "cursor": cursor})
        yield from answer["messages"]
        cursor = answer["next"]
        if cursor is None:
            return


def print_list(answer: dict[str, Any], again: str = "mta queue list") -> None:
    """A page as ``postqueue -p`` prints the queue: header, one entry per message, totals last.

    ``again``: the command that lists the next page, given its ``--cursor``.
    """
    click.echo(_LIST_HEAD)
    for m in answer["messages"]:
        mark = _MARKS.get(m["state"], "")
        click.echo(f"{m['id'] + mark:<{_ID_WIDTH}}{m['size']:>9} {utc(m['arrival']):<21} {m['sender'] or '<>'}")
        if m["last_error"]:
            click.echo(f"({m['last_error']})")
        for r in m["recipients"]:
            click.echo(f"{_INDENT}{r}{' (in doubt)' if r in m['in_doubt'] else ''}")
        click.echo("")
    if answer["next"] is not None:
        click.echo(f"-- {len(answer['messages'])} shown, more: {again} --cursor {answer['next']}")
    click.echo(f"-- {kbytes(answer['total_bytes'])} Kbytes in {requests(answer['total'])}.")


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
    config = load_config(config_path)
    answer = request(config, {"op": "show", "id": queue_id, "body": body})
    add_classes(answer, classifier_for(config.bounce_classes.rules_file, config.bounce_classes.defaults))
    _emit(as_json, answer, lambda: print_show(answer, time.time()))


def add_classes(m: dict[str, Any], classes: Classifier) -> None:
    """Each recipient's bounce class, derived from its last reply (none for one delivered, deleted or untried)."""
    for row in m.get("recipient_status", ()):
        if row["status"] not in ("delivered", "deleted") and (row["code"] or row["enhanced"] or row["reply"]):
            row["class"] = classes.classify(int(row["code"]), str(row["enhanced"]), str(row["reply"]))


def print_show(m: dict[str, Any], now: float) -> None:
    """One message: where it stands, its times, and each recipient's status and last reply."""
    lines = [("queue id", m["id"]), ("status", status_words(m)), ("arrival", when(m["arrival"], now)),
             ("sender", f"<{m['sender']}>"), ("size", f"{m['size']} bytes")]
    attempts = str(m["attempts"])
    if m.get("last_attempt") is not None:
        attempts += f", the last {when(m['last_attempt'], now)}"
    lines.append(("attempts", attempts))
    if m["next_retry"] is not None:
        lines.append(("next retry", "now" if m["next_retry"] <= now else when(m["next_retry"], now)))
    if m["last_error"]:
        lines.append(("last error", m["last_error"]))
    for key, value in lines:
        click.echo(f"{key:>10}: {value}")
    click.echo(f"{'recipients':>10}:")
    for row in m["recipient_status"]:
        words = _RECIPIENT_WORDS.get(row["status"], row["status"])
        if row["status"] == "in_doubt" and m["state"] == "held":  # held at recovery (``in_doubt = "hold"``)
            words = f"in doubt (perhaps delivered before a crash; held: mta queue release {m['id']} sends it again)"
        text = f"  {row['recipient']}: {words}" + (f" [{row['class']}]" if row.get("class") else "")
        click.echo(text + (f": {reply_text(row)}" if reply_text(row) else ""))
        if row["time"] is not None:  # the reply's time and who gave it
            click.echo(f"      at {when(row['time'], now)}" + (f" from {row['next_hop']}" if row["next_hop"] else ""))
    if m.get("body_error"):
        click.echo(f"{'body':>10}: cannot be read: {m['body_error']}")
    elif "body" in m:
        click.echo("")
        click.echo(m["body"], nl=False)


STDIN_BATCH = 500  # ids read from standard input sent per request (a request line stays under 64 KiB)


def _stdin_ids() -> Iterator[list[str]]:
    """Queue ids from standard input, one or more a line (blank lines and ``#`` comments skipped), in batches."""
    batch: list[str] = []
    for line in sys.stdin:
        for word in line.partition("#")[0].split():
            batch.append(word)
            if len(batch) == STDIN_BATCH:
                yield check_ids(tuple(batch))
                batch = []
    if batch:
        yield check_ids(tuple(batch))


def _selection_words(all_: bool, in_doubt: bool, domain: str | None, sender: str | None) -> dict[str, Any]:
    return {key: value for key, value in (("all", all_), ("in_doubt", in_doubt), ("domain", domain),
                                          ("sender", sender)) if value}


def _change(op: str) -> Callable[..., None]:
    @config_option
    @click.argument("queue_ids", nargs=-1)
    @click.option("--all", "all_", is_flag=True, help="every queued message")
    @click.option("--in-doubt", is_flag=True, help="messages with recipients possibly delivered before a crash")
    @click.option("--domain", help="messages with a recipient at this domain")
    @click.option("--sender", help="messages from this sender")
    @click.option("--stdin", "from_stdin", is_flag=True, help="queue ids on standard input (as is the id -)")
    @click.option("--yes", is_flag=True, help="confirm delete --all" if op == "delete" else "(needed by delete --all)")
    @json_option
    @click.pass_context
    def command(ctx: click.Context, config_path: str | None, queue_ids: tuple[str, ...], all_: bool, in_doubt: bool,
                domain: str | None, sender: str | None, from_stdin: bool, yes: bool, as_json: bool) -> None:
        from_stdin = from_stdin or "-" in queue_ids
        named = tuple(i for i in queue_ids if i != "-")
        select = _selection_words(all_, in_doubt, domain, sender)
        if sum((bool(named), from_stdin, bool(select))) > 1:
            raise click.UsageError("give queue ids, ids on standard input, or a selection "
                             "(--all, --in-doubt, --domain, --sender), one of them")
        if not (named or from_stdin or select) and op != "flush":
            raise click.UsageError("which messages? give queue ids, - (ids on standard input), --all, "
                             "--in-doubt, --domain or --sender")
        if op == "delete" and all_ and not yes:
            raise click.UsageError("delete --all deletes every queued message without a bounce: add --yes to do it")
        config = load_config(config_path)
        if from_stdin:
            answer = _merge_counts(request(config, {"op": op, "ids": ids}) for ids in _stdin_ids())
        elif named:
            answer = request(config, {"op": op, "ids": check_ids(named)})
        else:
            answer = request(config, {"op": op, **select})

        def human() -> None:
            done = answer["done"]
            click.echo(f"{op}: {done if isinstance(done, int) else len(done)} done")
            skipped = answer["skipped"]
            if isinstance(skipped, int):
                if skipped and (select or from_stdin):  # a plain flush is of deferred mail: the rest is no news
                    click.echo(f"{op}: {skipped} with nothing to do")
            else:
                for i in skipped:
                    click.echo(f"{i}: nothing to do")
            failed = answer.get("failed")
            for i, err in answer["errors"].items():
                click.echo(f"{i}: {err}", err=True)
            if failed and failed > len(answer["errors"]):
                click.echo(f"{op}: {failed} failed ({len(answer['errors'])} shown)", err=True)

        _emit(as_json, answer, human)
        if answer["errors"] or answer.get("failed"):
            ctx.exit(EXIT_FAILURE)  # the answer, printed above, names each id that failed and why

    command.__doc__ = {"hold": "Hold messages: no delivery until released.",
                       "release": "Release held messages (due at once).",
                       "delete": "Delete messages without a bounce (--all needs --yes).",
                       "flush": "Make deferred messages due now (all of them with no id)."}[op]
    return command


def _merge_counts(answers: Iterator[dict[str, Any]]) -> dict[str, Any]:
    """The answers to the batches of ids read from standard input, as counts (their ids are not kept)."""
    merged: dict[str, Any] = {"ok": True, "done": 0, "skipped": 0, "failed": 0, "errors": {}}
    for answer in answers:
        merged["done"] += len(answer["done"])
        merged["skipped"] += len(answer["skipped"])
        merged["failed"] += len(answer["errors"])
        for i, err in answer["errors"].items():
            if len(merged["errors"]) < MAX_ERRORS_LISTED:
                merged["errors"][i] = err
    return merged


for _op in ("hold", "release", "delete", "flush"):
    queue.command(_op)(_change(_op))


@queue.command("shape")
@config_option
@click.option("--top", type=click.IntRange(1, 1000), default=20, show_default=True)
@json_option
def queue_shape(config_path: str | None, top: int, as_json: bool) -> None:
    """Queued messages by destination domain and age bucket (minutes), as Postfix's qshape."""
    answer = request(load_config(config_path), {"op": "shape", "top": top})

    _emit(as_json, answer, lambda: print_shape(answer))


def print_shape(answer: dict[str, Any]) -> None:
    """As qshape: domains right-aligned, T the total column, TOTAL the first row, buckets in minutes."""
    minutes = [int(b // 60) for b in answer["buckets"] if b is not None]
    heads = ["T", *(str(m) for m in minutes), f"{minutes[-1]}+"]
    click.echo(f"{'':>32}" + "".join(f"{h:>7}" for h in heads))
    totals = answer["totals"]
    for domain, total, counts in (("TOTAL", totals["total"], totals["counts"]),
                                  *((r["domain"], r["total"], r["counts"]) for r in answer["rows"])):
        click.echo(f"{domain[-31:]:>32}{total:>7}" + "".join(f"{c:>7}" for c in counts))
