"""Logging in to a smarthost (``[smarthost_auth]``): relay A delivers through relay B's submission port.

Both relays run in this process over TCP on 127.0.0.1. B is the relay's
own submission service (587 with STARTTLS, a users file with alice, no
``mynetworks``: only a login lets a client send); A's routes name B's
listeners as fixed next hops, and A's secrets file has a login per hop:
PLAIN over a verified certificate, LOGIN (forced by the secrets file) over
required TLS, a wrong password, and a hop behind a route that requires no
TLS (a plain test server, to see that nothing at all is sent there).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trustme
from logfmt import events
from relay_support import DeliveryWatch, NextHop, relay_config, start_relay

from mta.auth.users import add_user
from mta.config import ConfigError, parse_config
from mta.inbound.session import Port
from spool.format.record import Status

PASSWORD = "correct horse battery staple"
ROOT = Path(__file__).resolve().parents[2]


def secrets(path: Path, entries: dict[str, tuple[str, str, str]]) -> Path:
    text = "".join(f'["{key}"]\nuser = "{user}"\npassword = "{password}"\n' +
                   (f'mechanism = "{mech}"\n' if mech else "") for key, (user, password, mech) in entries.items())
    path.write_text(text)
    os.chmod(path, 0o600)
    return path


def send(port: int, rcpt: str) -> None:
    import smtplib

    with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
        s.sendmail("sender@localhost", [rcpt], f"Subject: to {rcpt}\r\n\r\nbody\r\n")


async def test_the_relay_logs_in_to_a_second_relay_with_plain_and_login_never_without_tls_and_a_wrong_password_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mta")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    b_dir = tmp_path / "b"
    b_dir.mkdir()
    cert = ca.issue_cert("127.0.0.1", "localhost", "relay.test")
    cert.cert_chain_pems[0].write_to_path(str(b_dir / "cert.pem"))
    cert.private_key_pem.write_to_path(str(b_dir / "key.pem"))
    os.chmod(b_dir / "key.pem", 0o600)
    add_user(str(b_dir / "users"), "alice", PASSWORD)
    b_extra = f"""tls_cert = "{b_dir / 'cert.pem'}"
