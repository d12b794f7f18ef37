"""CPU per message of the SMTP client core sending a stored body with BDAT (RFC 3030) against DATA, both ways.

    .venv/bin/python tools/bench/bdat_bench.py [--runs N] [--json OUT]

What is timed (CPU time of this process, ``time.process_time``, per message):
the client core (``ClientConnection``) sending one message on a connection
already past EHLO, as ``mta.delivery.smtp_transport`` does: ``mail``,
``rcpt``, then either ``data`` (its ``354`` read back) or ``bdat``, the body
in the 64 KiB pieces the spool hands out (``send_body``), ``end_data``, and
every reply read back and matched. DATA dot-stuffs and adds the terminator;
BDAT sends the body as it is in ``BDAT n`` chunks. Also timed, for the other
side: the server core (``ServerConnection``) receiving the same message as
DATA (dot-stuffed on the wire) and as BDAT chunks, in 64 KiB reads.

Messages of 4 KiB, 100 KiB and 1 MiB of 72-column text (one line in 40
starts with a dot: ``smtp_codec_bench.content``). Each figure is the
median of ``--runs`` runs, DATA and BDAT alternated case by case in every
run, so that load from elsewhere on a shared machine hits both alike; the
table gives the ratio DATA/BDAT. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial

import common
from common import median, say, table
from smtp_codec_bench import KIB, calibrate, chunked, content, wire

from mta.smtp import client as C
from mta.smtp import server as S

EHLO_REPLY = b"250-mx.example\r\n250-PIPELINING\r\n250-SIZE 0\r\n250-8BITMIME\r\n250 CHUNKING\r\n"
PIECE = 64 * KIB


def ready_client() -> C.ClientConnection:
    conn = C.ClientConnection()
    conn.receive_data(b"220 mx.example ESMTP\r\n")
    while not isinstance(conn.next_event(), C.NeedData):
        pass
    conn.ehlo("c.example")
    conn.data_to_send()
    conn.receive_data(EHLO_REPLY)
    while not isinstance(conn.next_event(), C.NeedData):
        pass
    return conn


def _final(conn: C.ClientConnection) -> C.Event | None:
    last = None
    while not isinstance(ev := conn.next_event(), C.NeedData):
        last = ev
    return last


def chunks_sent(pieces: list[bytes]) -> int:
    """How many BDAT commands the client core makes of ``pieces`` (a dry run, outside the timing)."""
    conn = ready_client()
    conn.mail("a@x.example")
    conn.rcpt("b@y.example")
    conn.bdat()
    out = bytearray()
    for piece in pieces:
        conn.send_body(piece)
        out += conn.data_to_send()
    conn.end_data()
    out += conn.data_to_send()
    return out.count(b"BDAT ")


def client_run(bdat: bool, pieces: list[bytes], count: int) -> float:
    conns = [ready_client() for _ in range(count)]
    chunks = chunks_sent(pieces) if bdat else 1
    size = str(sum(map(len, pieces)))
    start = time.process_time()
    for conn in conns:
        conn.mail("a@x.example", {"SIZE": size})
        conn.rcpt("b@y.example")
        if bdat:
            conn.bdat()
            replies = b"250 2.1.0 Ok\r\n250 2.1.5 Ok\r\n"
        else:
            conn.data()
            conn.data_to_send()
            conn.receive_data(b"250 2.1.0 Ok\r\n250 2.1.5 Ok\r\n354 End data with <CR><LF>.<CR><LF>\r\n")
            _final(conn)
            replies = b""
        for piece in pieces:
            conn.send_body(piece)
            if conn.buffered >= PIECE:
                conn.data_to_send()
        conn.end_data()
        conn.data_to_send()
        conn.receive_data(replies + b"250 2.0.0 Ok\r\n" * (chunks - 1) + b"250 2.0.0 Ok: queued\r\n")
        assert isinstance(_final(conn), C.MessageReply)
    return (time.process_time() - start) / count


def in_transaction() -> S.ServerConnection:
    conn = S.ServerConnection("mx.example", max_message_size=64 << 20)
    conn.receive_data(b"EHLO c.example\r\nMAIL FROM:<a@x.example>\r\nRCPT TO:<b@y.example>\r\n")
    while not isinstance(ev := conn.next_event(), S.NeedData):
        if isinstance(ev, S.MailFrom | S.RcptTo):
            conn.accept()
    conn.data_to_send()
    return conn


def bdat_wire(body: bytes) -> bytes:
    parts = chunked(body, PIECE)
    return b"".join(b"BDAT %d%s\r\n" % (len(p), b" LAST" if i == len(parts) - 1 else b"") + p
                    for i, p in enumerate(parts))


def server_run(reads: list[bytes], count: int) -> float:
    conns = [in_transaction() for _ in range(count)]
    start = time.process_time()
    for conn in conns:
        ended = False
        for piece in reads:
            conn.receive_data(piece)
            while not isinstance(ev := conn.next_event(), S.NeedData):
                if isinstance(ev, S.EndOfData):
                    conn.accept()
                    ended = True
        assert ended
    return (time.process_time() - start) / count


Case = Callable[[int], float]


def make_cases() -> dict[str, tuple[Case, Case]]:
    """Per case name: (DATA, BDAT)."""
    cases: dict[str, tuple[Case, Case]] = {}
    for name, size in (("4k", 4 * KIB), ("100k", 100 * KIB), ("1m", 1024 * KIB)):
        body = content(size)
        pieces = chunked(body, PIECE)
        cases[f"client sends {name}"] = (partial(client_run, False, pieces), partial(client_run, True, pieces))
        cases[f"server receives {name}"] = (partial(server_run, chunked(b"DATA\r\n" + wire(body), PIECE)),
                                            partial(server_run, chunked(bdat_wire(body), PIECE)))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json", help="also save the result to this file")
    args = ap.parse_args()
    common.exit_on_sigterm()
    cases = make_cases()
    counts = {name: (calibrate(data), calibrate(bdat)) for name, (data, bdat) in cases.items()}
    samples: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in cases}
    for run in range(args.runs):
        for name, pair in cases.items():
            order = (0, 1) if run % 2 == 0 else (1, 0)  # alternated, so neither always runs first
            for k in order:
                samples[name][k].append(pair[k](counts[name][k]))
    medians = {name: (median(d) * 1e6, median(b) * 1e6) for name, (d, b) in samples.items()}
    rows = [[name, f"{d:.1f}", f"{b:.1f}", f"{d / b:.2f}x"] for name, (d, b) in medians.items()]
    say(f"machine: {common.machine()}; runs: {args.runs}")
    say(table(["case", "DATA CPU us/msg", "BDAT CPU us/msg", "DATA/BDAT"], rows))
    result = {"medians_us": {n: {"data": d, "bdat": b} for n, (d, b) in medians.items()}, "runs": args.runs,
              "machine": common.machine()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    common.emit_json(result)


if __name__ == "__main__":
    main()
