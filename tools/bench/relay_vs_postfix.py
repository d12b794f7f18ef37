"""logspool relay against Postfix, side by side on this machine, in one command.

    .venv/bin/python tools/bench/relay_vs_postfix.py            # full: 4 KB and 100 KB x 1/20/100 sessions
    .venv/bin/python tools/bench/relay_vs_postfix.py --quick    # fewer messages, fewer cells
    .venv/bin/python tools/bench/relay_vs_postfix.py --messages 2000 --reps 3 --sizes 4096 --sessions 20
    .venv/bin/python tools/bench/relay_vs_postfix.py --profile /tmp/relay   # + py-spy of logspool under load
    .venv/bin/python tools/bench/relay_vs_postfix.py --chart-from run.json --svg chart.svg   # redraw a run's chart

Needs (checked first; nothing is installed): root, Postfix (``postfix``,
``postconf``, ``smtp-source``, ``smtp-sink``, the ``postfix`` user and
``postdrop`` group), ``strace`` (unless ``--no-strace``), the relay in
``.venv/bin/mta``; optionally matplotlib for the chart (``pip install -e
'.[bench]'``; without it no chart is written) and ``.venv/bin/py-spy`` for
``--profile``.

What it does: starts a PRIVATE Postfix (tools/bench/postfix_instance.py: its
own config/queue/data dirs in a temp dir, smtpd on 127.0.0.1:PORT only,
relayhost = a local smtp-sink, no local delivery) and the logspool relay
(``mta serve`` with a temp spool, route ``*`` to its own smtp-sink). Then for
every cell (message size x concurrent sessions) it runs ``smtp-source``
against each in turn, A B A B (``--reps`` pairs), and measures:

- accepted msg/s: messages / smtp-source's wall time;
- end-to-end msg/s: messages / time until that MTA's smtp-sink has counted
  them all (smtp-sink ``-c`` counters, read live from its stdout);
- CPU ms per message: utime+stime (+cutime+cstime, so exited Postfix
  daemons count) summed over the MTA's whole process tree, /proc deltas;
- peak RSS and PSS: the sum over the process tree, sampled every 0.5 s;
- fsyncs per message (fsync + fdatasync + sync_file_range), renames and
  unlinks: ``strace -f -c`` attached to the tree during a SEPARATE short run
  (strace slows the MTA down, so those runs are not timed).

Each figure is the median over reps; ratios are logspool/Postfix of the
medians (for CPU and RSS lower is better: a ratio < 1 means logspool used
less). The output is a table, a JSON document (also ``--json FILE``), a chart
(``--svg``, default docs/bench_relay.svg) and, as the LAST line, the
end-to-end ratio at 20 sessions, 4 KB.

smtp-source is run without ``-d``: one SMTP connection per message, as in
Postfix's own performance notes. Every process started here is stopped and
every temp dir removed on exit, including on Ctrl-C and on timeouts.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # mta, spool
from common import cpu_model as common_cpu_model
from disk_probe import describe_machine, fsync_probe
from postfix_instance import PostfixError, PostfixInstance, check_installed, process_tree

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_BIN = os.path.join(ROOT, ".venv", "bin")
CLK_TCK = os.sysconf("SC_CLK_TCK")
FSYNC_CALLS = ("fsync", "fdatasync", "sync_file_range")
RENAME_CALLS = ("rename", "renameat", "renameat2")
UNLINK_CALLS = ("unlink", "unlinkat")
SENDER, RECIPIENT = "bench@source.test", "rcpt@sink.test"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- /proc


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def tree_cpu_split(root: int) -> tuple[float, float]:
    """(user, system) seconds over root's live tree, utime+cutime and stime+cstime (reaped children are in c*)."""
    user = system = 0
    for pid in process_tree(root):
        fields = _stat_fields(pid)
        if fields:  # fields[11..14] = utime stime cutime cstime (stat fields 14..17)
            user += int(fields[11]) + int(fields[13])
            system += int(fields[12]) + int(fields[14])
    return user / CLK_TCK, system / CLK_TCK


