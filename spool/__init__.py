"""logspool's storage engine: an append-only log of mail queue records.

No SMTP knowledge lives here. The synchronous core (``spool.spool.Spool``) is
used by the CLI, the Spark reader and property tests; ``spool.commit`` puts
group commit and runners on trio for the relay.
"""
