"""Signed mail: the relay signing with its own [dkim] against Postfix with Debian's OpenDKIM as its milter, same key.

    .venv/bin/python tools/bench/dkim_vs_postfix.py                   # 4 KB and 100 KB, 20 sessions, 3 reps
    .venv/bin/python tools/bench/dkim_vs_postfix.py --sizes 4096 --messages 1000 --reps 3 --json out.json

Needs root, Postfix (``postfix``, ``smtp-source``, ``smtp-sink``), ``opendkim``
and the relay in ``.venv/bin/mta``. One RSA-2048 key (``mta dkim keygen``'s
``generate``, written as PKCS#1 PEM, the form ``opendkim-genkey`` writes) signs
for ``source.test``, smtp-source's From: domain. OpenDKIM runs in signing
mode (relaxed/relaxed, rsa-sha256) on 127.0.0.1 and Postfix's
``smtpd_milters`` points at it; the relay has the key as its one
``[[dkim.key]]``. Every message of every run is signed by both.

First a check, untimed: one message through each MTA to an smtp-sink that
dumps what it receives, whose one DKIM-Signature ``opendkim -t`` must verify
(a run in which nothing was signed would measure nothing). Then for each size
the two are run in turn (Postfix, relay, Postfix, relay, ...) with
``smtp-source`` (one connection per message) and each MTA's own smtp-sink
counts what it delivered (``relay_vs_postfix.measure``):

- accepted msg/s: messages / smtp-source's wall time (each was signed before
  its 250);
- end-to-end msg/s: messages / time until the MTA's sink counted them all;
- CPU ms per message of the MTA's process tree plus OpenDKIM's (a process
  of its own, no child of Postfix's master), and OpenDKIM's share.

Medians of the reps; ratios are relay/Postfix of the medians. The machine's
fsync rate is probed before the runs (``disk_probe``). The last line is the
JSON of the whole run.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, ROOT)  # mta, for the key
sys.path.insert(2, os.path.join(ROOT, "tests", "support"))  # the OpenDKIM verifier the tests use
from common import cpu_model  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from disk_probe import fsync_probe  # noqa: E402
from dkim_support import opendkim_verdicts  # noqa: E402
from postfix_instance import PostfixInstance, check_installed  # noqa: E402
from relay_vs_postfix import Logspool, Sink, free_port, measure, smtp_source, stop_process, tool  # noqa: E402

from mta.dkim.keygen import generate  # noqa: E402
from mta.dkim.keys import signing_key  # noqa: E402

DOMAIN, SELECTOR = "source.test", "bench"  # smtp-source writes From: <bench@source.test>


class MilterPostfix(PostfixInstance):
    """The benchmarks' private Postfix with ``smtpd_milters`` = OpenDKIM."""

    def __init__(self, base: str, port: int, sink_port: int, milter: str) -> None:
        super().__init__(base, port, sink_port)
        self.milter = milter

    def write_config(self) -> None:
        super().write_config()
        with open(os.path.join(self.config_dir, "main.cf"), "a") as f:
            f.write(f"smtpd_milters = {self.milter}\nnon_smtpd_milters =\nmilter_default_action = tempfail\n"
                    "milter_protocol = 6\nsmtpd_peername_lookup = no\n")


class OpenDkim:
    """Debian's opendkim in signing mode on 127.0.0.1:port, as an operator configures it for Postfix."""

    def __init__(self, base: str, key_file: str) -> None:
        self.port = free_port()
        self.conf = os.path.join(base, "opendkim.conf")
        with open(self.conf, "w") as f:
            f.write(f"Syslog no\nMode s\nSocket inet:{self.port}@127.0.0.1\nDomain {DOMAIN}\nSelector {SELECTOR}\n"
                    f"KeyFile {key_file}\nCanonicalization relaxed/relaxed\nSignatureAlgorithm rsa-sha256\n"
                    f"InternalHosts 127.0.0.1\nPidFile {base}/opendkim.pid\nBackground no\nRequireSafeKeys no\n")
        self.log = open(os.path.join(base, "opendkim.log"), "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(["opendkim", "-f", "-x", self.conf], stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        _wait_port(self.port, self.proc)

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited ({proc.returncode}) before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port} after {timeout:.0f}s")


