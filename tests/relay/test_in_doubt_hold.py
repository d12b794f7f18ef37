"""kill -9 between a next hop's ``250`` and the DELIVERY record: the message is held in doubt.

The relay runs as ``mta serve`` (a child process); the next hop runs in the
test. When the next hop has the message's data, it stops the relay
(SIGSTOP, and waits until the kernel says the process is stopped), then
sends its ``250`` and hangs up; the test sees the connection end (the ``250``
is on the wire) and kills the relay with SIGKILL. A stopped process runs no
instruction, so the DELIVERY record with that ``250`` is never written:
deterministic, no sleep. At the restart:

* ``in_doubt = "hold"`` (the default): recovery logs one line naming the
  queue id and the recipient, the message is held and listed by ``mta queue
  list --in-doubt``; it is not delivered (a message sent after the restart
  passes it), it stays held across another kill -9 and restart, and ``mta
  queue release`` sends it on: delivered once more, then gone from the
  queue. The documented runbook (docs/operations.md, "After a crash") is this
  session's real output.
* ``in_doubt = "redeliver"``: it is delivered again at once, with no command.
"""

from __future__ import annotations

import os
import re
import signal
import smtplib
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio
from process_support import RelayProcess, mta, mta_json
from relay_support import MESSAGE_ID, NextHop, Received, write_relay_config

from mta.smtp.server import ServerConnection

# Each test kills the relay's process and starts it again, seconds on a loaded machine.
pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
CHECKED = "<!-- checked by tests/relay/test_in_doubt_hold.py -->"
RCPT = "bob@far.example"
DOUBT_ID = "doubt-1@test"


class StoppingHop(NextHop):
    """Takes every message; before a message's ``250`` it awaits ``before_reply`` (None: replies at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.before_reply: Callable[[], Awaitable[None]] | None = None

    def ids(self) -> list[str]:
        return [m.group(1).decode() if (m := MESSAGE_ID.search(msg.data)) else "?" for msg in self.messages]

    async def take(self, conn: ServerConnection, msg: Received) -> None:
        self.messages.append(msg)
        self._wake()
        if self.before_reply is not None:
            await self.before_reply()
        conn.accept()


def send(port: int, rcpt: str, message_id: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=60) as s:
        s.sendmail("alice@example.org", [rcpt], f"Message-ID: <{message_id}>\r\nSubject: x\r\n\r\nhello\r\n")


def wait_stopped(pid: int) -> None:
    """Until the child ``pid`` is stopped (all its threads): ``waitid`` reports it, and leaves it reportable."""
    os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOWAIT)


async def crash_after_the_250(nursery: trio.Nursery, hop: StoppingHop, relay: RelayProcess) -> None:
    """One message to RCPT; the relay is stopped before the next hop's 250 and killed once it was sent."""
    await relay.start(nursery)
    assert relay.proc is not None
    pid = relay.proc.pid
    accepted = trio.Event()

    async def stop_the_relay() -> None:
        await accepted.wait()  # the client has its 250 (and QUIT's answer): the relay owes it nothing more
        os.kill(pid, signal.SIGSTOP)
        await trio.to_thread.run_sync(wait_stopped, pid, abandon_on_cancel=True)

    async def client() -> None:
        await trio.to_thread.run_sync(send, relay.port, RCPT, DOUBT_ID)
        accepted.set()

    hop.before_reply = stop_the_relay
    hop.hang_up_after_message = True  # the 250 is sent, then the connection closed: ``closed`` counts it
    nursery.start_soon(client)
    await hop.wait_closed(1, timeout=90)  # the 250 is on the wire; the stopped relay never read it
    hop.before_reply = None
    hop.hang_up_after_message = False
    await relay.kill()  # SIGKILL ends a stopped process
    assert hop.ids() == [DOUBT_ID]


def in_doubt_lines(relay: RelayProcess) -> list[str]:
    return [line for line in relay.lines if "in doubt: queue id" in line]


def runbook() -> list[tuple[str, str]]:
    """``(command or log line, output)`` of the block in operations.md marked ``CHECKED``: ``$ `` lines are
    commands, a line without it is the relay's log."""
    (block,) = re.findall(re.escape(CHECKED) + r"\n```[a-z]*\n(.*?)```", DOCS.read_text(), re.DOTALL)
    return [(part.partition("\n")[0], part.partition("\n")[2]) for part in re.split(r"^\$ ", block,
                                                                                    flags=re.MULTILINE)]


def normalise(text: str, qid: str) -> str:
    text = text.replace(qid, "<qid>")
    text = re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", "<time>", text)
    text = re.sub(r"(?m)^(<qid>!?) +\d+ ", r"\1 <size> ", text)  # the size counts the Received header
    text = re.sub(r"-- \d+ Kbytes", "-- <n> Kbytes", text)
    return re.sub(r"\[\d+\]", "[<pid>]", text)


