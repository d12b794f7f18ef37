"""Recipient tables and aliases: which local recipients exist and what an RCPT expands into (``table``), and
the tables as the relay's sessions use them, read again when they change (``maps``)."""
