"""``mta queue hold|release|delete|flush`` by selection (--all, --in-doubt, --domain, --sender) and ids on
standard input, offline and through a running relay; ``list --json`` streams every message.

The selections are streamed from the log in batches (``mta.admin.queue_ops.selection_batches``), so
the answers count rather than list.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import trio
from relay_support import DeliveryWatch, NextHop, relay_config, start_relay

from mta.shards import spool_config
from mta.smtp.common import Reply
from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool
from spool.format.record import Status

MTA = os.path.join(os.path.dirname(sys.executable), "mta")


def build(root: Path, n_far: int, n_near: int) -> list[str]:
    """``root/relay.toml`` and a spool with ``n_far`` messages to far.example then ``n_near`` to near.example."""
    (root / "relay.toml").write_text('[spool]\ndir = "spool"\n[routes]\n"*" = "discard"\n')
    sp = Spool.open(str(root / "spool"), SpoolConfig())
    try:
        ids = [sp.enqueue(f"s{i}@example.org", [f"r{i}@{'far' if i < n_far else 'near'}.example"], b"x\r\n")
               for i in range(n_far + n_near)]
        sp.commit()
    finally:
        sp.close()
    return [f"{mid:X}" for mid in ids]


def mta(root: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([MTA, *args, "--config", str(root / "relay.toml")], capture_output=True, text=True,
                          timeout=120, check=False, cwd=str(root), input=stdin)


def ok(root: Path, *args: str, stdin: str | None = None) -> str:
    proc = mta(root, *args, stdin=stdin)
    assert proc.returncode == 0 and proc.stderr == "", (proc.returncode, proc.stderr)
    return proc.stdout


def count(root: Path, *args: str) -> int:
    return int(ok(root, "queue", "count", *args))


def test_hold_and_release_by_domain_sender_and_all_count_what_they_did_offline(tmp_path: Path) -> None:
    build(tmp_path, 5, 3)
    assert ok(tmp_path, "queue", "hold", "--domain", "far.example") == "hold: 5 done\n"
    assert count(tmp_path, "--held") == 5
    assert ok(tmp_path, "queue", "hold", "--all") == "hold: 3 done\nhold: 5 with nothing to do\n"
    assert ok(tmp_path, "queue", "release", "--sender", "s6@example.org") == "release: 1 done\n"
    assert count(tmp_path, "--held") == 7
    answer = json.loads(ok(tmp_path, "queue", "release", "--all", "--json"))
    assert (answer["done"], answer["skipped"], answer["failed"]) == (7, 1, 0)
    assert count(tmp_path, "--held") == 0 and count(tmp_path) == 8


def test_ids_on_standard_input_in_batches_larger_than_one_request(tmp_path: Path) -> None:
    ids = build(tmp_path, 1203, 0)  # more than two batches of STDIN_BATCH
    text = "# from a script\n" + "\n".join(ids[:1200]) + "\n\n"
    assert ok(tmp_path, "queue", "hold", "-", stdin=text) == "hold: 1200 done\n"
    assert count(tmp_path, "--held") == 1200
    assert ok(tmp_path, "queue", "release", "--stdin", stdin=" ".join(ids[:2])) == "release: 2 done\n"
    proc = mta(tmp_path, "queue", "release", "-", stdin="not-an-id\n")
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_delete_all_needs_yes_and_a_selection_with_ids_is_refused(tmp_path: Path) -> None:
    ids = build(tmp_path, 2, 2)
    proc = mta(tmp_path, "queue", "delete", "--all")
    assert proc.returncode == 2 and "--yes" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert count(tmp_path) == 4
    for args in (["queue", "hold", ids[0], "--all"], ["queue", "hold", "-", "--domain", "far.example"],
                 ["queue", "release"]):
        proc = mta(tmp_path, *args, stdin="")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert ok(tmp_path, "queue", "delete", "--domain", "near.example") == "delete: 2 done\n"
    assert ok(tmp_path, "queue", "delete", "--all", "--yes") == "delete: 2 done\n"
    assert ok(tmp_path, "queue", "list") == "Mail queue is empty\n"


def test_list_json_streams_every_message_past_the_old_ceiling(tmp_path: Path) -> None:
    ids = build(tmp_path, 10_050, 0)
    listed = json.loads(ok(tmp_path, "queue", "list", "--json"))
    got = listed["messages"]
    assert len(got) == len(ids) == listed["total"] and listed["next"] is None
    assert [m["id"] for m in got] == ids  # oldest first: they arrived in this order
    assert all(m["recipients"] and m["state"] == "queued" for m in got)
    none = json.loads(ok(tmp_path, "queue", "list", "--json", "--domain", "nowhere.example"))
    assert none == {"ok": True, "messages": [], "next": None, "total": 0, "total_bytes": 0}


async def test_selections_through_a_running_relay(tmp_path: Path) -> None:
    """Deferred mail in a running relay: held by domain, released by sender, flushed, deleted --all."""
    async with trio.open_nursery() as nursery:
        hop = NextHop(lambda stage, value: Reply(451, "4.3.0", "come back later") if stage == "rcpt" else None)
        hop_port = await hop.start(nursery)
        config = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{hop_port}"}, retry='["1h"]')
        relay = await start_relay(nursery, config)
        watch = DeliveryWatch(relay)
        for rcpt in ("a@far.example", "b@far.example", "c@near.example"):
            await send(relay.ports[0], rcpt)
        await watch.wait_for(Status.DEFERRED, 3)
        (tmp_path / "relay.toml").write_text('[spool]\ndir = "spool"\n[routes]\n"*" = "discard"\n')

        async def run(*args: str) -> str:
            proc = await trio.to_thread.run_sync(lambda: mta(tmp_path, *args))
            assert proc.returncode == 0 and proc.stderr == "", proc.stderr
            return proc.stdout

        # Held or deferred for an hour, none of them is in flight while they change.
        assert await run("queue", "hold", "--domain", "far.example") == "hold: 2 done\n"
        assert (await run("queue", "count", "--held")).strip() == "2"
        assert await run("queue", "delete", "--domain", "far.example") == "delete: 2 done\n"
        assert await run("queue", "release", "--all") == "release: 0 done\nrelease: 1 with nothing to do\n"
        assert await run("queue", "delete", "--sender", "sender@example.org") == "delete: 1 done\n"
        assert await run("queue", "list") == "Mail queue is empty\n"
        nursery.cancel_scope.cancel()


async def send(port: int, rcpt: str) -> None:
    def one() -> None:
        import smtplib

        with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
            s.sendmail("sender@example.org", [rcpt], b"Subject: t\r\n\r\nbody\r\n")

    await trio.to_thread.run_sync(one)


def test_release_in_doubt_lets_go_only_the_messages_a_crash_left_in_doubt(tmp_path: Path) -> None:
    build(tmp_path, 2, 0)
    sp = Spool.open(str(tmp_path / "spool"), SpoolConfig())
    try:
        sp.enqueue("s@example.org", ["doubt@far.example"], b"x\r\n")
        sp.commit()
        claimed = sp.poll_due()  # every message claimed and past its final dot, no outcome: in doubt after a crash
        assert len(claimed) == 3
        for attempt in claimed:
            sp.record_sending(attempt, attempt.remaining)
        sp.commit()
    finally:
        sp.close()
    assert ok(tmp_path, "queue", "hold", "--sender", "s0@example.org") == "hold: 0 done\nhold: 1 with nothing to do\n"
    assert count(tmp_path, "--held") == 3  # held in doubt by recovery
    ok(tmp_path, "queue", "release", "--sender", "s0@example.org")  # released, still naming its recipient in doubt
    assert ok(tmp_path, "queue", "release", "--in-doubt") == "release: 2 done\nrelease: 1 with nothing to do\n"
    assert count(tmp_path, "--held") == 0


def test_a_selection_spans_every_shard_offline(tmp_path: Path) -> None:
    from relay_support import write_relay_config

    from mta.config import load_config
    from mta.shards import all_shards

    path = write_relay_config(tmp_path, {"*": "discard"}, extra="processes = 2")
    for k, shard in all_shards(load_config(str(path))):
        sp = Spool.open(shard.spool.dir, spool_config(shard, k))
        try:
            for i in range(k + 2):
                sp.enqueue("s@example.org", [f"r{i}@far.example"], b"x\r\n")
            sp.commit()
        finally:
            sp.close()
    proc = subprocess.run([MTA, "queue", "hold", "--domain", "far.example", "--config", str(path)],
                          capture_output=True, text=True, timeout=120, check=False, cwd=str(tmp_path))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "hold: 5 done\n", "")
