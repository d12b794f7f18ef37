"""``sendmail`` and ``mailq`` (``mta.sendmail``) against a real relay: run as a cron job runs them.

The command runs as a child process with the relay's config (``-C``), as
``python -m mta.sendmail`` (the console script of the same function, for a
worktree whose package is not installed). With the relay running, the
message goes over SMTP and lands in the relay's Maildir; with the relay
down, into the drop directory, which the relay takes in when it starts and
while it runs. Nothing given to ``sendmail`` with exit 0 is lost.
"""

from __future__ import annotations

import email
import email.policy
import os
import socket
import subprocess
import sys
from pathlib import Path

import trio
from relay_support import DeliveryWatch, start_relay

from mta.config import parse_config
from spool.format.record import Status

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(tmp: Path, port: int, extra: str = "") -> Path:
    path = tmp / "relay.toml"
    path.write_text(f"""
[server]
listen = ["127.0.0.1:{port}"]
hostname = "relay.test"
[spool]
dir = "spool"
retry_intervals = ["1s"]
[sendmail]
pickup_interval = "0.2s"
{extra}
[routes]
"localhost" = "maildir:maildir"
"*" = "discard"
""")
    return path


def sendmail(config: Path, *args: str, stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "mta.sendmail", "-C", str(config), *args], input=stdin,
                          capture_output=True, timeout=60, check=False, cwd=str(config.parent),
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def delivered(tmp: Path, user: str) -> list[email.message.EmailMessage]:
    new = tmp / "maildir" / user / "new"
    found = []
    for path in sorted(new.iterdir()) if new.exists() else []:
        msg = email.message_from_bytes(path.read_bytes(), policy=email.policy.default)
        assert isinstance(msg, email.message.EmailMessage)
        found.append(msg)
    return found


CRON_SCRIPT = """#!/bin/sh
# What cron does with a job's output: a message on stdin, LF line ends, recipients in the header.
printf 'To: alice@localhost\\nBcc: bob@localhost\\nSubject: Cron <root@host> backup\\n\\n' >"$OUT"
printf 'backup done\\n.\\nafter a dot line\\n' >>"$OUT"
"$PYTHON" -m mta.sendmail -C "$CONFIG" -t -oi -odi -oem -F 'Cron Daemon' <"$OUT"
"""


async def test_sendmail_t_from_a_cron_like_script_is_delivered_into_the_maildir(tmp_path: Path) -> None:
    config = write_config(tmp_path, free_port())
    script = tmp_path / "cronjob.sh"
    script.write_text(CRON_SCRIPT)
    script.chmod(0o755)
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, parse_config(config.read_text(), source=str(config),
                                                        base_dir=str(tmp_path)))
        watch = DeliveryWatch(relay)
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "PYTHON": sys.executable, "CONFIG": str(config),
               "LOGNAME": "root", "USER": "root", "OUT": str(tmp_path / "job.out")}  # cron's sparse environment
        done = await trio.run_process([str(script)], env=env, capture_stdout=True, capture_stderr=True,
                                      check=False)
        assert done.returncode == 0 and done.stderr == b"", done.stderr
        await watch.wait_for(Status.DELIVERED, 2)
        nursery.cancel_scope.cancel()
    (alice,) = delivered(tmp_path, "alice")
    (bob,) = delivered(tmp_path, "bob")  # the Bcc recipient, with no Bcc: header left
    assert alice["Subject"] == "Cron <root@host> backup" and "Bcc" not in alice and "Bcc" not in bob
    assert alice["From"] == "Cron Daemon <root@relay.test>" and alice["Message-ID"] and alice["Date"]
    assert alice.get_content().replace("\r\n", "\n") == "backup done\n.\nafter a dot line\n"  # -oi: a dot is text
    assert not (tmp_path / "spool" / "maildrop" / "new").exists() or \
        not os.listdir(tmp_path / "spool" / "maildrop" / "new")  # it went over SMTP


