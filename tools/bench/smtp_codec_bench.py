"""CPU cost of the SMTP cores' hot paths, without sockets or the spool.

    .venv/bin/python tools/bench/smtp_codec_bench.py [--runs N] [--json OUT] [--compare BEFORE.json]

What is timed (CPU time of this process, ``time.process_time``, per message):

- ``decode``: the server core (``ServerConnection``) in DATA state fed one
  message on the wire (dot-stuffed, CRLF, ending in CRLF.CRLF) in reads of
  1 KiB or 64 KiB, until ``EndOfData``: the content decoder, the chunk events
  and the buffer handling, as in a session.
- ``encode``: the client's ``BodyEncoder`` turning the same content, handed
  over in 1 KiB or 64 KiB chunks, into the wire form.
- ``session``: the server core handling a pipelined session of 10 messages
  of 4 KiB (EHLO once; per message MAIL, RCPT, DATA in one read, the content
  and the dot in the next; QUIT), with every decision accepted.

Messages are 4 KiB and 100 KiB of 72-column text under a few header lines;
one line in 40 starts with a dot, so dot-stuffing is exercised. Each figure
is the median of ``--runs`` runs; every run does enough messages to take
about 0.2 s. ``--json`` saves the medians, ``--compare`` prints the ratio
before/after against such a file. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import common
from common import median, say, table

from mta.smtp_client import BodyEncoder
from mta.smtp_server import ConnectionClosed, DataChunk, EndOfData, MailFrom, NeedData, RcptTo, ServerConnection

KIB = 1024


def content(size: int) -> bytes:
    """Header lines, then 72-column text lines, one in 40 starting with a dot; about ``size`` bytes."""
    head = b"From: a@x.example\r\nTo: b@y.example\r\nSubject: benchmark\r\nMessage-ID: <1@x.example>\r\n\r\n"
    lines = [head]
    n = len(head)
    i = 0
    while n < size:
        line = (b"." if i % 40 == 7 else b"") + (b"%06d " % i) + b"lorem ipsum dolor sit amet " * 2
        line = line[:72] + b"\r\n"
        lines.append(line)
        n += len(line)
        i += 1
    return b"".join(lines)


def wire(body: bytes) -> bytes:
    return (b"." if body.startswith(b".") else b"") + body.replace(b"\r\n.", b"\r\n..") + b".\r\n"


def chunked(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def in_data(conn: ServerConnection) -> ServerConnection:
    conn.receive_data(b"EHLO c.example\r\nMAIL FROM:<a@x.example>\r\nRCPT TO:<b@y.example>\r\nDATA\r\n")
    while not isinstance(ev := conn.next_event(), NeedData):
        if isinstance(ev, MailFrom | RcptTo):
            conn.accept()
    conn.data_to_send()
    return conn


def decode_run(pieces: list[bytes], count: int) -> float:
    conns = [in_data(ServerConnection("mx.example")) for _ in range(count)]
    start = time.process_time()
    for conn in conns:
        got = 0
        for piece in pieces:
            conn.receive_data(piece)
            while not isinstance(ev := conn.next_event(), NeedData):
                if isinstance(ev, DataChunk):
                    got += len(ev.data)
                elif isinstance(ev, EndOfData):
                    conn.accept()
        assert got > 0
    return (time.process_time() - start) / count


def encode_run(pieces: list[bytes], count: int) -> float:
    start = time.process_time()
    for _ in range(count):
        enc = BodyEncoder()
        for piece in pieces:
            enc.encode(piece)
        enc.end()
    return (time.process_time() - start) / count


def session_script(messages: int, body: bytes) -> list[bytes]:
    reads = [b"EHLO c.example\r\n"]
    for _ in range(messages):
        reads.append(b"MAIL FROM:<a@x.example> SIZE=4096\r\nRCPT TO:<b@y.example>\r\nDATA\r\n")
        reads.append(wire(body))
    reads.append(b"QUIT\r\n")
    return reads


def session_run(reads: list[bytes], count: int) -> float:
    messages = len(reads) // 2 - 1
    start = time.process_time()
    for _ in range(count):
        conn = ServerConnection("mx.example")
        for piece in reads:
            conn.receive_data(piece)
            while not isinstance(ev := conn.next_event(), NeedData | ConnectionClosed):
                if isinstance(ev, MailFrom | RcptTo | EndOfData):
                    conn.accept()
            conn.data_to_send()
        assert isinstance(ev, ConnectionClosed)
    return (time.process_time() - start) / count / messages


def calibrate(fn: Callable[[int], float], target: float = 0.2) -> int:
    per = fn(3)
    return max(3, int(target / max(per, 1e-7)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json", help="save the medians to this file")
    ap.add_argument("--compare", help="a file saved with --json: print before/after ratios against it")
    args = ap.parse_args()
    common.exit_on_sigterm()

    cases: dict[str, Callable[[int], float]] = {}
    for size_name, size in (("4k", 4 * KIB), ("100k", 100 * KIB)):
        body = content(size)
        for read_name, read in (("1k", KIB), ("64k", 64 * KIB)):
            dec = chunked(wire(body), read)
            enc = chunked(body, read)
            cases[f"decode {size_name} in {read_name} reads"] = lambda n, p=dec: decode_run(p, n)
            cases[f"encode {size_name} in {read_name} chunks"] = lambda n, p=enc: encode_run(p, n)
    reads = session_script(10, content(4 * KIB))
    cases["session, 10 x 4k pipelined, per message"] = lambda n: session_run(reads, n)

    counts = {name: calibrate(fn) for name, fn in cases.items()}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.runs):  # interleaved, so a burst of load elsewhere hits every case alike
        for name, fn in cases.items():
            samples[name].append(fn(counts[name]))
    medians = {name: median(v) * 1e6 for name, v in samples.items()}

    before: dict[str, float] = {}
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)["medians_us"]
    rows: list[list[Any]] = []
    for name, us in medians.items():
        row: list[Any] = [name, f"{us:.1f}"]
        if before:
            old = before.get(name)
            row += [f"{old:.1f}" if old else "-", f"{old / us:.2f}x" if old else "-"]
        rows.append(row)
    headers = ["case", "CPU us/message (median)"] + (["before", "speed-up"] if before else [])
    say(f"machine: {common.machine()}; runs: {args.runs}")
    say(table(headers, rows))
    result = {"medians_us": medians, "runs": args.runs, "counts": counts}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    common.emit_json(result)


if __name__ == "__main__":
    main()