class DumpSink(Sink):
    """smtp-sink that also writes each message to a file under ``where`` (for the check, never timed)."""

    def __init__(self, port: int, where: str) -> None:
        self.port, self.count, self.where = port, 0, where
        self.proc = subprocess.Popen([tool("smtp-sink") or "smtp-sink", "-u", "postfix", "-d", f"{where}/%H%M%S.",
                                      "-c", f"127.0.0.1:{port}", "100"], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        import threading

        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()


def write_key(where: str) -> tuple[str, str]:
    """An RSA-2048 key file both signers read, and its DNS record text."""
    private = generate("rsa")
    path = os.path.join(where, "bench.private")
    with open(path, "wb") as f:
        f.write(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                      serialization.NoEncryption()))
    os.chmod(path, 0o600)
    return path, signing_key(private, DOMAIN, SELECTOR).record_text()


def add_key(config: str, key_file: str) -> None:
    """The relay's config at ``config`` signs every message smtp-source sends with ``key_file``."""
    with open(config, "a") as f:
        f.write(f'\n[[dkim.key]]\ndomain = "{DOMAIN}"\nselector = "{SELECTOR}"\nkey_file = "{key_file}"\n')


def relay(base: str, sink_port: int, key_file: str, sessions: int) -> Logspool:
    os.makedirs(base)
    ls = Logspool(base, free_port(), sink_port, sessions)
    add_key(ls.config, key_file)
    return ls


def check(tmp: str, key_file: str, record: str) -> dict[str, list[str]]:
    """One message through each MTA; OpenDKIM's verdict on the signature each put on it."""
    verdicts: dict[str, list[str]] = {}
    made: list[Any] = []
    try:
        for name in ("postfix_opendkim", "logspool"):
            dump = os.path.join(tmp, f"check-{name}")
            os.makedirs(dump)
            os.chmod(dump, 0o777)  # smtp-sink writes as user postfix
            sink = DumpSink(free_port(), dump)
            made.append(sink)
            if name == "logspool":
                mta: Any = relay(os.path.join(tmp, "check-relay"), sink.port, key_file, 1)
                mta.start(pythonpath=ROOT)
            else:
                os.makedirs(os.path.join(tmp, "check-opendkim"))
                milter = OpenDkim(os.path.join(tmp, "check-opendkim"), key_file)
                made.append(milter)
                os.makedirs(os.path.join(tmp, "check-postfix"))
                mta = MilterPostfix(os.path.join(tmp, "check-postfix"), free_port(), sink.port,
                                    f"inet:127.0.0.1:{milter.port}")
                mta.start()
            made.append(mta)
            smtp_source(mta.port, 1, 1, 4096, 120)
            if sink.wait_for(1, 120) is None:
                raise RuntimeError(f"{name}: the check message was not delivered")
            (path,) = glob.glob(os.path.join(dump, "*"))
            data = Path(path).read_bytes()
            if data.count(b"DKIM-Signature:") != 1:
                raise RuntimeError(f"{name}: {data.count(b'DKIM-Signature:')} signatures on the check message")
            verdicts[name] = opendkim_verdicts(data, {f"{SELECTOR}._domainkey.{DOMAIN}": record},
                                               Path(tmp) / f"verify-{name}")
            if verdicts[name] != ["pass"]:
                raise RuntimeError(f"{name}: OpenDKIM says {verdicts[name]} of its signature")
    finally:
        for thing in reversed(made):
            thing.stop()
    return verdicts


