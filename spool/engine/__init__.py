"""The synchronous engine: core state, claims, admin changes, reclaim, recovery, runners, and the Spool."""
