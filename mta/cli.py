"""The ``mta`` command (placeholder until the relay lands)."""

from __future__ import annotations

import click


@click.group()
def main() -> None:
    """logspool mail relay."""
