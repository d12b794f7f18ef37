"""Dovecot's LMTP service for tests: ``dovecot -F`` with its own config, users and Maildirs in the test's dir.

It listens on 127.0.0.1 (a port it was given free) and on a unix socket,
knows the users ``USERS`` (a passwd-file; ``full`` has a one-byte quota, and
``quota_full_tempfail`` makes a message over it a ``452 4.2.2``, so one
transaction can hold a delivered, a deferred and a refused recipient) and
delivers into ``mail/<user>/`` Maildirs. Dovecot refuses to deliver as
root, so when the tests run as root the mailboxes belong to ``nobody`` and
live in a directory that user can reach. Readiness is the greeting on the
port, polled within a deadline; the process is stopped by its pid at the end.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

USERS = ("alice", "bob", "carol", "full")
GREETING_WAIT = 20.0  # seconds Dovecot gets to start listening


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Dovecot:
    """One Dovecot LMTP server; ``start`` it, ``stop`` it (also after a failed test: a fixture's finaliser)."""

    def __init__(self, directory: Path, users: tuple[str, ...] = USERS) -> None:
        self.directory = directory
        self.users = users
        self.port = _free_port()
        self.socket = str(directory / "lmtp.sock")
        self.proc: subprocess.Popen[bytes] | None = None
        if os.getuid() == 0:
            who = pwd.getpwnam("nobody")
            self.uid, self.gid = who.pw_uid, who.pw_gid
            self.mail = Path(tempfile.mkdtemp(prefix="logspool-dovecot-"))  # reachable by nobody, unlike tmp_path
            os.chmod(self.mail, 0o755)
            os.chown(self.mail, self.uid, self.gid)
        else:
            self.uid, self.gid = os.getuid(), os.getgid()
            self.mail = directory / "mail"
            self.mail.mkdir()

    def _config(self) -> str:
        me = pwd.getpwuid(os.getuid()).pw_name
        group = grp.getgrgid(os.getgid()).gr_name
        d = self.directory
        return f"""
base_dir = {d}/run
state_dir = {d}/state
log_path = {d}/dovecot.log
instance_name = logspool-test-{self.port}
protocols = lmtp
ssl = no
default_internal_user = {me}
default_internal_group = {group}
default_login_user = {me}
first_valid_uid = {min(self.uid, 1)}
auth_username_format = %Ln
mail_location = maildir:{self.mail}/%u
mail_plugins = quota
quota_full_tempfail = yes
passdb {{
  driver = passwd-file
  args = {d}/users
}}
userdb {{
  driver = passwd-file
  args = {d}/users
  default_fields = uid={self.uid} gid={self.gid} home={self.mail}/%u
}}
plugin {{
  quota = count:User quota
  quota_vsizes = yes
}}
service lmtp {{
  inet_listener lmtp {{
    address = 127.0.0.1
    port = {self.port}
  }}
  unix_listener {self.socket} {{
    mode = 0600
  }}
}}
service anvil {{
  chroot =
}}
"""

    def start(self) -> None:
        (self.directory / "users").write_text("".join(
            f"{user}:{{PLAIN}}x::::::{'userdb_quota_rule=*:storage=1B' if user == 'full' else ''}\n"
            for user in self.users))
        conf = self.directory / "dovecot.conf"
        conf.write_text(self._config())
        self.proc = subprocess.Popen(["dovecot", "-F", "-c", str(conf)], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + GREETING_WAIT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"dovecot exited with {self.proc.returncode}: {err}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                    if s.recv(512).startswith(b"220 ") and os.path.exists(self.socket):
                        return
            except OSError:
                pass
            time.sleep(0.05)  # a bounded poll for a child process to listen; not a synchronisation by time
        raise RuntimeError(f"dovecot did not greet on 127.0.0.1:{self.port} within {GREETING_WAIT:g} s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()  # the master then stops its children (auth, lmtp, log); SIGKILL would orphan them
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
            if self.proc.stderr is not None:
                self.proc.stderr.close()
            self.proc = None
        if self.mail != self.directory / "mail":
            shutil.rmtree(self.mail, ignore_errors=True)

    def messages(self, user: str) -> list[bytes]:
        """What ``user``'s INBOX holds (its Maildir's ``new/``), oldest name first."""
        new = self.mail / user / "new"
        if not new.is_dir():
            return []
        return [p.read_bytes() for p in sorted(new.iterdir())]

    def log(self) -> str:
        path = self.directory / "dovecot.log"
        return path.read_text() if path.exists() else ""
