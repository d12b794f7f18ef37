"""An S3-compatible server on 127.0.0.1 for the object-storage tests: moto's standalone server.

``s3_server`` starts it in this process (its own thread, a real HTTP server on
a port the kernel picks) and points every S3 client at it through the
standard AWS variables, as an operator points the relay and the report at
MinIO or Ceph. The variables must be set before Spark starts: its Python
workers take their environment from the JVM (tests/report/conftest.py starts
this first). Each test makes buckets of its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """Run the server; yields its endpoint URL. Stops only the server it started."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request drowns a failure's report
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in (*ENV, "AWS_ENDPOINT_URL")}
    os.environ.update(ENV, AWS_ENDPOINT_URL=endpoint)
    try:
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def client() -> Any:
    """A boto3 client of the server (for what the code under test must not do itself: a test's own puts)."""
    import boto3

    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
