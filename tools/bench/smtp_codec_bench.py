"""CPU cost of the SMTP cores' hot paths, without sockets or the spool.

    .venv/bin/python tools/bench/smtp_codec_bench.py [--runs N] [--baseline DIR] [--json OUT]

    git archive COMMIT mta spool | tar -x -C /tmp/base   # a baseline to compare with

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
- ``client session``: the client core (``ClientConnection``) sending the same
  10 messages: per message ``mail``, ``rcpt``, ``data`` in one write, the
  replies to them in one read, the content in one ``send_body``, ``end_data``
  and its reply; every reply canned.

Messages are 4 KiB and 100 KiB of 72-column text under a few header lines;
one line in 40 starts with a dot, so dot-stuffing is exercised. Each figure
is the median of ``--runs`` runs; every run does enough messages to take
about 0.2 s. ``--baseline DIR`` loads a second copy of ``mta`` from DIR (an
older checkout) and times it in the same runs, interleaved case by case, so
that load from elsewhere on a shared machine hits both alike; the table then
gives the ratio baseline/current. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any

import common
from common import median, say, table

import mta.smtp.client
import mta.smtp.server

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


def load_baseline(root: str) -> tuple[ModuleType, ModuleType]:
    """``mta.smtp.server`` and ``mta.smtp.client`` as found under ``root``, beside the current ones."""
    ours = {k: v for k, v in sys.modules.items() if k == "mta" or k.startswith("mta.")}
    for k in ours:
        del sys.modules[k]
    sys.path.insert(0, root)
    try:
        import mta.smtp.client as client
        import mta.smtp.server as server
    finally:
        sys.path.remove(root)
        for k in [k for k in sys.modules if k == "mta" or k.startswith("mta.")]:
            del sys.modules[k]
        sys.modules.update(ours)
    if server.__file__ == mta.smtp.server.__file__:
        raise SystemExit(f"--baseline {root}: no mta package there")
    return server, client


def in_data(S: ModuleType) -> Any:
    conn = S.ServerConnection("mx.example")
    conn.receive_data(b"EHLO c.example\r\nMAIL FROM:<a@x.example>\r\nRCPT TO:<b@y.example>\r\nDATA\r\n")
    while not isinstance(ev := conn.next_event(), S.NeedData):
        if isinstance(ev, S.MailFrom | S.RcptTo):
            conn.accept()
    conn.data_to_send()
    return conn


def decode_run(S: ModuleType, pieces: list[bytes], count: int) -> float:
    conns = [in_data(S) for _ in range(count)]
    start = time.process_time()
    for conn in conns:
        got = 0
        for piece in pieces:
            conn.receive_data(piece)
            while not isinstance(ev := conn.next_event(), S.NeedData):
                if isinstance(ev, S.DataChunk):
                    got += len(ev.data)
                elif isinstance(ev, S.EndOfData):
                    conn.accept()
        assert got > 0
    return (time.process_time() - start) / count


def encode_run(C: ModuleType, pieces: list[bytes], count: int) -> float:
    start = time.process_time()
    for _ in range(count):
        enc = C.BodyEncoder()
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


def session_run(S: ModuleType, reads: list[bytes], count: int) -> float:
    messages = len(reads) // 2 - 1
    start = time.process_time()
    for _ in range(count):
        conn = S.ServerConnection("mx.example")
        for piece in reads:
            conn.receive_data(piece)
            while not isinstance(ev := conn.next_event(), S.NeedData | S.ConnectionClosed):
                if isinstance(ev, S.MailFrom | S.RcptTo | S.EndOfData):
                    conn.accept()
            conn.data_to_send()
        assert isinstance(ev, S.ConnectionClosed)
    return (time.process_time() - start) / count / messages


EHLO_REPLY = b"250-mx.example\r\n250-PIPELINING\r\n250-SIZE 10240000\r\n250 8BITMIME\r\n"


def _drain(C: ModuleType, conn: Any) -> Any:
    ev = None
    while not isinstance(nxt := conn.next_event(), C.NeedData):
        ev = nxt
    return ev


def client_session_run(C: ModuleType, bodies: list[bytes], count: int) -> float:
    start = time.process_time()
    for _ in range(count):
        conn = C.ClientConnection()
        conn.receive_data(b"220 mx.example ESMTP\r\n")
        _drain(C, conn)
        conn.ehlo("c.example")
        conn.data_to_send()
        conn.receive_data(EHLO_REPLY)
        _drain(C, conn)
        for body in bodies:
            conn.mail("a@x.example", {"SIZE": str(len(body))})
            conn.rcpt("b@y.example")
            conn.data()
            conn.data_to_send()
            conn.receive_data(b"250 2.1.0 Ok\r\n250 2.1.5 Ok\r\n354 End data with <CR><LF>.<CR><LF>\r\n")
            _drain(C, conn)
            conn.send_body(body)
            conn.end_data()
            conn.data_to_send()
            conn.receive_data(b"250 2.0.0 Ok: queued\r\n")
            assert isinstance(_drain(C, conn), C.MessageReply)
    return (time.process_time() - start) / count / len(bodies)


def calibrate(fn: Callable[[int], float], target: float = 0.2) -> int:
    per = min(fn(5) for _ in range(3))
    return max(10, int(target / max(per, 1e-7)))


Case = Callable[[ModuleType, ModuleType, int], float]


def make_cases() -> dict[str, Case]:
    cases: dict[str, Case] = {}
    for size_name, size in (("4k", 4 * KIB), ("100k", 100 * KIB)):
        body = content(size)
        for read_name, read in (("1k", KIB), ("64k", 64 * KIB)):
            dec = chunked(wire(body), read)
            enc = chunked(body, read)
            cases[f"decode {size_name} in {read_name} reads"] = partial(_on_server, decode_run, dec)
            cases[f"encode {size_name} in {read_name} chunks"] = partial(_on_client, encode_run, enc)
    reads = session_script(10, content(4 * KIB))
    cases["session, 10 x 4k pipelined, per message"] = partial(_on_server, session_run, reads)
    cases["client session, 10 x 4k pipelined, per message"] = partial(
        _on_client, client_session_run, [content(4 * KIB)] * 10)
    return cases


def _on_server(fn: Callable[[ModuleType, list[bytes], int], float], data: list[bytes],
               S: ModuleType, C: ModuleType, n: int) -> float:
    return fn(S, data, n)


def _on_client(fn: Callable[[ModuleType, list[bytes], int], float], data: list[bytes],
               S: ModuleType, C: ModuleType, n: int) -> float:
    return fn(C, data, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--baseline", help="a directory holding an older mta package to time alongside")
    ap.add_argument("--json", help="also save the result to this file")
    args = ap.parse_args()
    common.exit_on_sigterm()

    variants = {"current": (mta.smtp.server, mta.smtp.client)}
    if args.baseline:
        variants["baseline"] = load_baseline(args.baseline)
    cases = make_cases()
    counts = {v: {name: calibrate(partial(fn, *mods)) for name, fn in cases.items()} for v, mods in variants.items()}
    samples: dict[str, dict[str, list[float]]] = {v: {name: [] for name in cases} for v in variants}
    for _ in range(args.runs):  # interleaved, so a burst of load elsewhere hits every case and variant alike
        for name, fn in cases.items():
            for v, mods in variants.items():
                samples[v][name].append(fn(*mods, counts[v][name]))
    medians = {v: {name: median(x) * 1e6 for name, x in per.items()} for v, per in samples.items()}

    rows: list[list[Any]] = []
    for name, us in medians["current"].items():
        row: list[Any] = [name, f"{us:.1f}"]
        if "baseline" in medians:
            old = medians["baseline"][name]
            row += [f"{old:.1f}", f"{old / us:.2f}x"]
        rows.append(row)
    headers = ["case", "current CPU us/msg"] + (["baseline CPU us/msg", "baseline/current"] if args.baseline else [])
    say(f"machine: {common.machine()}; runs: {args.runs}; baseline: {args.baseline}")
    say(table(headers, rows))
    result = {"medians_us": medians, "runs": args.runs, "counts": counts, "baseline": args.baseline}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    common.emit_json(result)


if __name__ == "__main__":
    main()
