"""Delivery events read from the spool's log: the ``mta events`` command, the relay's ``/events`` endpoint,
consumers' cursors and the shippers (webhooks, Kafka) that run apart from the relay."""
