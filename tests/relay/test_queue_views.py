"""What ``mta queue list|count|show|shape`` print, as a Postfix operator reads them.

``list`` as ``postqueue -p``: a header, oldest first whatever hold and
release did to the log's order, ``*`` for a message being delivered and
``!`` for a held one, the last error in parentheses, a totals line, and
``Mail queue is empty``. ``shape`` as ``qshape``: a TOTAL row and a T column.
``show``: words for where the message stands, UTC ISO 8601 times with the
age beside them, each recipient's status and last reply, the next retry.

Two spools: one built with the engine (held, deferred and new messages, at
fixed ages) and read by the real console script with no relay (run from
another directory, through a config file whose spool.dir is relative), and a
real relay in this process with a message held at a next hop that never
answers (in flight) and one deferred then held. The documented output in
docs/operations.md is checked against the real command on the built spool.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import trio
from click.testing import CliRunner
from relay_support import DeliveryWatch, NextHop, relay_config, start_relay

from mta.cli import main
from mta.smtp.common import Reply
from spool.config.engine import SpoolConfig
from spool.engine.spool import Spool
from spool.format.record import Outcome, Status
from spool.read import listing as admin

MTA = os.path.join(os.path.dirname(sys.executable), "mta")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
CHECKED = "<!-- checked by tests/relay/test_queue_views.py -->"
ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"
# The paths the documented session shows, for the test's own.
DOC_CONFIG = "/etc/logspool/relay.toml"
DOC_SPOOL = "/var/spool/logspool"


# -- a spool with held, deferred and new mail, built with the engine ------------------------


BODIES = {"held": b"Subject: report\r\n\r\n" + b"the quarterly figures\r\n" * 100,
          "deferred": b"Subject: lunch\r\n\r\nat noon?\r\n", "new": b"Subject: hi\r\n\r\nhello\r\n"}
SIZES = {name: len(body) for name, body in BODIES.items()}


def build_sample(root: Path, now: float) -> dict[str, str]:
    """``root/etc/relay.toml`` naming ``../var/spool``, and in it three messages; returns name -> queue id.

    ``held``: arrived 2 h ago, deferred once, then held (its envelope rewritten
    at the head of the log, after the others). ``deferred``: arrived 1 h ago,
    one recipient deferred with a reply, the other delivered. ``new``: arrived
    30 s ago, never tried. Built the same way, the spool's queue ids (log
    positions) are the same every time.
    """
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "relay.toml").write_text(
        '[server]\nhostname = "relay.example.net"\n[spool]\ndir = "../var/spool"\nretry_intervals = ["5m", "1h"]\n'
        '[routes]\n"*" = "discard"\n')
    sp = Spool.open(str(root / "var" / "spool"), SpoolConfig(retry_intervals=(300.0, 3600.0)))
    try:
        held = sp.enqueue("alice@example.org", ["bob@far.example"], BODIES["held"],
                          arrival_ms=int((now - 7200) * 1000))
        deferred = sp.enqueue("carol@example.org", ["dan@far.example", "erin@near.example"], BODIES["deferred"],
                              arrival_ms=int((now - 3600) * 1000))
        sp.commit()
        greylisted = "451 4.7.1 greylisted, try again later"
        # A second may tick over between ``now`` and the appends (records carry whole seconds): claim as of
        # a moment after them, or the new-mail runner may not pass them yet.
        for attempt in sp.poll_due(time.time() + 1):
            rcpts = attempt.envelope.recipients
            sp.record_delivery(attempt, [
                Outcome(r, Status.DELIVERED, 250, "2.0.0", "ok", "mx.near.example[192.0.2.8]:25")
                if r.endswith("@near.example") else
                Outcome(r, Status.DEFERRED, 451, "4.7.1", "greylisted, try again later", "mx.far.example[192.0.2.7]:25")
                for r in rcpts])
            sp.commit()
            sp.finish(attempt, extra={"last_error": greylisted})
        new = sp.enqueue("frank@example.org", ["grace@near.example"], BODIES["new"], arrival_ms=int((now - 30) * 1000))
        sp.commit()
        assert sp.change(held, "hold")
    finally:
        sp.close()
    return {name: f"{mid:X}" for name, mid in (("held", held), ("deferred", deferred), ("new", new))}


def mta(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([MTA, *args], capture_output=True, text=True, timeout=60, check=False, cwd=str(cwd),
                          env=env)


def ok(cwd: Path, *args: str) -> str:
    proc = mta(cwd, *args)
    assert proc.returncode == 0 and proc.stderr == "", (proc.returncode, proc.stderr)
    return proc.stdout


def test_list_is_oldest_first_with_header_marks_and_totals_from_another_directory(tmp_path: Path) -> None:
    ids = build_sample(tmp_path, time.time())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    config = ["--config", "../etc/relay.toml"]  # relative to elsewhere/; the spool relative to etc/
    out = ok(elsewhere, "queue", "list", *config).splitlines()
    assert out[0] == "-Queue ID-          --Size-- ----Arrival Time----  -Sender/Recipient-------"
    body = "\n".join(out[1:])
    indent = " " * 51  # under the sender
    pattern = (rf"{ids['held']}! +{SIZES['held']} {ISO}  alice@example\.org\n"
               rf"\(451 4\.7\.1 greylisted, try again later\)\n{indent}bob@far\.example\n\n"
               rf"{ids['deferred']} +{SIZES['deferred']} {ISO}  carol@example\.org\n"
               rf"\(451 4\.7\.1 greylisted, try again later\)\n{indent}dan@far\.example\n\n"
               rf"{ids['new']} +{SIZES['new']} {ISO}  frank@example\.org\n{indent}grace@near\.example\n\n"
               r"-- 3 Kbytes in 3 Requests\.")
    assert re.fullmatch(pattern, body), body
    assert not (elsewhere / "var").exists()  # nothing created where the command ran
    # The log's order is deferred, new, held (the hold wrote its envelope last); the listing's is arrival's.
    listed = json.loads(ok(elsewhere, "queue", "list", "--json", "--limit", "100", *config))
    assert [m["id"] for m in listed["messages"]] == [ids["held"], ids["deferred"], ids["new"]]
    assert (listed["total"], listed["total_bytes"], listed["next"]) == (3, sum(SIZES.values()), None)
    assert [m["state"] for m in listed["messages"]] == ["held", "queued", "queued"]


def test_pages_follow_arrival_and_a_hold_between_pages_neither_repeats_nor_skips(tmp_path: Path) -> None:
    ids = build_sample(tmp_path, time.time())
    config = ["--config", str(tmp_path / "etc" / "relay.toml")]
    first = json.loads(ok(tmp_path, "queue", "list", "--limit", "1", "--json", *config))
    assert [m["id"] for m in first["messages"]] == [ids["held"]] and first["total"] == 3
    text = ok(tmp_path, "queue", "list", "--limit", "1", *config)
    assert (f"-- 1 shown, more: mta queue list {' '.join(config)} --limit 1 --cursor {first['next']}\n"
            "-- 3 Kbytes in 3 Requests.\n") in text  # the next page's command, as typed
    assert ok(tmp_path, "queue", "release", ids["held"], *config) == "release: 1 done\n"
    assert ok(tmp_path, "queue", "hold", ids["deferred"], *config) == "hold: 1 done\n"  # now last in the log
    second = json.loads(ok(tmp_path, "queue", "list", "--limit", "1", "--cursor", first["next"], "--json", *config))
    third = json.loads(ok(tmp_path, "queue", "list", "--limit", "1", "--cursor", second["next"], "--json", *config))
    assert [m["id"] for m in second["messages"] + third["messages"]] == [ids["deferred"], ids["new"]]
    assert third["next"] is None


def test_show_says_in_words_where_a_message_stands_and_each_recipients_last_reply(tmp_path: Path) -> None:
    ids = build_sample(tmp_path, time.time())
    config = ["--config", str(tmp_path / "etc" / "relay.toml")]
    out = ok(tmp_path, "queue", "show", ids["deferred"], *config)
    when = rf"{ISO} \((?:(?:\d+[dhms] ?)+ ago|now)\)"
    pattern = (rf"  queue id: {ids['deferred']}\n"
               r"    status: deferred \(retry class 1, every 5m\)\n"
               rf"   arrival: {when}\n"
               r"    sender: <carol@example\.org>\n"
               rf"      size: {SIZES['deferred']} bytes\n"
               rf"  attempts: 1, the last {when}\n"
               rf"next retry: {ISO} \(in (?:\d+[ms] ?)+\)\n"
               r"last error: 451 4\.7\.1 greylisted, try again later\n"
               r"recipients:\n"
               r"  dan@far\.example: deferred \[policy\]: 451 4\.7\.1 greylisted, try again later\n"
               rf"      at {when} from mx\.far\.example\[192\.0\.2\.7\]:25\n"
               r"  erin@near\.example: delivered: 250 2\.0\.0 ok\n"
               rf"      at {when} from mx\.near\.example\[192\.0\.2\.8\]:25\n")
    assert re.fullmatch(pattern, out), out
    assert "class: " not in out and "255" not in ok(tmp_path, "queue", "show", ids["held"], *config)
    held = ok(tmp_path, "queue", "show", ids["held"], *config)
    assert f"    status: held (mta queue release {ids['held']} lets it go)\n" in held
    assert "next retry" not in held and "  bob@far.example: held [policy]: 451 4.7.1 greylisted" in held
    new = ok(tmp_path, "queue", "show", ids["new"], *config)
    assert "    status: new\n" in new and "  attempts: 0\n" in new and "next retry: now\n" in new
    assert new.endswith("recipients:\n  grace@near.example: not tried yet\n")
    shown = json.loads(ok(tmp_path, "queue", "show", ids["deferred"], "--json", *config))
    assert (shown["state"], shown["class"], shown["retry_every"], shown["attempts"]) == ("queued", 1, 300.0, 1)
    assert [(r["recipient"], r["status"], r["code"]) for r in shown["recipient_status"]] == \
        [("dan@far.example", "deferred", 451), ("erin@near.example", "delivered", 250)]
    assert shown["next_retry"] > time.time() + 200 and shown["last_attempt"] <= time.time()


def test_shape_has_a_total_row_and_column_as_qshape(tmp_path: Path) -> None:
    build_sample(tmp_path, time.time())
    out = ok(tmp_path, "queue", "shape", "--config", str(tmp_path / "etc" / "relay.toml"))
    heads = ["T", "5", "10", "20", "40", "80", "160", "320", "640", "1280", "1280+"]
    rows = [("TOTAL", [3, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0]),  # 30 s, 1 h and 2 h old
            ("far.example", [2, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0]),
            ("near.example", [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0])]
    expected = [" " * 32 + "".join(f"{h:>7}" for h in heads)]
    expected += [f"{d:>32}" + "".join(f"{n:>7}" for n in counts) for d, counts in rows]
    assert out.splitlines() == expected


def test_an_empty_queue_says_so_as_postqueue_does(tmp_path: Path) -> None:
    Spool.open(str(tmp_path / "spool"), SpoolConfig()).close()
    (tmp_path / "relay.toml").write_text('[spool]\ndir = "spool"\n')
    config = ["--config", str(tmp_path / "relay.toml")]
    assert ok(tmp_path, "queue", "list", *config) == "Mail queue is empty\n"
    assert ok(tmp_path, "queue", "count", *config) == "0\n"
    assert json.loads(ok(tmp_path, "queue", "list", "--json", *config)) == \
        {"ok": True, "messages": [], "next": None, "total": 0, "total_bytes": 0}  # every message: none
    assert json.loads(ok(tmp_path, "queue", "list", "--json", "--limit", "100", *config)) == \
        {"ok": True, "messages": [], "next": None, "total": 0, "total_bytes": 0}


def test_a_filter_that_matches_nothing_is_not_an_empty_queue(tmp_path: Path) -> None:
    build_sample(tmp_path, time.time())
    out = ok(tmp_path, "queue", "list", "--domain", "nowhere.example", "--config", str(tmp_path / "etc" / "relay.toml"))
    assert out == "No queued message matches\n"


def test_a_recipient_in_doubt_after_a_crash_is_marked_in_list_and_show(tmp_path: Path) -> None:
    """An attempt that started and left no outcome (the process died): recovery keeps its recipients in doubt."""
    (tmp_path / "relay.toml").write_text('[spool]\ndir = "spool"\n')
    sp = Spool.open(str(tmp_path / "spool"), SpoolConfig())
    mid = sp.enqueue("a@example.org", ["b@far.example", "c@far.example"], b"Subject: x\r\n\r\ny\r\n")
    sp.commit()
    (attempt,) = sp.poll_due(time.time())
    sp.record_sending(attempt, attempt.remaining)  # the final dot went out
    sp.record_delivery(attempt, [Outcome("c@far.example", Status.DEFERRED, 451, "4.3.0", "later", "mx")])
    sp.commit()
    sp.close()  # no FINISH: as after kill -9 in the middle of the delivery
    config = ["--config", str(tmp_path / "relay.toml")]
    out = ok(tmp_path, "queue", "list", *config)
    assert re.search(r"\n {51}b@far\.example \(in doubt\)\n {51}c@far\.example\n", out), out
    assert f"\n{mid:X}! " in out  # recovery (the command's offline open) held it: in_doubt = "hold"
    show = ok(tmp_path, "queue", "show", f"{mid:X}", *config)
    assert (f"  b@far.example: in doubt (perhaps delivered before a crash; held: mta queue release {mid:X} sends it "
            "again)\n") in show, show
    assert re.search(r"\n  c@far\.example: held \[other\]: 451 4\.3\.0 later\n", show), show


# -- the engine's order: pages by arrival, in a heap of one page ---------------------------------


def test_oldest_first_pages_are_arrival_order_after_any_rewrites(tmp_path: Path) -> None:
    """Random arrivals, holds and releases: every page size gives each live message once, in (arrival, id) order."""
    rng = random.Random(15)
    sp = Spool.open(str(tmp_path / "spool"), SpoolConfig())
    try:
        mids = [sp.enqueue("a@x.example", [f"r{i}@y.example"], b"x" * rng.randrange(1, 300),
                           arrival_ms=1_700_000_000_000 + rng.randrange(0, 50) * 1000) for i in range(60)]
        sp.commit()
        for mid in rng.sample(mids, 25):
            sp.change(mid, "hold")
        for mid in rng.sample(mids, 10):
            sp.change(mid, rng.choice(["release", "delete"]))
        live = list(admin.iter_live(sp))
        expected = sorted((m.envelope.arrival_ms, m.message_id) for m in live)
        assert [(m.envelope.arrival_ms, m.message_id) for m in live] != expected  # the log is not in that order
        for limit in (1, 7, 60, 100):
            seen: list[tuple[int, int]] = []
            after = None
            for _ in range(len(mids) + 1):
                got = admin.oldest_first(sp, None, after, limit)
                assert len(got.messages) <= limit and got.total == len(live)
                assert got.total_bytes == sum(m.envelope.body_size for m in live)
                seen += [admin.arrival_key(m) for m in got.messages]
                if not got.more:
                    break
                after = admin.arrival_key(got.messages[-1])
            assert seen == expected, limit
    finally:
        sp.close()


# -- a real relay: a message in flight, one deferred and held --------------------------------


class SilentHop:
    """A next hop that takes the connection and never says a word: the delivery stays in flight."""

    def __init__(self) -> None:
        self.connected = trio.Event()

    async def start(self, nursery: trio.Nursery) -> int:
        listeners = await nursery.start(trio.serve_tcp, self._handle, 0)
        return int(listeners[0].socket.getsockname()[1])

    async def _handle(self, stream: trio.SocketStream) -> None:
        self.connected.set()
        await trio.sleep_forever()


async def send(port: int, rcpt: str) -> str:
    def one() -> str:
        import smtplib

        with smtplib.SMTP("127.0.0.1", port, timeout=30) as s:
            s.ehlo("client.test")
            assert s.mail("sender@example.org")[0] == 250
            assert s.rcpt(rcpt)[0] == 250
            code, text = s.data(b"Subject: t\r\n\r\nbody\r\n")
            assert code == 250, text
            m = re.search(rb"queued as ([0-9A-F]+)", text)
            assert m, text
            return m.group(1).decode()

    return await trio.to_thread.run_sync(one)


async def run_mta(cwd: Path, *args: str) -> str:
    proc = await trio.run_process([MTA, *args], capture_stdout=True, capture_stderr=True, check=False, cwd=str(cwd))
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr
    return proc.stdout.decode()


async def test_through_a_running_relay_in_flight_and_held_messages_are_marked(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        silent = SilentHop()
        silent_port = await silent.start(nursery)
        hop = NextHop(lambda stage, value: Reply(451, "4.3.0", "come back later") if stage == "rcpt" else None)
        hop_port = await hop.start(nursery)
        config = relay_config(str(tmp_path), {"slow.example": f"smtp://127.0.0.1:{silent_port}",
                                              "*": f"smtp://127.0.0.1:{hop_port}"}, retry='["1h"]')
        relay = await start_relay(nursery, config)
        watch = DeliveryWatch(relay)
        deferred = await send(relay.ports[0], "a@far.example")
        await watch.wait_for(Status.DEFERRED, 1)
        in_flight = await send(relay.ports[0], "b@slow.example")
        with trio.fail_after(30):
            await silent.connected.wait()  # claimed (START) before the connection: it is in flight now
        (tmp_path / "relay.toml").write_text('[spool]\ndir = "spool"\n[routes]\n"*" = "discard"\n')  # the same spool
        args = ["--config", str(tmp_path / "relay.toml")]
        assert await run_mta(tmp_path, "queue", "hold", deferred, *args) == "hold: 1 done\n"
        out = await run_mta(tmp_path, "queue", "list", *args)
        pattern = (r"-Queue ID- +--Size-- ----Arrival Time----  -Sender/Recipient-------\n"
                   rf"{deferred}! +\d+ {ISO}  sender@example\.org\n"
                   rf"\(451 4\.3\.0 come back later \(from 127\.0\.0\.1\[127\.0\.0\.1\]:{hop_port}\)\)\n"
                   r" +a@far\.example\n\n"
                   rf"{in_flight}\* +\d+ {ISO}  sender@example\.org\n +b@slow\.example\n\n"
                   r"-- 1 Kbytes in 2 Requests\.\n")
        assert re.fullmatch(pattern, out), out
        show = await run_mta(tmp_path, "queue", "show", in_flight, *args)
        assert "    status: being delivered\n" in show and "  b@slow.example: being delivered\n" in show
        shape = (await run_mta(tmp_path, "queue", "shape", *args)).splitlines()
        assert shape[1].split() == ["TOTAL", "2", "2", *["0"] * 9]
        nursery.cancel_scope.cancel()


# -- the documented session is the real one -----------------------------------------------------


def normalise(text: str, root: Path) -> str:
    """What changes from run to run (times, ages, the cursor's milliseconds, paths) made the same."""
    text = text.replace(str(root / "etc" / "relay.toml"), DOC_CONFIG).replace(str(root / "var" / "spool"), DOC_SPOOL)
    text = re.sub(ISO, "<time>", text)
    text = re.sub(r"\((?:in )?(?:\d+[dhms] ?)+(?: ago)?\)|\(now\)", "(<when>)", text)
    text = re.sub(r"\b\d{13}\.", "<ms>.", text)
    return re.sub(r'"(age|arrival|next_retry|last_attempt|time)": [0-9.]+', r'"\1": <n>', text)


def documented_session() -> list[tuple[str, str]]:
    """``(command, output)`` for each ``$ mta ...`` line in the blocks of operations.md marked ``CHECKED``."""
    session: list[tuple[str, str]] = []
    for block in re.findall(re.escape(CHECKED) + r"\n```[a-z]*\n(.*?)```", DOCS.read_text(), re.DOTALL):
        for part in re.split(r"^\$ ", block, flags=re.MULTILINE)[1:]:
            command, _, output = part.partition("\n")
            session.append((command, output))
    return session


def test_the_documented_queue_commands_print_what_the_real_ones_print(tmp_path: Path) -> None:
    session = documented_session()
    assert {c.split()[2] for c, _ in session if c.startswith("mta queue")} >= \
        {"list", "count", "show", "shape", "hold", "release", "delete", "flush"}
    build_sample(tmp_path, time.time())
    runner = CliRunner(env={"LOGSPOOL_CONFIG": str(tmp_path / "etc" / "relay.toml")})
    for command, documented in session:  # in this process, for speed: the same command as the console script
        args = command.replace(DOC_CONFIG, str(tmp_path / "etc" / "relay.toml")).split()
        assert args[0] == "mta", command
        result = runner.invoke(main, args[1:], prog_name="mta")
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        assert normalise(result.output, tmp_path) == normalise(documented, tmp_path), command



async def test_show_gives_the_history_of_mail_received_over_smtp(tmp_path: Path) -> None:
    """Over SMTP the queue id is the first DATA record's position, the envelope comes after it: the START names
    the envelope, and ``show`` found no outcome (``last_attempt`` null) although the log held it (issue 25)."""
    async with trio.open_nursery() as nursery:
        hop = NextHop(lambda stage, value: Reply(451, "4.3.0", "come back later") if stage == "rcpt" else None)
        hop_port = await hop.start(nursery)
        config = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{hop_port}"}, retry='["1h"]')
        relay = await start_relay(nursery, config)
        watch = DeliveryWatch(relay)
        qid = await send(relay.ports[0], "a@far.example")
        await watch.wait_for(Status.DEFERRED, 1)
        (tmp_path / "relay.toml").write_text('[spool]\ndir = "spool"\n[routes]\n"*" = "discard"\n')  # the same spool
        args = ["--config", str(tmp_path / "relay.toml")]
        shown = json.loads(await run_mta(tmp_path, "queue", "show", qid, "--json", *args))
        assert shown["last_attempt"] is not None, shown
        assert [(r["recipient"], r["status"], r["code"]) for r in shown["recipient_status"]] == \
            [("a@far.example", "deferred", 451)], shown
        text = await run_mta(tmp_path, "queue", "show", qid, *args)
        assert "  a@far.example: deferred [other]: 451 4.3.0 come back later\n" in text, text
        nursery.cancel_scope.cancel()
