"""What a queue command can fail with, as the admin code raises it.

The admin modules (``client``, ``offline``, ``shards_merge``) never print and
never exit: they raise one of these, with a message that is one line for an
operator. ``mta.cli`` turns each class into that line (``mta: ...`` on
stderr, or ``{"error": ..., "code": ...}`` with ``--json``) and an exit
status, in one table; docs/operations.md lists them. A config the spool
refuses is a ``mta.config.ConfigError``, as it is for ``mta serve``.
"""

from __future__ import annotations


class AdminError(Exception):
    """Root of every error a queue command raises on purpose."""


class BadRequest(AdminError, ValueError):
    """The operator's input is malformed: a queue id, a list cursor, or a request the relay refused as such."""


class NoSuchMessage(AdminError, LookupError):
    """No queued message has that id (or the id names a shard the relay does not have)."""


class RelayNotAnswering(AdminError):
    """A relay holds the spool's lock, but its control socket does not answer (or answers nonsense).

    The spool cannot be read around it: the relay is its only writer.
    """


class SpoolUnavailable(AdminError):
    """No relay runs on the shard, and its spool cannot be opened from disk."""


class SpoolNotFound(SpoolUnavailable):
    """No relay runs on the shard, and its spool directory (or a directory above it) does not exist."""


class RequestFailed(AdminError):
    """The relay, or the spool opened from disk, could not do what was asked; the reason is the message."""
