"""The SMTP relay built on the spool."""
