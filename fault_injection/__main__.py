"""``python -m fault_injection {powercut,relaycrash,kill9,faults,corrupt,smtpfuzz}``: the crash and fault harnesses.

Exit status 0 when every case passed, 1 when any failed (the failures are
printed with what is needed to replay them), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _powercut(args: argparse.Namespace) -> int:
    from fault_injection import powercut

    if args.replay:
        res = powercut.replay(args.workload or "deliver", args.seed, args.replay)
        print(f"replay {args.replay}: {'passed' if res.ok else 'FAILED'}; duplicates {res.duplicates}; "
              f"live messages {res.live_messages}")
        for v in res.violations:
            print(f"  {v}")
        return 0 if res.ok else 1
    names = powercut.workloads_for(args.workload)
    failed = 0
    totals = powercut.PowercutReport()
    for i, name in enumerate(names):
        share = max(1, args.max_states // len(names) + (1 if i < args.max_states % len(names) else 0))
        t0 = time.monotonic()
        rep = powercut.run(name, share, args.seed, progress=print)
        print(f"powercut {name} seed={args.seed}: {rep.line()} [{time.monotonic() - t0:.0f}s]", flush=True)
        for attr in ("explored", "passed", "failed", "duplicates", "candidates"):
            setattr(totals, attr, getattr(totals, attr) + getattr(rep, attr))
        failed += rep.failed
    if len(names) > 1:
        print(f"powercut total: {totals.line()}")
    return 1 if failed else 0


def _relaycrash(args: argparse.Namespace) -> int:
    from fault_injection import relaycrash

    if args.replay or args.recording:
        if not (args.replay and args.recording):
            print("relaycrash: --replay and --recording go together", file=sys.stderr)
            return 2
        res = relaycrash.replay(args.recording, args.replay)
        print(f"replay {args.replay}: {'FAILED' if res.violations else 'passed'}; acknowledged recipients checked "
              f"{res.checked}; duplicates {res.duplicates}")
        for v in res.violations:
            print(f"  {v}")
        return 1 if res.violations else 0
    t0 = time.monotonic()
    report = relaycrash.run(args.states, args.seed, messages=args.messages, relay_every=args.relay_every,
                            progress=lambda line: print(line, flush=True))
    print(f"{report.line()} [{time.monotonic() - t0:.0f}s]")
    return 0 if report.ok else 1


def _kill9(args: argparse.Namespace) -> int:
    import signal
    import threading

    from fault_injection import kill9

    stop = threading.Event()
    signal.signal(signal.SIGUSR1, lambda _sig, _frame: stop.set())
    summary = kill9.run(cycles=args.cycles, messages=args.messages, concurrency=args.concurrency, seed=args.seed,
                        relay=args.relay, max_seconds=args.max_minutes * 60 if args.max_minutes else None,
                        stop_requested=stop.is_set, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(summary.line())
    for p in summary.problems[:20]:
        print(f"  {p}")
    return 0 if summary.ok else 1


def _faults(args: argparse.Namespace) -> int:
    from fault_injection import faults

    report = faults.run_all(seed=args.seed, real_fs=not args.no_real_fs, sweep=args.sweep)
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1


def _corrupt(args: argparse.Namespace) -> int:
    from fault_injection import corrupt

    report = corrupt.run(cases=args.cases, seed=args.seed)
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1


def _smtpfuzz(args: argparse.Namespace) -> int:
    from fault_injection import smtpfuzz

    _stats, ok = smtpfuzz.run(minutes=args.minutes, seed=args.seed, progress=lambda line: print(line, flush=True))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fault_injection", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="show the engine's recovery log")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("powercut", help="simulated power loss: recover every crash state of a workload")
    p.add_argument("--workload", default=None, help="enqueue-only, deliver, recovery (default: all)")
    p.add_argument("--max-states", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replay", metavar="RECIPE", help="recover one state (as printed by a failure)")
    p.set_defaults(func=_powercut)

    r = sub.add_parser("relaycrash", help="power cuts under the running relay: recover crash states of its "
                       "recorded SMTP, Maildir and next-hop workload")
    r.add_argument("--states", type=int, default=1000, help="distinct crash states to recover and check")
    r.add_argument("--seed", type=int, default=0, help="the first run's seed (the next runs take seed+1, ...)")
    r.add_argument("--messages", type=int, default=40, help="messages per recorded run")
    r.add_argument("--relay-every", type=int, default=25,
                   help="recover every Nth state by a whole relay start (the rest by Spool.open)")
    r.add_argument("--recording", metavar="FILE", help="a recording saved by a failed run (with --replay)")
    r.add_argument("--replay", metavar="RECIPE", help="recover and check one state of --recording")
    r.set_defaults(func=_relaycrash)

    k = sub.add_parser("kill9", help="SIGKILL a workload process (or the relay) under load, restart, check the ledger")
    k.add_argument("--cycles", type=int, default=20)
    k.add_argument("--messages", type=int, default=0, help="messages per cycle (default: 20)")
    k.add_argument("--concurrency", type=int, default=8)
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--relay", action="store_true", help="kill the real relay (mta serve) instead")
    k.add_argument("--max-minutes", type=float, default=0,
                   help="start no new cycle after this long (then drain and score); 0: no limit. "
                        "SIGUSR1 does the same at once")
    k.set_defaults(func=_kill9)

    f = sub.add_parser("faults", help="ENOSPC, EIO, short writes and fsync failure at chosen operations")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--sweep", type=int, default=0, help="also inject at N sampled operation numbers per kind")
    f.add_argument("--no-real-fs", action="store_true", help="skip the full-tmpfs test")
    f.set_defaults(func=_faults)

    c = sub.add_parser("corrupt", help="bit flips, zeroed ranges and truncations in a spool's files")
    c.add_argument("--cases", type=int, default=40)
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(func=_corrupt)

    z = sub.add_parser("smtpfuzz", help="hostile SMTP sessions against a relay in this process; it must keep serving")
    z.add_argument("--minutes", type=float, default=5.0)
    z.add_argument("--seed", type=int, default=0)
    z.set_defaults(func=_smtpfuzz)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.CRITICAL,
                        format="%(levelname)s %(name)s: %(message)s")
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
