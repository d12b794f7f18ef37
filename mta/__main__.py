"""``python -m mta``: the same command as the ``mta`` console script (the supervisor starts shards this way)."""

from mta.cli import main

main()
