"""logspool's storage engine: an append-only log of mail queue records.

No SMTP knowledge lives here. The synchronous core (``spool.spool.Spool``,
made of ``spool.core``, ``claims``, ``admin_changes``, ``reclaim``, opened by
``spool.recovery``) is used by the CLI, the Spark reader and property tests;
``spool.commit.AsyncSpool`` (``group_commit``, ``async_claims``,
``async_admin``, ``checkpointer``) puts group commit and runners on trio for
the relay. The format is ``record``, ``segment`` and ``checkpoint``; the log
is read through ``reader`` (anomalies classified by ``damage``).
"""
