"""Filters asked before the final reply: milters (protocol 6) and rspamd over HTTP.

The sans-IO core is ``protocol`` (the wire), ``session`` (one conversation's
state table), ``changes`` (what a filter answered) and ``apply`` (the one
place changes are made); ``client`` and ``rspamd`` do the I/O; ``chain`` is
one SMTP session's filters in order with their failure default; ``accept``
reads the message back from the spool for them and stores what they changed.
"""
