"""``mta events``: the relay's delivery events, read from its spool's log (durable records only).

Reads the spool directly, like ``spoolctl``: no lock, no request to the
relay, so it works while the relay runs, after it stopped, and after a
crash (it shows what the last fdatasync made durable). ``--follow`` waits
for more by watching the durable horizon the writer publishes.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import click
import trio

from mta.admin.errors import BadRequest
from mta.cli_common import config_option, json_option
from mta.config import Config, load_config
from mta.events.kafka import ship_kafka
from mta.events.rejections import RejectionReader, format_rid, parse_rid
from mta.events.source import classes_of, event_dict, open_stream, parse_from
from mta.events.webhook import ship_webhook
from mta.observe.logline import install as install_logging
from mta.shards import shard_config, shard_count
from spool import Event, EventStream, NotARecord, format_pos

POLL = 0.2  # seconds between looks at the durable horizon while following
READ_RECORDS = 4096  # records per read: memory stays one batch of events


def human(d: dict[str, Any]) -> str:
    """One line: id, kind, queue id, then the fields as key=value."""
    rest = " ".join(f"{k}={json.dumps(v) if not isinstance(v, (int, str)) or ' ' in str(v) else v}"
                    for k, v in d.items() if k not in ("id", "pos", "seq", "kind", "queue_id") and v not in ("", None))
    return f"{d['id']} {d['kind']} {d.get('queue_id') or '-'} {rest}".rstrip()


@click.group(invoke_without_command=True)
@config_option
@click.option("--from", "from_", default=None, metavar="POSITION|TIME",
              help="Begin at this event id (1:70) or at this UTC time (2026-12-02T01:00:00Z, @SECONDS); "
                   "default: the oldest record the log (and the archive) holds.")
@click.option("--follow", "-f", is_flag=True, help="Keep waiting for new events (Ctrl-C ends).")
@click.option("--shard", type=click.IntRange(0), default=0, show_default=True,
              help="Which shard's stream (a sharded relay has one per shard).")
@click.option("--rejections", is_flag=True,
              help="The SMTP rejections instead (ids r:SEQ; --from r:SEQ or a time), kept up to "
                   "[events] rejections_max.")
@json_option
@click.pass_context
def events(ctx: click.Context, config_path: str | None, from_: str | None, follow: bool, shard: int,
           rejections: bool, as_json: bool) -> None:
    """The relay's delivery events (received, delivered, deferred, bounced, ...), oldest first, one a line.

    Only records already on disk are shown: an event once shown is never
    taken back by a crash, and its id (the record's position, and the
    recipient's index) is the same on every read.
    """
    if ctx.invoked_subcommand is not None:
        return
    config = load_config(config_path)
    if rejections:
        _rejections(config, from_, follow, shard, as_json)
        return
    stream = open_stream(config, shard)
    classes = classes_of(config)
    since, since_ms = parse_from(from_) if from_ is not None else (None, None)

    def show(event: Event) -> None:
        if since_ms is not None and event.time_ms < since_ms:
            return
        d = event_dict(event, shard, classes)
        click.echo(json.dumps(d, sort_keys=True) if as_json else human(d))

    try:
        trio.run(_run, stream, since, follow, show)
    except NotARecord as exc:
        raise BadRequest(str(exc)) from None
    except KeyboardInterrupt:
        ctx.exit(130)


async def _run(stream: EventStream, since: int | None, follow: bool, show: Any) -> None:
    after: int | None = None
    while True:
        batch = await trio.to_thread.run_sync(functools.partial(stream.read, after, since=since,
                                                                max_records=READ_RECORDS))
        if batch.after is not None:
            since = None  # read on after the last record, from now on
        if batch.lagged and batch.gap is not None:
            click.echo(f"mta events: the log no longer holds {format_pos(batch.gap[0])} up to "
                       f"{format_pos(batch.gap[1])} (reclaimed, not archived): events there are lost to "
                       f"this reader", err=True)
        for event in batch.events:
            show(event)
        moved = batch.after != after
        after = batch.after
        if moved:
            continue  # more may be there already
        if not follow:
            return
        await trio.sleep(POLL)


def _rejections(config: Config, from_: str | None, follow: bool, shard: int, as_json: bool) -> None:
    """``--rejections``: the shard's rejections log (``mta.events.rejections``), oldest first."""
    shards = shard_count(config)
    if not 0 <= shard < shards:
        raise BadRequest(f"no shard {shard}: the relay has {shards} (0..{shards - 1})")
    reader = RejectionReader(shard_config(config, shard, shards).spool.dir)
    after: int | None = None
    since_ms: int | None = None
    if from_ is not None:
        if from_.strip().startswith("r:"):
            try:
                after = parse_rid(from_) - 1
            except ValueError as e:
                raise BadRequest(f"--from: {e}") from None
        else:
            position, since_ms = parse_from(from_)
            if position is not None:
                raise BadRequest(f"--from {from_!r}: with --rejections, a rejection id (r:17) or a time")
    try:
        while True:
            page = reader.read(after, READ_RECORDS, since_ms)
            if page.lagged and page.gap is not None:
                click.echo(f"mta events: rejections {format_rid(page.gap[0])} up to {format_rid(page.gap[1])} are "
                           f"no longer kept ([events] rejections_max)", err=True)
            for d in page.events:
                click.echo(json.dumps(d, sort_keys=True) if as_json else human(d))
            moved, after = page.after != after, page.after
            if moved:
                continue
            if not follow:
                return
            time.sleep(POLL)
    except KeyboardInterrupt:
        raise SystemExit(130) from None


@events.group()
def ship() -> None:
    """Ship the events out, in a process of its own (run it under your supervisor beside the relay)."""


@ship.command()
@config_option
@click.option("--shard", type=click.IntRange(0), default=0, show_default=True, help="Which shard's stream.")
def webhook(config_path: str | None, shard: int) -> None:
    """POST the events to [events] webhook_url in signed JSON batches, at least once, in order.

    Resumes from its consumer's cursor ([events] webhook_consumer) and runs
    until it is stopped; stopping it at any moment (kill -9 included) loses
    nothing: what was not acknowledged is sent again.
    """
    config = load_config(config_path)
    install_logging(config.log.level, config.log.format)
    try:
        ship_webhook(config, shard)
    except KeyboardInterrupt:
        raise SystemExit(130) from None


@ship.command()
@config_option
@click.option("--shard", type=click.IntRange(0), default=0, show_default=True, help="Which shard's stream.")
def kafka(config_path: str | None, shard: int) -> None:
    """Produce the events to [events] kafka_topic, keyed by queue id, at least once, in order per message.

    Resumes from its consumer's cursor ([events] kafka_consumer), which is
    stored only after the brokers acknowledged a whole batch (acks=all,
    idempotent producer); stopping it at any moment (kill -9 included)
    loses nothing: what was not acknowledged is produced again.
    """
    config = load_config(config_path)
    install_logging(config.log.level, config.log.format)
    try:
        ship_kafka(config, shard)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
