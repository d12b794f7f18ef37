"""Which fsync-family calls a relay makes under smtp-source, one by one: what each one covered, in which thread.

    .venv/bin/python tools/bench/fsync_breakdown.py --sessions 20 --messages 1000
    .venv/bin/python tools/bench/fsync_breakdown.py --tree /tmp/base --sessions 20 --messages 1000 --json out.json
    .venv/bin/python tools/bench/fsync_breakdown.py --messages 20 --gap 0.5     # a trickle: one message each 0.5 s

Starts a logspool relay (relay_vs_postfix.py's config, smtp-sink as next hop; ``--tree DIR``: the ``spool``
and ``mta`` packages of DIR, as relay_ab.py's variants), warms it up with ``--warmup`` messages (the timed
runs of relay_vs_postfix.py come before its strace run too), then attaches

    strace -f -tt -y -s 0 -e trace=fsync,fdatasync,sync_file_range,syncfs,pwrite64,pwritev,pwritev2,
        rename,renameat,renameat2 -p PID

for one smtp-source run (without -d: one connection per message) and a quiet second after its last message
reached the sink. Each sync call is then classified from what it covered: the bytes each thread wrote to that
file since the file's previous sync (pwrite offsets, matched against the records read back from the segment
files), so a segment's fdatasync is "enqueue" when it covered a new message's envelope, "deliveries" when it
covered DELIVERY records and no new envelope, "finish/claims only" when it covered only records nobody waits for
(START, FINISH, replacement envelopes), "marks only" when nothing but one-byte garbage marks; and the
directory and checkpoint syncs by their paths. Also: how many new envelopes each enqueue commit covered, the
first commits (ramp-up) and the syncs after the last new envelope was made durable (the tail).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shutil
import signal
import smtplib
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from relay_vs_postfix import RECIPIENT, ROOT, SENDER, Logspool, Sink, free_port, smtp_source, tool

SYNCS = ("fsync", "fdatasync", "sync_file_range", "syncfs")
WRITES = ("pwrite64", "pwritev", "pwritev2")
LINE = re.compile(r"^(\d+)\s+(\d\d:\d\d:\d\d\.\d+)\s+(\w+)\((\d+)<([^>]*)>(.*)$")
RESUMED = re.compile(r"^(\d+)\s+(\d\d:\d\d:\d\d\.\d+)\s+<\.\.\. (\w+) resumed>(.*)$")


def parse(path: str) -> list[dict[str, Any]]:
    """strace -f -tt -y lines into calls: tid, time, name, fd path, (offset, length) for writes."""
    calls: list[dict[str, Any]] = []
    pending: dict[tuple[int, str], dict[str, Any]] = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.match(line)
            if m:
                tid, ts, name, _fd, fdpath, rest = m.groups()
                call: dict[str, Any] = {"tid": int(tid), "t": ts, "name": name, "path": fdpath}
                if name in WRITES:
                    args = rest.replace("<unfinished ...>", ")").split(",")  # a call another thread's line cut
                    with contextlib.suppress(ValueError, IndexError):
                        call["len"] = int(args[-2].strip().rstrip(")").split()[0]) if name == "pwrite64" else 0
                        call["off"] = int(args[-1].split(")")[0].strip())
                if "<unfinished ...>" in rest:
                    pending[(int(tid), name)] = call
                calls.append(call)
                continue
            m = RESUMED.match(line)
            if m:
                pending.pop((int(m.group(1)), m.group(3)), None)
    return calls


def records(log_dir: str) -> dict[str, list[tuple[int, int, str]]]:
    """Per segment file: (offset, end, kind) of every record, kind from its type (envelopes by class)."""
    sys.path.insert(0, ROOT)
    from spool.fileio import OsFileIO
    from spool.format.record import Frame, RecordType, pos_offset, pos_segment
    from spool.format.segment import segment_path
    from spool.read.reader import LogReader

    out: dict[str, list[tuple[int, int, str]]] = collections.defaultdict(list)
    reader = LogReader(OsFileIO(), log_dir)
    for item in reader.read():
        if not isinstance(item, Frame):
            continue
        kind = RecordType(item.rtype).name
        if item.rtype == RecordType.ENVELOPE:
            kind = "ENVELOPE_NEW" if item.klass == 0 else "ENVELOPE_RETRY"
        off = pos_offset(item.pos)
        out[segment_path(log_dir, pos_segment(item.pos))].append((off, off + item.size, kind))
    return out


def classify(calls: list[dict[str, Any]], recs: dict[str, list[tuple[int, int, str]]],
             spool_dir: str) -> list[dict[str, Any]]:
    """One entry per sync call: its kind, thread, time and what it covered."""
    written: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)  # since the file's last sync
    # A write that does not end where a record ends is zeros written ahead of the log (spool.write.room, make_room):
    # it covers offsets records are written into later, so it must not count them.
    ends = {path: {end for _off, end, _kind in rs} for path, rs in recs.items()}
    syncs: list[dict[str, Any]] = []
    for c in calls:
        path = c["path"]
        if c["name"] in WRITES:
            if c.get("len", 0) > 1 and "off" in c:
                end = c["off"] + c["len"]
                room = path.endswith(".seg") and end not in ends.get(path, ())
                written[path + "#room" if room else path].append((c["off"], end))
            elif c.get("len") == 1:
                written[path + "#marks"].append((c.get("off", 0), c.get("off", 0) + 1))
            continue
        if c["name"] not in SYNCS:
            continue
        entry = {"tid": c["tid"], "t": c["t"], "call": c["name"], "path": path}
        if path.endswith(".seg"):
            ranges = written.pop(path, [])
            marks = len(written.pop(path + "#marks", []))
            room = len(written.pop(path + "#room", []))
            kinds = collections.Counter(k for off, end, k in recs.get(path, [])
                                        if any(lo <= off < hi for lo, hi in ranges))
            entry["covered"] = dict(kinds)
            entry["marks"] = marks
            entry["room_writes"] = room
            if kinds["ENVELOPE_NEW"]:
                entry["kind"] = "segment: enqueue commit"
            elif kinds["DELIVERY"]:
                entry["kind"] = "segment: deliveries, no new message"
            elif room:
                entry["kind"] = "segment: zeroed room made ahead (spool.write.room)"
            elif kinds:
                entry["kind"] = "segment: claims/finish/replacements only"
            elif marks:
                entry["kind"] = "segment: garbage marks only"
            else:
                entry["kind"] = "segment: nothing written since the last sync"
        elif path.rstrip("/").endswith("/log"):
            entry["kind"] = "directory: log/ (segment created or deleted)"
        elif path.rstrip("/") == spool_dir.rstrip("/"):
            entry["kind"] = "directory: spool/ (checkpoint rename)"
        elif "checkpoint" in os.path.basename(path):
            entry["kind"] = "checkpoint file"
        else:
            entry["kind"] = f"other: {path}"
        syncs.append(entry)
    return syncs


def summarise(syncs: list[dict[str, Any]], messages: int) -> dict[str, Any]:
    kinds = collections.Counter(s["kind"] for s in syncs)
    enq = [s["covered"].get("ENVELOPE_NEW", 0) for s in syncs if s["kind"] == "segment: enqueue commit"]
    last_enq = max((i for i, s in enumerate(syncs) if s["kind"] == "segment: enqueue commit"), default=-1)
    tail = collections.Counter(s["kind"] for s in syncs[last_enq + 1:])
    threads = collections.Counter(s["tid"] for s in syncs)
    return {
        "messages": messages, "syncs": len(syncs), "per_msg": round(len(syncs) / messages, 4),
        "by_kind": dict(kinds.most_common()), "tail_after_last_enqueue": dict(tail),
        "threads": {str(k): v for k, v in threads.items()},
        "envelopes_per_enqueue_commit": enq,
        "first_commits": [{k: s[k] for k in ("t", "kind", "covered") if k in s} for s in syncs[:6]],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--messages", type=int, default=1000)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=300, help="messages sent before the traced run")
    ap.add_argument("--tree", help="DIR holding spool/ and mta/ to run (default: this checkout)")
    ap.add_argument("--gap", type=float, default=0.0,
                    help="instead of smtp-source: one message at a time (smtplib), this many seconds apart")
    ap.add_argument("--json", help="write the classified calls and the summary here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (the strace output) and print it")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="fsync-breakdown-")
    os.chmod(work, 0o755)
    sink = Sink(free_port())
    relay = Logspool(work, free_port(), sink.port, args.sessions)
    strace = None
    try:
        relay.start(pythonpath=args.tree or None)
        count = sink.count
        smtp_source(relay.port, args.sessions, args.warmup, args.size, 600)
        sink.wait_for(count + args.warmup, 600)
        # The warm-up's lazy commits and its quiet checkpoint (up to two checkpoint intervals, 2 s each, after
        # its last record) happen before the trace: the trace counts this run's own calls.
        time.sleep(5)
        out = os.path.join(work, "strace.txt")
        calls = ",".join(SYNCS + WRITES + ("rename", "renameat", "renameat2"))
        strace = subprocess.Popen([tool("strace") or "strace", "-f", "-tt", "-y", "-s", "0", "-o", out,
                                   "-e", f"trace={calls}", "-p", str(relay.pid)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        assert strace.stderr is not None
        os.set_blocking(strace.stderr.fileno(), False)
        seen, deadline = b"", time.monotonic() + 30
        while time.monotonic() < deadline and b"attached" not in seen and strace.poll() is None:
            with contextlib.suppress(BlockingIOError, TypeError):
                seen += strace.stderr.read() or b""
            time.sleep(0.05)
        time.sleep(0.3)  # every thread attached
        count = sink.count
        if args.gap:
            lines = ("x" * 76 + "\r\n") * max(1, args.size // 78)
            body = f"From: <{SENDER}>\r\nTo: <{RECIPIENT}>\r\nSubject: gap\r\n\r\n" + lines
            for _ in range(args.messages):
                with smtplib.SMTP("127.0.0.1", relay.port, timeout=60) as smtp:
                    smtp.sendmail(SENDER, [RECIPIENT], body)
                time.sleep(args.gap)
        else:
            smtp_source(relay.port, args.sessions, args.messages, args.size, 900)
        sink.wait_for(count + args.messages, 900)
        time.sleep(0.5)  # as relay_vs_postfix.py's strace run: the last delivery's bookkeeping
        strace.send_signal(signal.SIGINT)
        strace.wait(30)
        recs = records(os.path.join(work, "spool", "log"))
        syncs = classify(parse(out), recs, os.path.join(work, "spool"))
        summary = summarise(syncs, args.messages)
        print(json.dumps(summary, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "summary": summary, "syncs": syncs}, f, indent=1)
        if args.keep:
            print(f"work dir kept: {work}", file=sys.stderr)
    finally:
        if strace is not None and strace.poll() is None:
            strace.kill()
        relay.stop()
        sink.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
