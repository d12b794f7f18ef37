"""``mta archive upload URL``: the click command; ``mta.cli`` turns its exceptions into one line and a status.

Made for a cron line on every relay (docs/operations.md, "Archives in object
storage"): silent with ``--quiet`` when there was nothing to do or all went
well, one line and exit status 1 when a segment could not be sent (cron
mails it), 2 for what must be fixed first.
"""

from __future__ import annotations

import click

from mta.archive.upload import Sent, check_relay, destination, upload_directory
from mta.cli_common import config_option
from mta.config import ConfigError, load_config
from mta.shards import all_shards


@click.group()
def archive() -> None:
    """The relay's archived segments (``[spool] archive_dir``), for the fleet's report."""


@archive.command()
@config_option
@click.argument("url")
@click.option("--relay", default=None, metavar="NAME",
              help="The relay's name in the fleet's archive (default: [server] hostname).")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing unless something fails (for cron).")
def upload(config_path: str | None, url: str, relay: str | None, quiet: bool) -> None:
    """Upload the archived segments to URL/RELAY/ (s3://bucket/prefix, hdfs://..., file://..., a path).

    A segment already there with the same size and SHA-256 is skipped, so the
    command can run as often as you like; each shard K goes to URL/RELAY/shards/K/.
    """
    config = load_config(config_path)
    if config.spool.archive_dir is None:
        raise ConfigError("not set: the relay deletes its garbage segments, so there is nothing to upload "
                          "(set [spool] archive_dir)", config.source, "spool.archive_dir")
    name = check_relay(relay if relay is not None else config.server.hostname)

    def show(sent: Sent) -> None:
        if not quiet and sent.action in ("uploaded", "replaced"):
            click.echo(f"{sent.action} {sent.url} ({sent.size} bytes)")

    totals: dict[str, int] = {}
    for shard, shard_config in all_shards(config):
        directory = shard_config.spool.archive_dir
        assert directory is not None
        for sent in upload_directory(directory, destination(url, name, shard), show):
            totals[sent.action] = totals.get(sent.action, 0) + 1
    if not quiet:
        click.echo(f"mta archive upload: {totals.get('uploaded', 0) + totals.get('replaced', 0)} uploaded, "
                   f"{totals.get('skipped', 0)} already there, to {destination(url, name)}/")
