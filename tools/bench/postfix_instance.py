"""A private, throw-away Postfix instance for benchmarks (never the system's).

Everything lives under one directory: ``config_directory`` (main.cf and
master.cf written here), ``queue_directory`` and ``data_directory``. The
instance listens only on ``127.0.0.1:PORT`` (its own ``smtpd`` line in
master.cf, replacing the usual ``smtp inet`` line, so port 25 is never
opened), relays everything to ``[127.0.0.1]:SINKPORT``, has no local
delivery (``mydestination`` empty, ``local_transport = error``), and logs to
its own ``maillog`` through postlogd. Started with ``postfix -c DIR start``
and stopped with ``postfix -c DIR stop`` (then ``abort``/SIGKILL of what is
left of its master's process tree, bounded in time).

Defaults are Postfix's own (process limits, ``in_flow_delay``, destination
concurrency 20, connection cache on demand) except ``chroot``: off for every
service, since a chroot would need copies of /etc files in the queue dir.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

SERVICES = """\
{listen} inet n - n - - smtpd
pickup    unix  n       -       n       60      1       pickup
cleanup   unix  n       -       n       -       0       cleanup
qmgr      unix  n       -       n       300     1       qmgr
tlsmgr    unix  -       -       n       1000?   1       tlsmgr
rewrite   unix  -       -       n       -       -       trivial-rewrite
bounce    unix  -       -       n       -       0       bounce
defer     unix  -       -       n       -       0       bounce
trace     unix  -       -       n       -       0       bounce
verify    unix  -       -       n       -       1       verify
flush     unix  n       -       n       1000?   0       flush
proxymap  unix  -       -       n       -       -       proxymap
proxywrite unix -       -       n       -       1       proxymap
smtp      unix  -       -       n       -       -       smtp
relay     unix  -       -       n       -       -       smtp
showq     unix  n       -       n       -       -       showq
error     unix  -       -       n       -       -       error
retry     unix  -       -       n       -       -       error
discard   unix  -       -       n       -       -       discard
local     unix  -       n       n       -       -       local
virtual   unix  -       n       n       -       -       virtual
lmtp      unix  -       -       n       -       -       lmtp
anvil     unix  -       -       n       -       1       anvil
scache    unix  -       -       n       -       1       scache
postlog   unix-dgram n  -       n       -       1       postlogd
"""

MAIN_CF = """\
compatibility_level = 3.6
config_directory = {dir}/etc
queue_directory = {dir}/queue
data_directory = {dir}/data
multi_instance_name = postfix-bench
mail_owner = postfix
setgid_group = postdrop
myhostname = postfix.bench.test
mydomain = bench.test
myorigin = $myhostname
mydestination =
local_recipient_maps =
local_transport = error:local delivery is disabled
alias_maps =
alias_database =
inet_interfaces = 127.0.0.1
inet_protocols = ipv4
mynetworks = 127.0.0.0/8
relayhost = [127.0.0.1]:{sink_port}
smtp_host_lookup = native
smtpd_relay_restrictions = permit_mynetworks, reject
smtpd_recipient_restrictions = permit_mynetworks, reject
biff = no
maillog_file = {dir}/maillog
maillog_file_prefixes = {dir}
smtputf8_enable = no
"""


class PostfixError(RuntimeError):
    pass


def check_installed() -> list[str]:
    """What is missing to run a private Postfix (empty when all is there)."""
    missing = [tool for tool in ("postfix", "postconf") if not _which(tool)]
    for user in ("postfix",):
        try:
            import pwd

            pwd.getpwnam(user)
        except KeyError:
            missing.append(f"user {user!r}")
    try:
        import grp

        grp.getgrnam("postdrop")
    except KeyError:
        missing.append("group 'postdrop'")
    if os.geteuid() != 0:
        missing.append("root (postfix start needs it)")
    return missing


def _which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/usr/bin:/sbin")


class PostfixInstance:
    """``with PostfixInstance(base, port, sink_port) as pf: ...``; pf.master_pid while running."""

    def __init__(self, base: str, port: int, sink_port: int) -> None:
        self.base = base
        self.port = port
        self.sink_port = sink_port
        self.config_dir = os.path.join(base, "etc")
        self.master_pid: int | None = None
        self.postfix = _which("postfix") or "postfix"

    # -- set-up -------------------------------------------------------------

    def write_config(self) -> None:
        for sub in ("etc", "queue", "data"):
            os.makedirs(os.path.join(self.base, sub), exist_ok=True)
        # Postfix refuses a queue under a group/world-writable path it owns; our
        # temp dir is 0700 root, its queue/data are chowned by `postfix start`.
        os.chmod(self.base, 0o755)
        with open(os.path.join(self.config_dir, "main.cf"), "w") as f:
            f.write(MAIN_CF.format(dir=self.base, sink_port=self.sink_port))
        with open(os.path.join(self.config_dir, "master.cf"), "w") as f:
            f.write(SERVICES.format(listen=f"127.0.0.1:{self.port}"))
        data = os.path.join(self.base, "data")
        shutil.chown(data, "postfix", "postfix")

    def _run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.postfix, "-c", self.config_dir, *args], capture_output=True,
                              text=True, timeout=timeout, check=False)

    def start(self, timeout: float = 60) -> None:
        self.write_config()
        res = self._run("start", timeout=timeout)
        if res.returncode != 0:
            # Postfix writes fatal errors to syslog unless stderr is a tty: rerun
            # `postfix check` under script(1) to show the reason.
            why = res.stderr.strip()
            if not why and shutil.which("script"):
                cmd = f"{self.postfix} -c {self.config_dir} check"
                why = subprocess.run(["script", "-qc", cmd, "/dev/null"], capture_output=True, text=True,
                                     timeout=timeout, check=False).stdout.strip()
            raise PostfixError(f"postfix start failed ({res.returncode}): {why or 'see ' + self.base + '/maillog'}")
        pid_file = os.path.join(self.base, "queue", "pid", "master.pid")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with open(pid_file) as f:
                    pid = int(f.read().strip())
                os.kill(pid, 0)
                self.master_pid = pid
                return
            except (OSError, ValueError):
                time.sleep(0.1)
        raise PostfixError(f"postfix master did not write {pid_file} within {timeout:.0f}s")

    def stop(self, timeout: float = 30) -> None:
        """``postfix stop``; then ``abort``; then SIGKILL of the master's tree. Bounded."""
        if self.master_pid is None:
            return
        tree = process_tree(self.master_pid)
        try:
            self._run("stop", timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _alive(self.master_pid):
            time.sleep(0.1)
        if _alive(self.master_pid):
            try:
                self._run("abort", timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for pid in tree + process_tree(self.master_pid):
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        self.master_pid = None

    def __enter__(self) -> PostfixInstance:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def process_tree(root: int) -> list[int]:
    """``root`` and all its live descendants (from /proc's ppid fields)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if _alive(pid):
            out.append(pid)
        todo.extend(children.get(pid, []))
    return out
