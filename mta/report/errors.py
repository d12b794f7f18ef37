"""The report's one exception: what the operator must fix, said in one line."""

from __future__ import annotations


class ReportError(Exception):
    """Something the operator must fix (no Java, no segments, no pyspark); one line."""
