"""The HTTP API over TLS (``[http] tls_cert``/``tls_key``), with curl as the client, and its counters.

curl checks the relay's certificate against the test's CA (trustme) and
injects a message; a plain-HTTP client on the HTTPS port gets nothing and the
relay serves on; the API's counters (requests by status, recipients
injected) say what happened.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import trio
import trustme
from process_support import run_mta
from relay_support import start_relay, write_relay_config

from mta.config import load_config

pytestmark = pytest.mark.slow

TOKEN = "tls-token"
BODY = {"envelope_sender": "noreply@example.com", "content": "Subject: hello\n\nHello there",
        "recipients": [{"email": "a@sink.test"}, {"email": "b@sink.test"}]}


def curl(*args: str) -> tuple[int, str, str]:
    out = subprocess.run(["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", *args], capture_output=True, text=True,
                         timeout=30)
    body, _, code = out.stdout.rpartition("\n")
    return int(code or 0), body, out.stderr


async def test_the_api_speaks_https_to_curl_and_counts_what_it_answered(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "api.crt"))
    cert.private_key_pem.write_to_path(str(tmp_path / "api.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    (tmp_path / "tokens").write_text(TOKEN + "\n")
    os.chmod(tmp_path / "tokens", 0o600)
    extra = f"""
[http]
listen = "127.0.0.1:0"
tokens_file = "{tmp_path / 'tokens'}"
tls_cert = "{tmp_path / 'api.crt'}"
tls_key = "{tmp_path / 'api.key'}"
"""
    config = load_config(write_relay_config(tmp_path, {"sink.test": "discard"}, extra=extra))
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, config)
        port = relay.api_listeners[0].socket.getsockname()[1]
        url = f"https://127.0.0.1:{port}/api/inject/v1"
        code, body, err = await trio.to_thread.run_sync(lambda: curl(
            "--cacert", str(tmp_path / "ca.pem"), "-H", f"Authorization: Bearer {TOKEN}",
            "-H", "Content-Type: application/json", "--data-binary", json.dumps(BODY), url))
        assert code == 200, (body, err)
        assert json.loads(body)["success_count"] == 2
        code, body, err = await trio.to_thread.run_sync(lambda: curl(
            "--cacert", str(tmp_path / "ca.pem"), "--data-binary", "{}", url))
        assert code == 401
        # a client that does not trust the certificate refuses it; one speaking plain HTTP gets no answer
        code, _, err = await trio.to_thread.run_sync(lambda: curl("--data-binary", "{}", url))
        assert code == 0 and "certificate" in err
        code, _, err = await trio.to_thread.run_sync(lambda: curl(
            "--data-binary", "{}", f"http://127.0.0.1:{port}/api/inject/v1"))
        assert code == 0
        # and the relay serves on
        code, body, _ = await trio.to_thread.run_sync(lambda: curl(
            "--cacert", str(tmp_path / "ca.pem"), "-H", f"Authorization: Bearer {TOKEN}",
            "-H", "Content-Type: application/json", "--data-binary", json.dumps(BODY), url))
        assert code == 200

        registry = relay.metrics.registry
        assert registry.get_sample_value("logspool_http_requests_total", {"status": "200"}) == 2
        assert registry.get_sample_value("logspool_http_requests_total", {"status": "401"}) == 1
        assert registry.get_sample_value("logspool_http_recipients_injected_total") == 4
        nursery.cancel_scope.cancel()


def test_a_certificate_without_its_key_stops_the_start_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text(TOKEN + "\n")
    os.chmod(tmp_path / "tokens", 0o600)
    (tmp_path / "api.crt").write_text("not a certificate\n")
    extra = f"""
[http]
listen = "127.0.0.1:0"
tokens_file = "{tmp_path / 'tokens'}"
tls_cert = "{tmp_path / 'api.crt'}"
"""
    path = write_relay_config(tmp_path, {"sink.test": "discard"}, extra=extra)
    out = run_mta("serve", "--config", str(path), cwd=tmp_path)
    assert out.returncode != 0 and "http.tls_key: needs http.tls_cert and http.tls_key together" in out.stderr
    assert "Traceback" not in out.stderr
