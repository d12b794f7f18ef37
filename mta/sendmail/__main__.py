"""``python -m mta.sendmail``: the ``sendmail`` command, where its console script is not installed."""

from mta.sendmail.cli import sendmail_entry

sendmail_entry()
