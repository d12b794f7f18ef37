"""The log as rows for the report, read from local or remote storage."""
