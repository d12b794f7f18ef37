"""``[sendmail]``: local submission with the ``sendmail`` command, and the drop directory behind it.

``sendmail`` hands a message to the running relay over SMTP (the first
``[server] listen`` address); when the relay cannot take it now (down, or a
4xx) it writes the message into ``drop_dir``, and the relay takes in what is
there at start and every ``pickup_interval`` while it runs
(``mta.inbound.pickup``). docs/design.md, "Local submission", says why.
"""

from __future__ import annotations

import os

import attrs

from spool import Derived, Duration, Path, setting

__all__ = ["SendmailSection"]


@attrs.frozen(kw_only=True)
class SendmailSection:
    """``[sendmail]``: docs/operations.md, "Local submission: sendmail and mailq"."""

    drop_dir: str = setting(
        Path(), "where `sendmail` leaves a message (written, fsynced, then renamed into `new/`) when the relay "
        "cannot take it; the relay takes them in. Its users must be able to write there", blank_is_default=True,
        derived=Derived("`<spool.dir>/maildrop`", lambda r: os.path.join(r("spool.dir"), "maildrop")))
    pickup_interval: float = setting(
        Duration(positive=True, at_most=3600.0), "how often the running relay looks into `drop_dir`; it looks "
        "at start too", 5.0)
