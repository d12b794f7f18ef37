"""The cost of DKIM signing per message, and how long it holds the relay's event loop.

    .venv/bin/python tools/bench/dkim_bench.py [--runs N] [--messages N] [--json OUT]

What is measured:

- ``sign``: ``mta.dkim.signer.Signer.sign`` on one message (parse, relaxed
  canonicalisation, body hash, the signatures), CPU time of this thread
  (``time.thread_time``) and wall time, per message, for an RSA-2048 key, an
  Ed25519 key and both together, on 4 KiB and 100 KiB messages (72-column
  text under the usual header fields). Keys are made fresh by
  ``mta.dkim.keygen.generate``.
- ``openssl``: the floor: OpenSSL's RSA-2048 PKCS#1 v1.5 signature of a
  SHA-256 digest already computed (``cryptography``'s ``sign`` with
  ``Prehashed``, the same call the signer makes), CPU per signature, timed
  in the same runs, alternated with the signer; the ratio is the signer's
  whole cost per message (parse, canonicalisation, hashes, the field) over it.
- ``loop``: what signing in the worker thread (``mta.dkim.accept``) costs the
  event loop: a trio task sleeps 1 ms at a time and records how late each
  wake-up is, while ``--messages`` messages are signed one after another
  through ``trio.to_thread.run_sync`` (as the relay does). Reported:
  the worst and the 99th-percentile lateness, against the same ticker with
  nothing signed.

Each figure is the median of ``--runs`` runs, the variants interleaved. The
last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import trio
from common import load_average, machine, median, table
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, utils
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPrivateKey

from mta.config.dkim import DkimSection
from mta.dkim.keygen import generate
from mta.dkim.keys import SigningKey, signing_key
from mta.dkim.signer import Signature, Signer

HEAD = (b"Received: from client.example (unknown [192.0.2.1])\r\n\tby relay.example with ESMTP id 10000A\r\n"
        b"\tfor <bob@dest.example>; Thu, 26 Nov 2026 10:00:00 +0000\r\n"
        b"From: Alice <alice@example.com>\r\nTo: Bob <bob@dest.example>\r\nSubject: the quarterly figures\r\n"
        b"Date: Thu, 26 Nov 2026 10:00:00 +0000\r\nMessage-ID: <a1b2c3@example.com>\r\nMIME-Version: 1.0\r\n"
        b"Content-Type: text/plain; charset=utf-8\r\n\r\n")


def message(size: int) -> bytes:
    line = b"The quick brown fox jumps over the lazy dog, and again, and again..  x\r\n"
    return HEAD + line * max(1, (size - len(HEAD)) // len(line))


def signers() -> tuple[dict[str, Signer], Callable[[bytes], bytes]]:
    """The three signers, and the RSA key's raw OpenSSL signature of a digest."""
    rsa_private = generate("rsa")
    rsa = signing_key(rsa_private, "example.com", "rsa1")
    ed = signing_key(generate("ed25519"), "example.com", "ed1")
    section = DkimSection()

    def of(*keys: SigningKey) -> Signer:
        return Signer(keys, section)

    assert isinstance(rsa_private, RSAPrivateKey)
    pad, prehashed = padding.PKCS1v15(), utils.Prehashed(hashes.SHA256())

    def raw(digest: bytes) -> bytes:
        return rsa_private.sign(digest, pad, prehashed)

    return {"rsa-2048": of(rsa), "ed25519": of(ed), "both": of(rsa, ed)}, raw


def time_raw(raw: Callable[[bytes], bytes], n: int) -> tuple[float, float]:
    """Median CPU and wall seconds of OpenSSL's RSA signature of one SHA-256 digest."""
    digest = hashlib.sha256(b"the header hash").digest()
    cpu, wall = [], []
    for _ in range(n):
        c, w = time.thread_time(), time.perf_counter()
        raw(digest)
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(cpu), statistics.median(wall)


