"""Where a streamed body's memory goes in the relay (docs/benchmarks.md, "A 50 MB body in bounded memory").

    .venv/bin/python tools/bench/body_memory_probe.py [--mb 50] [--runs 1] [--smaps] [--env K=V ...]

Why: tests/security/test_security_limits.py bounds how much the relay's RSS
grows (VmHWM minus the idle VmRSS) while one client streams a 50 MB message;
this measures the same thing, and more closely: it samples
``/proc/PID/smaps_rollup`` every few milliseconds while DATA streams, and
with ``--smaps`` reads the whole ``smaps`` at each new peak to say which
mappings grew (the main heap, a thread's glibc arena, anonymous mmaps).
``--mb`` changes the message's size: a growth that is a fixed cost does not
move with it. ``--env`` passes settings to the relay's environment
(``MALLOC_ARENA_MAX=1``, say).

Prints one JSON line a run: the test's figure (``hwm_growth_mib``), the peak
of the sampled Rss over idle, the idle HWM over idle RSS (what the start
left in VmHWM), and with ``--smaps`` the mappings that grew the most.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MTA = str(Path(sys.executable).with_name("mta"))
CONFIG = ('[server]\nlisten = ["127.0.0.1:0"]\nhostname = "relay.test"\nmax_message_size = "{max}MB"\n'
          '[spool]\ndir = "spool"\nqueue_minfree = "1MB"\n[routes]\n"*" = "discard"\n')


def _status(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if k in ("VmRSS", "VmHWM")}


def _rollup(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        out = {}
        for line in f:
            m = re.match(r"(\w+):\s+(\d+) kB", line)
            if m:
                out[m.group(1)] = int(m.group(2))
        return out


def _smaps(pid: int) -> dict[str, int]:
    """Rss (KiB) by mapping, named by its path or its address range's start."""
    out: dict[str, int] = {}
    name = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split()
                name = parts[5] if len(parts) > 5 else "anon@" + parts[0].split("-")[0]
            elif line.startswith("Rss:"):
                out[name] = out.get(name, 0) + int(line.split()[1])
    return out


class _Smtp:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=120)
        self.file = self.sock.makefile("rb")

    def reply(self) -> bytes:
        while True:
            line = self.file.readline()
            if line[3:4] != b"-":
                return line

    def command(self, line: bytes) -> bytes:
        self.sock.sendall(line + b"\r\n")
        return self.reply()

    def start_message(self) -> None:
        for line in (b"EHLO big.example", b"MAIL FROM:<a@example.org>", b"RCPT TO:<b@far.example>", b"DATA"):
            self.command(line)


def run(mb: int, smaps: bool, env: dict[str, str]) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "relay.toml").write_text(CONFIG.format(max=mb + 10))
        proc = subprocess.Popen([MTA, "serve", "--config", "relay.toml"], cwd=tmp, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, **env})
        try:
            assert proc.stderr is not None
            port = 0
            for line in proc.stderr:
                if m := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
                    port = int(m.group(1))
                    break
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            warm = _Smtp(port)
            warm.reply()
            warm.start_message()
            warm.command(b"Subject: warm-up\r\n\r\nsmall\r\n.")
            idle = _status(proc.pid)
            idle_maps = _smaps(proc.pid) if smaps else {}
            peak = {"Rss": 0}
            peak_maps: dict[str, int] = {}
            done = threading.Event()

            def sample() -> None:
                nonlocal peak, peak_maps
                while not done.is_set():
                    r = _rollup(proc.pid)
                    if r["Rss"] > peak["Rss"]:
                        peak = r
                        if smaps:
                            peak_maps = _smaps(proc.pid)
                    time.sleep(0.002)

            sampler = threading.Thread(target=sample)
            c = _Smtp(port)
            c.reply()
            c.start_message()
            block = (b"x" * 998 + b"\r\n") * 64
            t0 = time.monotonic()
            sampler.start()
            for _ in range((mb << 20) // len(block) + 1):
                c.sock.sendall(block)
            streamed = _status(proc.pid)["VmHWM"]
            ok = c.command(b".")
            done.set()
            sampler.join()
            seconds = time.monotonic() - t0
            out: dict[str, object] = {
                "mb": mb, "env": env, "reply": ok[:3].decode(), "seconds": round(seconds, 2),
                "hwm_growth_mib": round((streamed - idle["VmRSS"]) / 1024, 2),
                "sampled_rss_growth_mib": round((peak["Rss"] - idle["VmRSS"]) / 1024, 2),
                "idle_hwm_over_rss_mib": round((idle["VmHWM"] - idle["VmRSS"]) / 1024, 2),
                "peak_anon_mib": round(peak.get("Anonymous", 0) / 1024, 2),
            }
            if smaps:
                grew = {k: peak_maps.get(k, 0) - idle_maps.get(k, 0) for k in set(peak_maps) | set(idle_maps)}
                out["grew_kib"] = dict(sorted(((k, v) for k, v in grew.items() if abs(v) >= 256),
                                              key=lambda kv: -abs(kv[1]))[:8])
            return out
        finally:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=50)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--smaps", action="store_true")
    ap.add_argument("--env", action="append", default=[])
    args = ap.parse_args()
    env = dict(e.split("=", 1) for e in args.env)
    for _ in range(args.runs):
        print(json.dumps(run(args.mb, args.smaps, env)), flush=True)


if __name__ == "__main__":
    main()