tls_key = "{b_dir / 'key.pem'}"
[relay]
mynetworks = []
[submission]
listen = ["127.0.0.1:0", "127.0.0.2:0"]
users_file = "{b_dir / 'users'}"
max_auth_failures = 1000
auth_failure_delay = "0s"
authenticated_header = true
"""
    async with trio.open_nursery() as nursery:
        b_routes = dict.fromkeys(("far.example", "login.example", "wrong.example", "localhost"), "maildir:maildir")
        b = await start_relay(nursery, relay_config(str(b_dir), b_routes, extra=b_extra))
        b_watch = DeliveryWatch(b)
        p1, p2 = b.ports_of(Port.SUBMISSION)
        plain_hop = NextHop()
        hop_port = await plain_hop.start(nursery)
        a_dir = tmp_path / "a"
        a_dir.mkdir()
        keys = secrets(a_dir / "smarthost.secrets", {
            f"127.0.0.1:{p1}": ("alice", PASSWORD, ""),
            f"localhost:{p1}": ("alice", PASSWORD, "LOGIN"),
            f"127.0.0.2:{p2}": ("alice", "not the password", ""),
            f"127.0.0.1:{hop_port}": ("alice", PASSWORD, ""),
        })
        a_extra = (f'[delivery]\ntls_ca_file = "{tmp_path / "ca.pem"}"\n'
                   f'[smarthost_auth]\nsecrets_file = "{keys}"\n')
        a = await start_relay(nursery, relay_config(str(a_dir), {
            "localhost": "maildir:maildir",
            "far.example": f"smtp://127.0.0.1:{p1}?tls=verify",
            "login.example": f"smtp://localhost:{p1}?tls=require",
            "wrong.example": f"smtp://127.0.0.2:{p2}?tls=require",
            "notls.example": f"smtp://127.0.0.1:{hop_port}?tls=opportunistic",
        }, extra=a_extra))
        watch = DeliveryWatch(a)
        for rcpt in ("bob@far.example", "carol@login.example", "w1@wrong.example", "w2@wrong.example",
                     "w3@wrong.example", "nils@notls.example"):
            await trio.to_thread.run_sync(send, a.ports[0], rcpt)

        (plain,) = await watch.wait_for(Status.DELIVERED, 1, recipient="bob@far.example")
        assert plain.next_hop.endswith("tls=verified"), plain
        (login,) = await watch.wait_for(Status.DELIVERED, 1, recipient="carol@login.example")
        assert login.next_hop.endswith("tls=encrypted"), login
        auths = {(e["user"], e["mechanism"]) for e in events(list(caplog.records), "auth")}
        assert auths == {("alice", "PLAIN"), ("alice", "LOGIN")}, auths
        await b_watch.wait_for(Status.DELIVERED, 2)
        delivered = sorted(os.listdir(b_dir / "maildir" / "bob" / "new")) + \
            sorted(os.listdir(b_dir / "maildir" / "carol" / "new"))
        assert len(delivered) == 2
        text = (b_dir / "maildir" / "bob" / "new" / os.listdir(b_dir / "maildir" / "bob" / "new")[0]).read_text()
        assert "(Authenticated sender: alice)" in text

        # No TLS required: the login is never sent; the plain server saw no connection at all.
        notls = (await watch.wait_for(Status.DEFERRED, 1, recipient="nils@notls.example"))[0]
        assert notls.enhanced == "4.7.0" and "does not require TLS" in notls.reply, notls
        assert plain_hop.connections == 0

        # A wrong password: every message deferred 4.7.8 (never bounced), tried again, and logged once.
        for n in (1, 2, 3):
            tries = await watch.wait_for(Status.DEFERRED, 2, recipient=f"w{n}@wrong.example")
            assert all(t.enhanced == "4.7.8" and "535" in t.reply for t in tries), tries
        assert watch.count(Status.BOUNCED) == 0
        failed = list(events(list(caplog.records), "smarthost_login_failed"))
        wrong = [e for e in failed if e.get("relay", "").startswith("127.0.0.2[")]
        assert len(wrong) == 1 and "535" in wrong[0]["detail"], failed
        assert all(PASSWORD not in r.getMessage() and "not the password" not in r.getMessage()
                   for r in caplog.records)

        # The operator corrects the password: the file is read again and the mail flows.
        secrets(keys, {f"127.0.0.1:{p1}": ("alice", PASSWORD, ""), f"localhost:{p1}": ("alice", PASSWORD, "LOGIN"),
                       f"127.0.0.2:{p2}": ("alice", PASSWORD, ""), f"127.0.0.1:{hop_port}": ("alice", PASSWORD, "")})
        for n in (1, 2, 3):
            await watch.wait_for(Status.DELIVERED, 1, recipient=f"w{n}@wrong.example")
        assert any(e.get("detail") == "logged in again" for e in events(list(caplog.records), "smarthost_login"))
        nursery.cancel_scope.cancel()


def test_a_secrets_file_others_may_read_is_refused_in_one_line_and_config_show_never_shows_a_password(
        tmp_path: Path) -> None:
    keys = secrets(tmp_path / "smarthost.secrets", {"relay.example:587": ("u", "s3cret-pass", "")})
    config = tmp_path / "relay.toml"
    config.write_text(f'[smarthost_auth]\nsecrets_file = "{keys}"\n[routes]\n"*" = "smtp://relay.example:587?tls=verify"\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    shown = subprocess.run([sys.executable, "-m", "mta", "config", "show", "--config", str(config)],
                           capture_output=True, text=True, timeout=60, check=False, env=env)
    assert shown.returncode == 0 and str(keys) in shown.stdout and "s3cret" not in shown.stdout, shown
    os.chmod(keys, 0o640)
    with pytest.raises(ConfigError, match="open to other users"):
        parse_config(config.read_text(), source=str(config), base_dir=str(tmp_path))
    served = subprocess.run([sys.executable, "-m", "mta", "serve", "--config", str(config)],
                            capture_output=True, text=True, timeout=60, check=False, env=env)
    assert served.returncode == 2 and served.stderr.count("\n") == 1, served
    assert "smarthost_auth.secrets_file" in served.stderr and "chmod 600" in served.stderr
    os.chmod(keys, 0o600)
    keys.write_text('["relay.example:587"]\nuser = "u"\npassword = 5\n')
    with pytest.raises(ConfigError, match="password must be text") as refused:
        parse_config(config.read_text(), source=str(config), base_dir=str(tmp_path))
    assert "s3cret" not in str(refused.value)