def run(args: argparse.Namespace) -> dict[str, Any]:
    missing = check_installed() + ([] if tool("opendkim") or os.path.exists("/usr/sbin/opendkim") else ["opendkim"])
    if missing:
        raise SystemExit("dkim_vs_postfix: missing " + ", ".join(missing))
    with tempfile.TemporaryDirectory(prefix="dkim-bench-") as tmp:
        os.chmod(tmp, 0o755)  # Postfix's daemons (user postfix) must reach their queue and data dirs
        key_file, record = write_key(tmp)
        verdicts = check(tmp, key_file, record)
        print(f"check: OpenDKIM verifies each MTA's signature: {verdicts}", file=sys.stderr)
        fsyncs = fsync_probe(2.0, tmp) if args.probe else None
        sinks = {name: Sink(free_port()) for name in ("postfix_opendkim", "logspool")}
        os.makedirs(os.path.join(tmp, "opendkim"))
        milter = OpenDkim(os.path.join(tmp, "opendkim"), key_file)
        mtas: dict[str, Any] = {}
        try:
            os.makedirs(os.path.join(tmp, "postfix"))
            pf = MilterPostfix(os.path.join(tmp, "postfix"), free_port(), sinks["postfix_opendkim"].port,
                               f"inet:127.0.0.1:{milter.port}")
            pf.start()
            mtas["postfix_opendkim"] = pf
            ls = relay(os.path.join(tmp, "logspool"), sinks["logspool"].port, key_file, args.sessions)
            ls.start(pythonpath=ROOT)  # this tree's relay, whichever checkout the venv was installed from
            mtas["logspool"] = ls
            runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
            for size in args.sizes:
                messages = args.messages if size <= 16384 else max(50, args.messages // 2)
                for rep in range(args.reps):
                    for name, mta in mtas.items():
                        root = mta.pid if name == "logspool" else pf.master_pid
                        assert root is not None
                        milter0 = _cpu(milter.proc.pid)
                        got = measure(root, sinks[name], mta.port, size, args.sessions, messages, args.timeout)
                        signer = round(1000 * (_cpu(milter.proc.pid) - milter0) / messages, 3)
                        # The MTA and its signer: OpenDKIM is no child of Postfix's master, so added here.
                        got["opendkim_cpu_ms_per_msg"] = signer
                        got["cpu_with_signer_ms_per_msg"] = round(got["cpu_ms_per_msg"] + signer, 3)
                        got["messages"] = messages
                        print(f"{size} B rep {rep + 1} {name}: {got['accepted_per_s']} accepted/s, "
                              f"{got['e2e_per_s']} e2e/s, {got['cpu_ms_per_msg']} CPU ms/msg", file=sys.stderr)
                        runs.setdefault((size, name), []).append(got)
        finally:
            for mta in mtas.values():
                mta.stop()
            milter.stop()
            for sink in sinks.values():
                sink.stop()
    keys = ("accepted_per_s", "e2e_per_s", "cpu_with_signer_ms_per_msg", "cpu_ms_per_msg", "opendkim_cpu_ms_per_msg")
    cells = []
    for size in args.sizes:
        med = {name: {k: statistics.median(r[k] for r in runs[size, name] if r.get(k) is not None) for k in keys}
               for name in ("postfix_opendkim", "logspool")}
        pf_med, ls_med = med["postfix_opendkim"], med["logspool"]
        cells.append({"size": size, "sessions": args.sessions, "medians": med,
                      "ratio": {k: round(ls_med[k] / pf_med[k], 2) for k in keys[:3] if pf_med[k]},
                      "runs": {name: runs[size, name] for name in med}})
    return {"command": " ".join(sys.argv), "date": datetime.date.today().isoformat(), "cpu": cpu_model(),
            "cpus": os.cpu_count(), "loadavg": open("/proc/loadavg").read().split()[:3],
            "fsync_per_s": fsyncs, "reps": args.reps, "check": verdicts, "cells": cells}


def _cpu(pid: int) -> float:
    """utime+stime of one process (OpenDKIM is one process with threads), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 102400])
    parser.add_argument("--messages", type=int, default=1000, help="per run (100 KB runs: half)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--no-probe", dest="probe", action="store_false", help="skip the fsync/s probe")
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args()
    doc = run(args)
    for cell in doc["cells"]:
        for name, m in cell["medians"].items():
            print(f"{cell['size']:>7} B {name:17} accepted {m['accepted_per_s']:8.1f} msg/s   end-to-end "
                  f"{m['e2e_per_s']:8.1f} msg/s   CPU {m['cpu_with_signer_ms_per_msg']:6.2f} ms/msg "
                  f"(of it OpenDKIM {m['opendkim_cpu_ms_per_msg']:5.2f})")
        print(f"{cell['size']:>7} B ratio relay/Postfix+OpenDKIM: {cell['ratio']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(doc, f, indent=1)
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