def own_cpu_seconds(pid: int) -> float:
    """utime+stime of ``pid`` alone: the relay process without its children (delivery workers, say)."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK if fields else 0.0


def tree_cpu_seconds(root: int) -> float:
    """utime+stime+cutime+cstime over root's live tree (reaped children are in cutime)."""
    return sum(tree_cpu_split(root))


def tree_memory_kb(root: int) -> tuple[int, int]:
    """(sum of Rss, sum of Pss) in kB over root's live tree."""
    rss = pss = 0
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1])
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1])
        except OSError:
            continue
    return rss, pss


def machine_snapshot() -> dict[str, Any]:
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    return {"loadavg": os.getloadavg(), "cpu": cpu, "time": time.time()}


def machine_summary(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    delta = [y - x for x, y in zip(a["cpu"], b["cpu"], strict=False)]
    total = sum(delta) or 1
    # user nice system idle iowait irq softirq steal ...
    return {
        "cores": os.cpu_count(),
        "loadavg_start": [round(x, 2) for x in a["loadavg"]],
        "loadavg_end": [round(x, 2) for x in b["loadavg"]],
        "cpu_idle_pct": round(100 * delta[3] / total, 1),
        "cpu_iowait_pct": round(100 * delta[4] / total, 1),
        "cpu_steal_pct": round(100 * (delta[7] if len(delta) > 7 else 0) / total, 1),
        "wall_s": round(b["time"] - a["time"], 1),
    }


class MemorySampler:
    """Peak of the tree's summed RSS and PSS, sampled in a thread while running."""

    def __init__(self, root: int, interval: float = 0.5) -> None:
        self.root, self.interval = root, interval
        self.peak_rss = self.peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            rss, pss = tree_memory_kb(self.root)
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


# --------------------------------------------------------------------------- processes


class Sink:
    """smtp-sink on 127.0.0.1:port with -c; ``count`` is its live message counter."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.count = 0
        self.proc = subprocess.Popen(
            [tool("smtp-sink") or "smtp-sink", "-u", "postfix", "-c", f"127.0.0.1:{port}", "1000"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        stdout = self.proc.stdout
        assert isinstance(stdout, io.BufferedReader)  # a binary pipe with the default buffering
        tail = b""
        while True:
            chunk = stdout.read1(65536)
            if not chunk:
                return
            tail = (tail + chunk)[-256:]
            counts = re.findall(rb"mesg=(\d+)", tail)
            if counts:
                self.count = max(self.count, int(counts[-1]))

    def wait_for(self, target: int, timeout: float) -> float | None:
        """monotonic time when count >= target, None on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.count >= target:
                return time.monotonic()
            if self.proc.poll() is not None:
                raise RuntimeError(f"smtp-sink on port {self.port} exited ({self.proc.returncode})")
            time.sleep(0.01)
        return None

    def stop(self) -> None:
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(OSError):
        proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)


LOGSPOOL_TOML = """\
[server]
listen = ["127.0.0.1:{port}"]
hostname = "logspool.bench.test"
max_sessions = {max_sessions}
max_sessions_per_client = {max_sessions}
{processes}
[spool]
dir = "{dir}/spool"
retry_intervals = ["10s", "60s"]

[delivery]
concurrency = 100
per_destination = 20
max_messages_per_connection = 100
{delivery}
[routes]
"*" = "smtp://127.0.0.1:{sink_port}"
"""


def _delivery_line(processes: int | str | None) -> str:
    """``[delivery] processes`` as the config says it; None: not set (logspool's default)."""
    if processes is None:
        return ""
    return f'processes = "{processes}"\n' if processes == "auto" else f"processes = {processes}\n"


