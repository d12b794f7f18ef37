"""In-process split of the data source's read of segments: the walk, the Arrow build, freeing the chunk.

Why: the Spark read's Python worker spends its CPU in three places that a
whole-job benchmark (report_bench.py) cannot tell apart: the frame walk with
its CBOR decoding and field checks (``_SegmentWalk.take``), turning a chunk
into an Arrow record batch (``_to_batch``), and freeing the chunk's Python
objects. This times each with ``time.process_time`` on the same segments,
with the cyclic collector paused as ``segment_batches`` pauses it. It imports
``spool.export.rows`` from ``sys.path``, so an older tree can be timed by putting it
first on ``PYTHONPATH``. ``--dump`` writes every batch to an Arrow IPC file,
``--compare`` checks two such files for equal contents (two trees' output).

    python tools/bench/arrow_build_bench.py '/tmp/fleet16/*' --segments 4 --repeat 3
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Any


def _segments(roots: list[str], count: int) -> list[Any]:
    from spool.export.rows import plan

    tasks = [t for t in plan(roots) if t.missing is None]
    return tasks[:count] if count else tasks


def _schema(rows: Any) -> Any:
    """The batches' Arrow schema (``arrow_schema``; ``_arrow_schema`` in older trees)."""
    return (getattr(rows, "arrow_schema", None) or rows._arrow_schema)()


def _one_pass(tasks: list[Any], batch_rows: int, dump: Any) -> tuple[int, float, float, float]:
    import pyarrow as pa

    from spool.export import rows

    schema = _schema(rows)
    records = 0
    walk_s = build_s = free_s = 0.0
    clock = time.process_time
    for task in tasks:
        walk = rows._SegmentWalk(task)
        while True:
            t0 = clock()
            chunk = walk.take(batch_rows)
            t1 = clock()
            if chunk is None:
                break
            batch = rows._to_batch(pa, schema, chunk, "bench", task.path)
            t2 = clock()
            del chunk
            t3 = clock()
            walk_s += t1 - t0
            build_s += t2 - t1
            free_s += t3 - t2
            records += batch.num_rows
            if dump is not None:
                dump.write_batch(batch)
            del batch
    return records, walk_s, build_s, free_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("roots", nargs="*", help="paths the data source reads (spools, archives, globs of them)")
    p.add_argument("--segments", type=int, default=4, help="how many segments of the plan (0: all)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--batch-rows", type=int, default=65536)
    p.add_argument("--dump", help="write every batch of one pass to this Arrow IPC file")
    p.add_argument("--compare", nargs=2, metavar="FILE", help="compare two --dump files and exit")
    args = p.parse_args(argv)
    import pyarrow as pa

    if args.compare:
        a, b = (pa.ipc.open_file(f).read_all() for f in args.compare)
        same = a.equals(b)
        print(f"{'equal' if same else 'DIFFERENT'}: {a.num_rows} / {b.num_rows} rows")
        return 0 if same else 1
    if not args.roots:
        p.error("a path is needed unless --compare")
    tasks = _segments(args.roots, args.segments)
    pa.array((0,), pa.int64())  # a process's first pa.array imports pandas (0.2 s): not the build's cost
    gc.disable()
    if args.dump:
        from spool.export import rows

        with pa.ipc.new_file(args.dump, _schema(rows)) as sink:
            _one_pass(tasks, args.batch_rows, sink)
    results = []
    n = 0
    for _ in range(args.repeat):
        n, w, b, f = _one_pass(tasks, args.batch_rows, None)
        results.append((w, b, f))
        print(f"{n} records: walk {w / n * 1e6:.3f}  build {b / n * 1e6:.3f}  free {f / n * 1e6:.3f}"
              f"  µs CPU/record", flush=True)
    if not results:
        return 0
    med = [statistics.median(r[i] for r in results) / n * 1e6 for i in range(3)]
    print(f"median: walk {med[0]:.3f}  build {med[1]:.3f}  free {med[2]:.3f}  build+free {med[1] + med[2]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
