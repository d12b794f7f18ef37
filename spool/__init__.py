"""logspool's storage engine: an append-only log of mail queue records.

No SMTP knowledge lives here. The synchronous core (``spool.engine.spool.Spool``,
made of ``spool.engine.core``, ``claims``, ``admin_changes``, ``reclaim``, opened by
``spool.engine.recovery``) is used by the CLI, the Spark reader and property tests;
``spool.aio.async_spool.AsyncSpool`` (``group_commit``, ``async_claims``,
``async_admin``, ``checkpointer``) puts group commit and runners on trio for
the relay. The format is ``record``, ``segment`` and ``checkpoint``; the log
is read through ``reader`` (anomalies classified by ``damage``).
"""
