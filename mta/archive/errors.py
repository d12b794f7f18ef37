"""The archive command's exceptions; ``mta.cli.FAILURES`` gives each its line and exit status."""

from __future__ import annotations


class ArchiveError(Exception):
    """The command can never work as given (a bad URL or relay name, no ``archive_dir``): exit 2."""


class UploadFailed(ArchiveError):
    """A segment could not be sent now (the store refused or failed); what was sent before it stays: exit 1."""