async def test_while_the_relay_is_down_sendmail_drops_and_the_relay_takes_all_in(tmp_path: Path) -> None:
    config = write_config(tmp_path, free_port())  # nothing listens there yet
    for n in range(3):
        done = sendmail(config, "-f", "app@example.org", "alice@localhost",
                        stdin=f"Subject: down {n}\n\nbody {n}\n".encode())
        assert done.returncode == 0 and done.stderr == b"", done.stderr
    drop = tmp_path / "spool" / "maildrop"
    assert len(os.listdir(drop / "new")) == 3 and os.listdir(drop / "tmp") == []
    cfg = parse_config(config.read_text(), source=str(config), base_dir=str(tmp_path))
    async with trio.open_nursery() as nursery:
        relay = await start_relay(nursery, cfg)  # takes the three in before it reports started
        watch = DeliveryWatch(relay)
        assert os.listdir(drop / "new") == []
        await watch.wait_for(Status.DELIVERED, 3)
        # While it runs: a file left by a sendmail that could not reach it is taken in at the next look.
        from mta.inbound import maildrop

        maildrop.write(str(drop), maildrop.Dropped("app@example.org", ("alice@localhost",), "app",
                                                   b"Subject: later\r\n\r\nlater\r\n"))
        await watch.wait_for(Status.DELIVERED, 4)
        nursery.cancel_scope.cancel()
    subjects = sorted(str(m["Subject"]) for m in delivered(tmp_path, "alice"))
    assert subjects == ["down 0", "down 1", "down 2", "later"]
    (first, *_) = delivered(tmp_path, "alice")
    assert "from local user" in str(first["Received"])


def test_bad_input_gets_one_line_and_a_sysexits_status(tmp_path: Path) -> None:
    config = write_config(tmp_path, free_port())
    for args, status, words in ((["-t"], os.EX_USAGE, "no recipients"),
                                (["-q", "a@localhost"], os.EX_USAGE, "unknown option -q"),
                                (["-bs"], os.EX_USAGE, "-bs is not supported"),
                                (["-f"], os.EX_USAGE, "-f needs a value")):
        done = sendmail(config, *args, stdin=b"Subject: x\n\nbody\n")
        assert done.returncode == status, (args, done)
        assert done.stderr.count(b"\n") == 1 and words.encode() in done.stderr, done.stderr
    done = sendmail(config, "a@localhost", stdin=b"no header line\xff here\nSubject: x\n\n")
    assert done.returncode == os.EX_DATAERR and done.stderr.count(b"\n") == 1, done
    # Relay down and the drop directory cannot be made: EX_TEMPFAIL (a retry can work), nothing claimed sent.
    (tmp_path / "afile").write_text("")
    blocked = write_config(tmp_path, free_port(), extra=f'drop_dir = "{tmp_path / "afile" / "drop"}"')
    done = sendmail(blocked, "a@localhost", stdin=b"Subject: x\n\nbody\n")
    assert done.returncode == os.EX_TEMPFAIL and done.stderr.startswith(b"sendmail: not sent, try again"), done
    assert done.stderr.count(b"\n") == 1


async def test_a_recipient_the_relay_refuses_for_good_is_ex_nouser_and_mailq_lists_the_queue(tmp_path: Path) -> None:
    config = write_config(tmp_path, free_port(), extra='[relay]\nmynetworks = ["10.0.0.0/8"]')
    text = config.read_text().replace('"*" = "discard"', '"*" = "smtp://127.0.0.1:9"')
    config.write_text(text)
    async with trio.open_nursery() as nursery:
        await start_relay(nursery, parse_config(text, source=str(config), base_dir=str(tmp_path)))
        done = await trio.to_thread.run_sync(lambda: sendmail(config, "bob@far.example", stdin=b"Subject: x\n\nx\n"))
        assert done.returncode == os.EX_NOUSER, done
        assert done.stderr == b"sendmail: <bob@far.example>: 554 5.7.1 Relay access denied\n", done.stderr
        assert not (tmp_path / "spool" / "maildrop" / "new").exists()
        mailq, listed = await trio.to_thread.run_sync(queue_lists, config, tmp_path)
        nursery.cancel_scope.cancel()
    assert mailq.returncode == listed.returncode == 0, (mailq, listed)
    assert mailq.stdout == listed.stdout and b"empty" in mailq.stdout.lower(), mailq.stdout


def queue_lists(config: Path, cwd: Path) -> tuple[subprocess.CompletedProcess[bytes], ...]:
    """``mailq --config CONFIG`` and ``mta queue list --config CONFIG``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return tuple(subprocess.run([sys.executable, *args, "--config", str(config)], capture_output=True, timeout=60,
                                check=False, env=env, cwd=str(cwd))
                 for args in (["-c", "from mta.sendmail.cli import mailq_entry; mailq_entry()"],
                              ["-m", "mta", "queue", "list"]))
