"""Harnesses that prove the spool loses nothing: power loss, kill -9, disk faults, corruption."""