async def test_in_doubt_is_held_at_restart_listed_and_delivered_once_after_release(tmp_path: Path) -> None:
    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            hop = StoppingHop()
            await hop.start(nursery)
            config = write_relay_config(tmp_path, {"far.example": f"smtp://127.0.0.1:{hop.port}?tls=none"})
            relay = RelayProcess(config)
            await crash_after_the_250(nursery, hop, relay)

            # Life 2: recovery holds the message and names it, with its recipient, in one line.
            await relay.start(nursery)
            listing = await mta_json(config, "queue", "list", "--in-doubt")
            (msg,) = listing["messages"]
            qid = msg["id"]
            assert msg["state"] == "held" and msg["in_doubt"] == [RCPT] and msg["recipients"] == [RCPT]
            (line,) = in_doubt_lines(relay)
            assert line.endswith(f"WARNING in doubt: queue id {qid} recipient {RCPT}: an attempt was in flight at "
                                 "the crash with no outcome recorded; the message is held: `mta queue release "
                                 f"{qid}` delivers it again, `mta queue delete {qid}` drops it"), line
            assert any("1 in doubt (1 message held: mta queue list --in-doubt)" in x for x in relay.lines)
            listed = await mta(config, "queue", "list", "--in-doubt")
            assert listed.returncode == 0, listed.stderr
            shown = await mta(config, "queue", "show", qid)
            assert (f"  {RCPT}: in doubt (perhaps delivered before a crash; held: mta queue release {qid} sends "
                    "it again)\n") in shown.stdout.decode(), shown.stdout.decode()

            # Held, not delivered: a message sent now (behind it in the log) is delivered, and it is not.
            await trio.to_thread.run_sync(send, relay.port, "carol@far.example", "after-1@test")
            await hop.wait_messages(2)
            assert hop.ids() == [DOUBT_ID, "after-1@test"]
            await relay.wait_output(lambda: any("event=delivery" in x and "to=<carol@far.example>" in x
                                                and "status=sent" in x for x in relay.lines), 60,
                                    "the later message's outcome, durable")  # else it would be in doubt too

            # A second restart (kill -9 again) finds it held: the hold is a record on disk, not a decision
            # each recovery makes again; recovery has nothing in doubt this time.
            await relay.kill()
            await relay.start(nursery)
            assert in_doubt_lines(relay) == []
            (again,) = (await mta_json(config, "queue", "list", "--in-doubt"))["messages"]
            assert (again["id"], again["state"], again["in_doubt"]) == (qid, "held", [RCPT])

            # The operator decides: release sends it on, delivered once, and the queue is empty.
            released = await mta(config, "queue", "release", qid)
            assert released.returncode == 0, released.stderr
            await hop.wait_messages(3)
            await relay.wait_output(lambda: any("event=delivery" in x and f"qid={qid}" in x and "status=sent" in x
                                                for x in relay.lines), 60, "the released message's delivery")
            empty = await mta(config, "queue", "list")
            assert empty.stdout.decode() == "Mail queue is empty\n"
            assert Counter(hop.ids()) == {DOUBT_ID: 2, "after-1@test": 1}
            await relay.kill()
            nursery.cancel_scope.cancel()

    # The runbook in docs/operations.md is this session: the log line, the listing, the release.
    real = [(line, ""), ("mta queue list --in-doubt", listed.stdout.decode()),
            (f"mta queue release {qid}", released.stdout.decode())]
    documented = runbook()
    doc_qid = documented[-1][0].split()[-1]  # the documented session's queue id
    assert [(normalise(c, doc_qid), normalise(o, doc_qid)) for c, o in documented] == \
        [(normalise(c, qid), normalise(o, qid)) for c, o in real], "docs/operations.md, \"After a crash\""


async def test_in_doubt_redeliver_delivers_it_again_at_restart(tmp_path: Path) -> None:
    with trio.fail_after(180):
        async with trio.open_nursery() as nursery:
            hop = StoppingHop()
            await hop.start(nursery)
            config = write_relay_config(tmp_path, {"far.example": f"smtp://127.0.0.1:{hop.port}?tls=none"},
                                        spool_extra='in_doubt = "redeliver"')
            relay = RelayProcess(config)
            await crash_after_the_250(nursery, hop, relay)

            await relay.start(nursery)
            await hop.wait_messages(2)  # no command: recovery left it due
            (line,) = in_doubt_lines(relay)
            assert f"recipient {RCPT}: " in line and line.endswith("; it will be delivered again"), line
            await relay.wait_output(lambda: any("event=delivery" in x and "status=sent" in x for x in relay.lines),
                                    60, "the redelivery's delivery line")
            assert (await mta(config, "queue", "list")).stdout.decode() == "Mail queue is empty\n"
            assert hop.ids() == [DOUBT_ID, DOUBT_ID]
            await relay.kill()
            nursery.cancel_scope.cancel()