def time_sign(signer: Signer, data: bytes, n: int) -> tuple[float, float]:
    """Median CPU and wall seconds per message over ``n`` signatures."""
    cpu, wall = [], []
    for _ in range(n):
        c, w = time.thread_time(), time.perf_counter()
        result = signer.sign(data)
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - w)
        assert isinstance(result, Signature)
    return statistics.median(cpu), statistics.median(wall)


async def _ticker(late: list[float], stop: trio.Event) -> None:
    while not stop.is_set():
        before = trio.current_time()
        await trio.sleep(0.001)
        late.append(trio.current_time() - before - 0.001)


async def _loop_case(signer: Signer | None, data: bytes, messages: int) -> list[float]:
    late: list[float] = []
    stop = trio.Event()
    limiter = trio.CapacityLimiter(2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_ticker, late, stop)
        if signer is None:
            await trio.sleep(0.5)
        else:
            for _ in range(messages):
                await trio.to_thread.run_sync(signer.sign, data, limiter=limiter)
        stop.set()
    return late


def loop_lateness(signer: Signer | None, data: bytes, messages: int) -> tuple[float, float]:
    """The worst and the 99th-percentile lateness (s) of a 1 ms ticker while ``messages`` are signed."""
    late = sorted(trio.run(_loop_case, signer, data, messages))
    return late[-1], late[int(len(late) * 0.99)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--messages", type=int, default=200, help="messages signed per loop run")
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args(argv)
    made, raw = signers()
    sizes = {"4 KiB": message(4096), "100 KiB": message(100 * 1024)}
    sign: dict[tuple[str, str], list[tuple[float, float]]] = {}
    loop: dict[str, list[tuple[float, float]]] = {}
    for _run in range(args.runs):
        for size, data in sizes.items():
            for name, signer in made.items():
                sign.setdefault((name, size), []).append(time_sign(signer, data, 30 if size == "4 KiB" else 10))
                if name == "rsa-2048":
                    sign.setdefault(("openssl rsa-2048 of a digest", size), []).append(time_raw(raw, 30))
        for name, loop_signer in (("nothing signed", None), ("rsa-2048", made["rsa-2048"]),
                                  ("both", made["both"])):
            loop.setdefault(name, []).append(loop_lateness(loop_signer, sizes["4 KiB"], args.messages))
    rows = [[name, size, f"{median([c for c, _ in v]) * 1e3:.2f}", f"{median([w for _, w in v]) * 1e3:.2f}"]
            for (name, size), v in sign.items()]
    print(f"# DKIM signing, {args.runs} runs, load {load_average()}")
    print(table(["keys", "message", "CPU ms/msg", "wall ms/msg"], rows))
    ratios = {size: median([c for c, _ in sign["rsa-2048", size]]) / median(
        [c for c, _ in sign["openssl rsa-2048 of a digest", size]]) for size in sizes}
    print(table(["message", "rsa-2048 signer CPU / OpenSSL's signature CPU"],
                [[size, f"{r:.2f}"] for size, r in ratios.items()]))
    lrows = [[name, f"{median([w for w, _ in v]) * 1e3:.1f}", f"{median([p for _, p in v]) * 1e3:.2f}"]
             for name, v in loop.items()]
    print(table(["worker thread signing 4 KiB messages", "worst lateness ms", "p99 lateness ms"], lrows))
    out: dict[str, Any] = {
        "machine": machine(), "runs": args.runs,
        "sign_ms": {f"{n} {s}": {"cpu": median([c for c, _ in v]) * 1e3, "wall": median([w for _, w in v]) * 1e3}
                    for (n, s), v in sign.items()},
        "signer_over_openssl": {size: round(r, 3) for size, r in ratios.items()},
        "loop_ms": {n: {"worst": median([w for w, _ in v]) * 1e3, "p99": median([p for _, p in v]) * 1e3}
                    for n, v in loop.items()},
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
