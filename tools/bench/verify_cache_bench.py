"""The cost of the shared verification cache: one lookup in ``[recipients] verify_cache`` against a dict.

    .venv/bin/python tools/bench/verify_cache_bench.py [--runs 5] [--lookups 50000] [--addresses 10000]

What is measured: ``mta.recipients.verify_cache.VerifyCache.get`` of a
cached address (the RCPT of a verified domain whose answer is known), µs per
call, against the peer of the same run: the dict in the process that held
the answers before the cache was shared. The difference is the price of
sharing: the ``stat`` and ``fstat`` that find nothing new in the file. Also
``put`` (one appended line under ``flock``) against a dict store. Each figure
is the median of ``--runs`` runs, the variants alternated. The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit_json, load_average, machine, median, table, temp_dir

from mta.recipients.verify_cache import Answer, VerifyCache
from mta.smtp.common import Reply

YES = Reply(250, "2.1.5", "Ok")


def _per_call(fn: Callable[[int], object], n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - start) / n * 1e6


def one_run(path: str, addresses: int, lookups: int, file_first: bool) -> dict[str, float]:
    """µs per call of each operation, on a fresh cache file at ``path`` and a fresh dict."""
    cache = VerifyCache(path, 100_000)
    plain: dict[str, Answer] = {}
    expires = time.time() + 3600
    keys = [f"user{i}@far.test" for i in range(addresses)]
    got = {"put_file": _per_call(lambda i: cache.put(keys[i], Answer(YES, expires)), len(keys)),
           "put_dict": _per_call(lambda i: plain.__setitem__(keys[i], Answer(YES, expires)), len(keys))}
    order = [("get_file", lambda i: cache.get(keys[i % addresses])),
             ("get_dict", lambda i: plain.get(keys[i % addresses]))]
    for name, fn in order if file_first else order[::-1]:
        got[name] = _per_call(fn, lookups)
    cache.close()
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--lookups", type=int, default=50000)
    ap.add_argument("--addresses", type=int, default=10000)
    args = ap.parse_args()
    results: dict[str, list[float]] = {"get_file": [], "get_dict": [], "put_file": [], "put_dict": []}
    with temp_dir("verify-cache") as where:
        for run in range(args.runs):
            got = one_run(os.path.join(where, f"cache-{run}"), args.addresses, args.lookups, run % 2 == 0)
            for name, value in got.items():
                results[name].append(value)
    med = {k: median(v) for k, v in results.items()}
    print(table(["operation", "shared file µs", "dict µs", "ratio"],
                [["get (cached address)", f"{med['get_file']:.2f}", f"{med['get_dict']:.2f}",
                  f"{med['get_file'] / med['get_dict']:.1f}x"],
                 ["put (a new answer)", f"{med['put_file']:.2f}", f"{med['put_dict']:.2f}",
                  f"{med['put_file'] / med['put_dict']:.1f}x"]]))
    emit_json({"bench": "verify_cache", "machine": machine(), "load": load_average(), "runs": args.runs,
               "median_us": med, "samples_us": results})


if __name__ == "__main__":
    main()
