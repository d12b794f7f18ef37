"""The HTTP API's counters, on the relay's registry: what an operator graphs beside the SMTP side's.

``logspool_http_requests_total{status}``: every answer the API gave, by its
status code (so errors are the 4xx and 5xx series); and
``logspool_http_recipients_injected_total``: recipients whose messages a
``200`` made durable (a retried ``Idempotency-Key`` counts again: the
counter is of answers, not of new messages).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

__all__ = ["ApiMetrics"]


class ApiMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.requests = Counter("logspool_http_requests", "HTTP API answers, by status code", ["status"],
                                registry=registry)
        self.recipients = Counter("logspool_http_recipients_injected",
                                  "recipients whose messages an HTTP API 200 made durable", registry=registry)

    def answered(self, status: int, recipients: int) -> None:
        self.requests.labels(str(status)).inc()
        if status == 200 and recipients:
            self.recipients.inc(recipients)
