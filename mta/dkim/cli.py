"""``mta dkim keygen`` (a new key pair and its DNS record) and ``mta dkim records`` (the configured keys').

Errors go through ``mta.cli.Mta`` like every command's: a file that exists
or a directory that cannot be written is one line and exit 1, a bad domain
or selector a usage error (exit 2), a configured key that cannot be used the
start error ``mta serve`` would give (exit 2).
"""

from __future__ import annotations

import os

import click

from mta.cli_common import config_option
from mta.config import ConfigError, load_config
from mta.config.dkim import MailDomain, Selector
from mta.dkim.keygen import KEY_TYPES, RSA_BITS, write_key_pair
from mta.dkim.keys import dns_record, load_keys
from spool import Kind

__all__ = ["dkim"]


def _checked(kind: Kind[str], value: str, param: str) -> str:
    try:
        return kind.read(value)
    except ConfigError as exc:
        raise click.BadParameter(exc.problem, param_hint=param) from None


@click.group()
def dkim() -> None:
    """DKIM signing keys (docs/security.md, "DKIM signing")."""


@dkim.command(short_help="Write a new key pair and print the DNS TXT record to publish.")
@click.argument("domain")
@click.argument("selector")
@click.option("--type", "kind", type=click.Choice(KEY_TYPES), default="rsa", show_default=True,
              help="rsa (2048 bits) or ed25519 (RFC 8463)")
@click.option("--bits", type=click.IntRange(1024, 4096), default=RSA_BITS, show_default=True,
              help="RSA key size")
@click.option("--dir", "directory", type=click.Path(file_okay=False, exists=True, writable=True), default=".",
              show_default=True, help="where DOMAIN.SELECTOR.key (mode 0600) and DOMAIN.SELECTOR.txt go")
def keygen(domain: str, selector: str, kind: str, bits: int, directory: str) -> None:
    """Generate a key for DOMAIN under SELECTOR: the private key in DIR/DOMAIN.SELECTOR.key (mode 0600), the
    record in DIR/DOMAIN.SELECTOR.txt. The TXT record goes to stdout, as a zone-file line; what to add to the
    config goes to stderr. An existing file is never overwritten."""
    domain = _checked(MailDomain(), domain, "DOMAIN")
    selector = _checked(Selector(), selector, "SELECTOR")
    pair = write_key_pair(domain, selector, kind, directory, bits)
    click.echo(pair.record)
    click.echo(f"mta dkim keygen: wrote {pair.key_file} (private, mode 0600) and {pair.record_file}; publish the "
               f"record, then add to the config:\n[[dkim.key]]\ndomain = \"{domain}\"\nselector = \"{selector}\"\n"
               f"key_file = \"{os.path.abspath(pair.key_file)}\"", err=True)


@dkim.command(short_help="Print the DNS TXT record of every configured key.")
@config_option
def records(config_path: str | None) -> None:
    """The TXT record each [[dkim.key]] needs published, as zone-file lines (inactive keys too), to compare with
    what DNS serves (dig +short TXT SELECTOR._domainkey.DOMAIN)."""
    config = load_config(config_path)
    for key in load_keys(config.dkim_keys, config.source):
        state = "" if key.active else "  ; active = false"
        click.echo(dns_record(key.name, key.record_text()) + state)