class Logspool:
    def __init__(self, base: str, port: int, sink_port: int, max_sessions: int, processes: int = 1,
                 delivery_processes: int | str | None = None) -> None:
        self.base, self.port, self.processes = base, port, processes
        self.config = os.path.join(base, "logspool.toml")
        with open(self.config, "w") as f:
            f.write(LOGSPOOL_TOML.format(port=port, dir=base, sink_port=sink_port,
                                         max_sessions=max(200, 2 * max_sessions),
                                         processes=f"processes = {processes}\n" if processes != 1 else "",
                                         delivery=_delivery_line(delivery_processes)))
        self.log_path = os.path.join(base, "relay.log")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 120, pythonpath: str | None = None) -> None:
        """``pythonpath``: a tree holding ``spool`` and ``mta`` to run instead of the installed ones (A/B tools)."""
        env = None if pythonpath is None else {**os.environ, "PYTHONPATH": os.path.abspath(pythonpath)}
        with open(self.log_path, "wb") as logf:
            self.proc = subprocess.Popen([os.path.join(VENV_BIN, "mta"), "serve", "--config", self.config],
                                         stdout=logf, stderr=subprocess.STDOUT, cwd=self.base,
                                         start_new_session=True, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.log_path, errors="replace") as f:
                # One "logspool relay ... listening on" line per relay process (the supervisor's own line
                # comes before its children have bound).
                if f.read().count("logspool relay ") >= self.processes:
                    return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        with open(self.log_path, errors="replace") as f:
            tail = f.read()[-2000:]
        raise RuntimeError(f"logspool relay did not start (rc={self.proc.poll()}):\n{tail}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


# --------------------------------------------------------------------------- measuring


def smtp_source(port: int, sessions: int, messages: int, size: int, timeout: float) -> float:
    """Run smtp-source; its wall time in seconds. Raises on failure or timeout."""
    cmd = [tool("smtp-source") or "smtp-source", "-s", str(sessions), "-m", str(messages), "-l", str(size),
           "-f", SENDER, "-t", RECIPIENT, f"127.0.0.1:{port}"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_process(proc)
        raise RuntimeError(f"smtp-source timed out after {timeout:.0f}s") from None
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"smtp-source failed ({proc.returncode}): {err.decode(errors='replace')[-500:]}")
    return wall


def measure(root: int, sink: Sink, port: int, size: int, sessions: int, messages: int,
            timeout: float) -> dict[str, Any]:
    base_count = sink.count
    user0, sys0 = tree_cpu_split(root)
    own0 = own_cpu_seconds(root)
    with MemorySampler(root) as mem:
        t0 = time.monotonic()
        accept_s = smtp_source(port, sessions, messages, size, timeout)
        done = sink.wait_for(base_count + messages, max(10.0, timeout - accept_s))
    user1, sys1 = tree_cpu_split(root)
    own = own_cpu_seconds(root) - own0
    user, system = user1 - user0, sys1 - sys0
    result: dict[str, Any] = {
        "accepted_per_s": round(messages / accept_s, 2),
        "e2e_per_s": round(messages / (done - t0), 2) if done else None,
        "cpu_ms_per_msg": round(1000 * (user + system) / messages, 3),
        "cpu_user_ms_per_msg": round(1000 * user / messages, 3),
        "cpu_sys_ms_per_msg": round(1000 * system / messages, 3),
        "cpu_root_ms_per_msg": round(1000 * own / messages, 3),  # the root process alone (its children apart)
        "peak_rss_mb": round(mem.peak_rss / 1024, 1),
        "peak_pss_mb": round(mem.peak_pss / 1024, 1),
    }
    if done is None:
        result["incomplete"] = f"sink had {sink.count - base_count}/{messages} after {timeout:.0f}s"
        # Let the queue drain so the next run starts clean (bounded).
        sink.wait_for(base_count + messages, 60)
    return result


def strace_counts(root: int, sink: Sink, port: int, size: int, sessions: int, messages: int,
                  timeout: float, workdir: str) -> dict[str, Any]:
    """fsync/rename/unlink calls per message from strace -f -c over the MTA's tree."""
    out = os.path.join(workdir, f"strace-{root}-{size}-{sessions}.txt")
    calls = ",".join(FSYNC_CALLS + RENAME_CALLS + UNLINK_CALLS)
    pids = process_tree(root)
    cmd = [tool("strace") or "strace", "-f", "-c", "-o", out, "-e", f"trace={calls}"]
    for pid in pids:
        cmd += ["-p", str(pid)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        # strace announces each attach on stderr; wait for all of them (bounded).
        assert proc.stderr is not None
        os.set_blocking(proc.stderr.fileno(), False)
        seen, deadline = b"", time.monotonic() + 30
        while time.monotonic() < deadline and seen.count(b"attached") < len(pids) and proc.poll() is None:
            with contextlib.suppress(BlockingIOError, TypeError):
                seen += proc.stderr.read() or b""
            time.sleep(0.05)
        base_count = sink.count
        smtp_source(port, sessions, messages, size, timeout)
        complete = sink.wait_for(base_count + messages, timeout) is not None
        time.sleep(0.5)  # let the last delivery's bookkeeping (Postfix: unlink) happen
    finally:
        with contextlib.suppress(OSError):
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            stop_process(proc)
    counts: dict[str, int] = {}
    with contextlib.suppress(OSError), open(out) as f:
        for line in f:
            m = re.match(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$", line)
            if m and m.group(2) != "total":
                counts[m.group(2)] = int(m.group(1))
    per = {
        "fsync_per_msg": sum(counts.get(c, 0) for c in FSYNC_CALLS) / messages,
        "rename_per_msg": sum(counts.get(c, 0) for c in RENAME_CALLS) / messages,
        "unlink_per_msg": sum(counts.get(c, 0) for c in UNLINK_CALLS) / messages,
    }
    result: dict[str, Any] = {k: round(v, 3) for k, v in per.items()}
    result["strace_messages"] = messages
    result["strace_calls"] = counts
    if not complete:
        result["incomplete"] = True
    return result


# --------------------------------------------------------------------------- report


METRICS = (  # key, label, higher is better
    ("accepted_per_s", "accepted msg/s", True),
    ("e2e_per_s", "end-to-end msg/s", True),
    ("fsync_per_msg", "fsyncs/msg", False),
    ("cpu_ms_per_msg", "CPU ms/msg", False),
    ("cpu_user_ms_per_msg", "  of it user", False),
    ("cpu_sys_ms_per_msg", "  of it system", False),
    ("peak_rss_mb", "peak RSS MB (sum)", False),
    ("peak_pss_mb", "peak PSS MB (sum)", False),
)


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def summarize(cell: dict[str, Any]) -> None:
    for mta in ("postfix", "logspool"):
        runs = cell[mta]["runs"]
        med = {key: median_of(runs, key) for key, _, _ in METRICS if key not in ("peak_rss_mb", "peak_pss_mb")}
        med["peak_rss_mb"] = max((r["peak_rss_mb"] for r in runs), default=None)
        med["peak_pss_mb"] = max((r["peak_pss_mb"] for r in runs), default=None)
        med.update({k: v for k, v in cell[mta].get("strace", {}).items() if k.endswith("_per_msg")})
        cell[mta]["median"] = med
    ratio = {}
    for key, _, _ in METRICS:
        pf, ls = cell["postfix"]["median"].get(key), cell["logspool"]["median"].get(key)
        ratio[key] = round(ls / pf, 3) if pf and ls is not None else None
    # Paired ratios (same rep, A then B) show how much of the ratio is noise.
    paired = [ls["e2e_per_s"] / pf["e2e_per_s"]
              for pf, ls in zip(cell["postfix"]["runs"], cell["logspool"]["runs"], strict=False)
              if pf.get("e2e_per_s") and ls.get("e2e_per_s")]
    ratio["e2e_paired"] = [round(x, 3) for x in paired]
    cell["ratio"] = ratio


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def table(cells: list[dict[str, Any]]) -> str:
    head = "| size | sessions | msgs | figure | Postfix | logspool | logspool/Postfix |"
    lines = [head, "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for cell in cells:
        for key, label, _ in METRICS:
            pf, ls = cell["postfix"]["median"].get(key), cell["logspool"]["median"].get(key)
            lines.append(f"| {cell['size'] // 1024} KB | {cell['sessions']} | {cell['messages']} | {label} "
                         f"| {fmt(pf)} | {fmt(ls)} | {fmt(cell['ratio'].get(key))} |")
    return "\n".join(lines)


def chart_title(doc: dict[str, Any]) -> str:
    machine = doc["machine"]
    fsyncs = f", {machine['fsync_per_s_before']} fsync/s" if machine.get("fsync_per_s_before") else ""
    return (f"logspool vs Postfix {doc['postfix_version']}, {doc['date']}, load "
            f"{machine['loadavg_start'][0]:.0f}-{machine['loadavg_end'][0]:.0f} on {machine['cores']} cores "
            f"{machine.get('cpu_model', '')}{fsyncs}")


def chart(cells: list[dict[str, Any]], path: str, title: str) -> str:
    """Accepted and end-to-end msg/s (medians) per cell, Postfix beside logspool, as an SVG file.

    Returns how it went, for the log line: drawn, or why not (matplotlib is an optional extra).
    """
    try:
        from mta.report.charts import Series, bar_chart
    except ImportError:
        return "not written: matplotlib is not installed (pip install -e '.[bench]')"
    labels = [f"{c['size'] // 1024} KB\n{c['sessions']} sess" for c in cells]
    colors = {"postfix": "#4c72b0", "logspool": "#dd8452"}
    series = []
    for mta in ("postfix", "logspool"):
        for key, kind, alpha in (("accepted_per_s", "accepted", 0.45), ("e2e_per_s", "end-to-end", 1.0)):
            series.append(Series(f"{mta} {kind}", [c[mta]["median"].get(key) or 0 for c in cells], colors[mta],
                                 alpha))
    drawn = bar_chart(title, labels, series, ylabel="messages/s (median)", values=False,
                      width_in=max(6.0, 1.6 * len(cells)), height_in=4.2, title_pt=9)
    drawn.write(path)
    return "written"


# --------------------------------------------------------------------------- profiling


def profile_logspool(ls: Logspool, sink: Sink, out_prefix: str, size: int, sessions: int, messages: int,
                     timeout: float) -> dict[str, Any]:
    """py-spy record (raw collapsed stacks + flamegraph) of the relay while smtp-source loads it."""
    py_spy = os.path.join(VENV_BIN, "py-spy")
    results: dict[str, Any] = {}
    for fmt_name, suffix in (("raw", ".collapsed"), ("flamegraph", ".svg")):
        out = out_prefix + suffix
        proc = subprocess.Popen([py_spy, "record", "--pid", str(ls.pid), "--rate", "100", "--threads",
                                 "--format", fmt_name, "-o", out], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            time.sleep(2)
            base = sink.count
            smtp_source(ls.port, sessions, messages, size, timeout)
            sink.wait_for(base + messages, timeout)
        finally:
            with contextlib.suppress(OSError):
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                stop_process(proc)
        results[fmt_name] = out
    results["top"] = top_frames(out_prefix + ".collapsed")
    return results


def top_frames(path: str, n: int = 25) -> dict[str, list[tuple[str, float]]]:
    """Self and inclusive sample percentages per function from py-spy's collapsed stacks."""
    self_t: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            stack, _, count_s = line.rstrip("\n").rpartition(" ")
            if not count_s.isdigit():
                continue
            count = int(count_s)
            frames = [re.sub(r":\d+\)$", ")", fr) for fr in stack.split(";")[1:]]  # drop thread frame, lines
            total += count
            if frames:
                self_t[frames[-1]] = self_t.get(frames[-1], 0) + count
            for fr in set(frames):
                incl[fr] = incl.get(fr, 0) + count

    def pct(d: dict[str, int]) -> list[tuple[str, float]]:
        return [(k, round(100 * v / total, 1)) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]]

    return {"self": pct(self_t), "inclusive": pct(incl), "samples": [("total", float(total))]}


# --------------------------------------------------------------------------- main


def requirements(args: argparse.Namespace) -> list[str]:
    missing = check_installed()
    for name in ("smtp-source", "smtp-sink") + (() if args.no_strace else ("strace",)):
        if not tool(name):
            missing.append(name)
    if not os.access(os.path.join(VENV_BIN, "mta"), os.X_OK):
        missing.append(".venv/bin/mta (pip install -e . in the repo's .venv)")
    if args.profile and not os.access(os.path.join(VENV_BIN, "py-spy"), os.X_OK):
        missing.append(".venv/bin/py-spy (for --profile)")
    return missing


def plan(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """(size, sessions, messages) cells. 1-session and 100 KB cells get fewer messages."""
    cells = []
    for size in args.sizes:
        for sessions in args.sessions:
            n = args.messages
            if sessions == 1:
                n = max(10, n // 4)
            if size > 16384:
                n = max(10, n // 2)
            cells.append((size, sessions, max(n, sessions)))
    return cells


@contextlib.contextmanager
def environment(args: argparse.Namespace) -> Iterator[tuple[PostfixInstance, Logspool, Sink, Sink, str]]:
    work = tempfile.mkdtemp(prefix="relaybench-", dir=args.tmpdir)
    os.chmod(work, 0o755)  # Postfix's daemons (user postfix) must reach their queue and data dirs
    cleanups: list[Callable[[], None]] = []
    try:
        sink_pf, sink_ls = Sink(free_port()), Sink(free_port())
        cleanups += [sink_pf.stop, sink_ls.stop]
        pf = PostfixInstance(os.path.join(work, "postfix"), free_port(), sink_pf.port)
        cleanups.append(pf.stop)
        log(f"starting private Postfix on 127.0.0.1:{pf.port} (dir {pf.base})")
        pf.start()
        os.makedirs(os.path.join(work, "logspool"))
        ls = Logspool(os.path.join(work, "logspool"), free_port(), sink_ls.port, max(args.sessions), args.processes,
                  args.delivery_processes)
        cleanups.append(ls.stop)
        log(f"starting logspool relay on 127.0.0.1:{ls.port}")
        ls.start()
        yield pf, ls, sink_pf, sink_ls, work
    finally:
        for fn in reversed(cleanups):
            try:
                fn()
            except Exception as exc:
                log(f"cleanup: {exc}")
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 KB at 1 and 20 sessions, 100 KB at 20; 100 msgs")
    ap.add_argument("--messages", type=int, help="messages per cell (1-session and 100 KB cells: fewer)")
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], help="message sizes in bytes")
    ap.add_argument("--sessions", type=lambda s: [int(x) for x in s.split(",")], help="concurrent sessions")
    ap.add_argument("--reps", type=int, default=2, help="A B pairs per cell (default 2)")
    ap.add_argument("--strace-messages", type=int, help="messages in each strace run (default 100, quick 40)")
    ap.add_argument("--no-strace", action="store_true", help="skip the fsync counting runs")
    ap.add_argument("--cell-timeout", type=float, default=900, help="seconds per run before giving up")
    ap.add_argument("--json", help="also write the JSON document here")
    ap.add_argument("--svg", default=os.path.join(ROOT, "docs", "bench_relay.svg"), help="chart path ('' = none)")
    ap.add_argument("--chart-from", metavar="JSON", help="only draw the chart (--svg) of a recorded run's JSON "
                    "document; needs nothing else")
    ap.add_argument("--profile", metavar="PREFIX", help="after the runs, py-spy the relay under load: "
                    "PREFIX.collapsed, PREFIX.svg")
    ap.add_argument("--profile-messages", type=int, default=1000)
    ap.add_argument("--idle-seconds", type=float, default=10, help="idle CPU measurement before the cells")
    ap.add_argument("--profile-sessions", type=int, default=20)
    ap.add_argument("--profile-size", type=int, default=4096)
    ap.add_argument("--profile-only", action="store_true", help="skip the cells (with --profile)")
    ap.add_argument("--tmpdir", default=None, help="where temp dirs go (default $TMPDIR or /tmp; not tmpfs!)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, maillog)")
    ap.add_argument("--probe-seconds", type=float, default=2.0,
                    help="length of the 4 KiB append+fdatasync probe before and after the runs (0: none)")
    ap.add_argument("--delivery-processes", type=lambda v: v if v == "auto" else int(v), default=None,
                    help="logspool's [delivery] processes (delivery worker processes: a number or auto; default: "
                         "not set, logspool's default)")
    ap.add_argument("--processes", type=int, default=1,
                    help="logspool relay processes ([server] processes; Postfix runs as many as it likes)")
    args = ap.parse_args(argv)
    if args.chart_from:
        return redraw(args.chart_from, args.svg)
    if args.quick:
        args.messages = args.messages or 100
        args.sizes = args.sizes or [4096]
        args.sessions = args.sessions or [1, 20]
        args.strace_messages = args.strace_messages or 40
    args.messages = args.messages or 2000
    args.sizes = args.sizes or [4096, 102400]
    args.sessions = args.sessions or [1, 20, 100]
    args.strace_messages = args.strace_messages or 100
    cells_plan = plan(args)
    if args.profile_only:
        cells_plan = []
    if args.quick and 102400 not in args.sizes and not args.profile_only:
        cells_plan.append((102400, 20, max(10, args.messages // 2)))

    missing = requirements(args)
    if missing:
        print("relay_vs_postfix: cannot run, missing: " + "; ".join(missing), file=sys.stderr)
        print("  (Debian: apt-get install postfix strace; this script installs nothing)", file=sys.stderr)
        return 2
    print("needs: root, postfix/postconf/smtp-source/smtp-sink (Postfix "
          f"{_postfix_version()}), strace, .venv/bin/mta; cells (size, sessions, msgs): {cells_plan}; "
          f"reps {args.reps} (A=Postfix, B=logspool)", file=sys.stderr)

    signal.signal(signal.SIGTERM, _interrupt)
    # What the figures belong to: the CPU (lscpu) and the disk's fsync rate, probed before and after the runs
    # on the disk the MTAs' queues are on.
    probe_dir = args.tmpdir or tempfile.gettempdir()
    described = describe_machine(args.probe_seconds, probe_dir) if args.probe_seconds > 0 else {}
    log(f"machine: {described}")
    snap0 = machine_snapshot()
    cells: list[dict[str, Any]] = []
    idle_cpu: dict[str, float] = {}
    profile: dict[str, Any] | None = None
    try:
        with environment(args) as (pf, ls, sink_pf, sink_ls, work):
            assert pf.master_pid is not None
            mtas = {"postfix": (pf.master_pid, sink_pf, pf.port), "logspool": (ls.pid, sink_ls, ls.port)}
            # Warm-up: a few messages through each so first-connection costs don't land in cell 1.
            for name, (_root, sink, port) in mtas.items():
                base = sink.count
                smtp_source(port, 2, 10, 4096, args.cell_timeout)
                if sink.wait_for(base + 10, args.cell_timeout) is None:
                    raise RuntimeError(f"{name}: warm-up messages never reached the sink")
            # Idle cost: CPU each MTA's tree uses with no mail moving (timers, polling, checkpoints).
            time.sleep(3)
            cpu0 = {name: tree_cpu_seconds(root) for name, (root, _s, _p) in mtas.items()}
            time.sleep(args.idle_seconds)
            idle_cpu = {name: round(100 * (tree_cpu_seconds(root) - cpu0[name]) / args.idle_seconds, 1)
                        for name, (root, _s, _p) in mtas.items()}
            log(f"idle CPU, % of one core: {idle_cpu}")
            for size, sessions, messages in cells_plan:
                cell: dict[str, Any] = {"size": size, "sessions": sessions, "messages": messages,
                                        "postfix": {"runs": []}, "logspool": {"runs": []}}
                for rep in range(args.reps):
                    for name, (root, sink, port) in mtas.items():
                        log(f"{size // 1024} KB x {sessions} sessions, {messages} msgs, rep {rep + 1}: {name}")
                        r = measure(root, sink, port, size, sessions, messages, args.cell_timeout)
                        r["loadavg"] = round(os.getloadavg()[0], 1)
                        log(f"  accepted {r['accepted_per_s']}/s, end-to-end {r['e2e_per_s']}/s, "
                            f"cpu {r['cpu_ms_per_msg']} ms/msg (user {r['cpu_user_ms_per_msg']}, system "
                            f"{r['cpu_sys_ms_per_msg']}), rss {r['peak_rss_mb']} MB")
                        cell[name]["runs"].append(r)
                if not args.no_strace:
                    n = max(args.strace_messages, sessions)
                    for name, (root, sink, port) in mtas.items():
                        log(f"{size // 1024} KB x {sessions} sessions: strace run, {n} msgs, {name}")
                        cell[name]["strace"] = strace_counts(root, sink, port, size, sessions, n,
                                                             args.cell_timeout, work)
                        log(f"  {cell[name]['strace']['strace_calls']}")
                summarize(cell)
                cells.append(cell)
            if args.profile:
                log(f"profiling logspool with py-spy: {args.profile_size} bytes x {args.profile_sessions} "
                    f"sessions, {args.profile_messages} msgs")
                profile = profile_logspool(ls, sink_ls, args.profile, args.profile_size, args.profile_sessions,
                                           args.profile_messages, args.cell_timeout)
                print(json.dumps(profile["top"], indent=1), file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted; processes stopped and temp dirs removed", file=sys.stderr)
        return 130
    except (PostfixError, RuntimeError, OSError) as exc:
        print(f"relay_vs_postfix: {exc}", file=sys.stderr)
        return 1

    machine = machine_summary(snap0, machine_snapshot())
    machine["cpu_model"] = described.get("cpu_model") or common_cpu_model()
    if args.probe_seconds > 0:
        after = fsync_probe(args.probe_seconds, probe_dir)
        machine["fsync_per_s_before"] = described["fsync_per_s"]
        machine["fsync_per_s_after"] = after["fsync_per_s"]
        machine["fsync_median_ms_before"] = described["fsync_median_ms"]
        machine["fsync_median_ms_after"] = after["fsync_median_ms"]
    doc: dict[str, Any] = {
        "benchmark": "relay_vs_postfix",
        "date": datetime.date.today().isoformat(),
        "postfix_version": _postfix_version(),
        "logspool_processes": args.processes,
        "machine": machine,
        "params": {"reps": args.reps, "strace_messages": args.strace_messages, "smtp_source": "no -d: "
                   "one connection per message", "sender": SENDER, "recipient": RECIPIENT},
        "idle_cpu_pct_of_core": idle_cpu,
        "cells": cells,
    }
    key = next((c for c in cells if c["size"] == 4096 and c["sessions"] == 20), None)
    doc["e2e_ratio_20s_4k"] = key["ratio"]["e2e_per_s"] if key else None
    if profile:
        doc["profile"] = profile
    if args.svg and cells:
        print(f"chart {chart(cells, args.svg, chart_title(doc))}: {args.svg}", file=sys.stderr)
    if not cells:
        return 0
    text = json.dumps(doc, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(table(cells))
    print()
    print(f"machine: {json.dumps(machine)}")
    print(text)
    ratio = doc["e2e_ratio_20s_4k"]
    print(f"end-to-end ratio logspool/Postfix at 20 sessions, 4 KB: {ratio if ratio is not None else 'n/a'}")
    return 0


def redraw(json_path: str, svg_path: str) -> int:
    """The chart of a recorded run, from its JSON document (``--json``), without running anything."""
    try:
        with open(json_path, encoding="utf-8") as f:
            doc = json.load(f)
        cells, title = doc["cells"], chart_title(doc)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        print(f"relay_vs_postfix: --chart-from {json_path}: not a recorded run ({exc})", file=sys.stderr)
        return 2
    if not svg_path or not cells:
        print("relay_vs_postfix: --chart-from needs --svg PATH and a run with cells", file=sys.stderr)
        return 2
    how = chart(cells, svg_path, title)
    print(f"chart {how}: {svg_path}", file=sys.stderr)
    return 0 if how == "written" else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _postfix_version() -> str:
    try:
        out = subprocess.run([tool("postconf") or "postconf", "-d", "-h", "mail_version"], capture_output=True,
                             text=True, timeout=30, check=False).stdout.strip()
        return out or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


if __name__ == "__main__":
    sys.exit(main())
