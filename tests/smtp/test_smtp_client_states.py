"""The client core's transaction table is its whole state machine (the server's: test_smtp_server_states.py).

``mta.smtp.client.TRANSITIONS`` claims to be the only way a transaction's
phase changes. Every (phase, step) pair it lists is taken, by a call of the
shell or a reply of the server, and leads where the table says; a call the
table does not list from a phase raises ``LocalProtocolError`` and moves
nothing; and for any replies a server may send, the steps the core reports
through ``on_transition`` are a walk through the table that matches the
events the shell saw.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mta.smtp import client as C
from mta.smtp.common import LocalProtocolError, RemoteProtocolError

Phase, Step, TRANSITIONS = C.Phase, C.Step, C.TRANSITIONS
Transition = tuple[C.Phase, C.Step, C.Phase]
EHLO = b"250-mx.test\r\n250-PIPELINING\r\n250-CHUNKING\r\n250 8BITMIME\r\n"


def recording() -> tuple[C.ClientConnection, list[Transition]]:
    """A connection past the greeting and EHLO (with PIPELINING), and the log of its steps."""
    log: list[Transition] = []

    def hook(old: C.Phase, step: C.Step, new: C.Phase) -> None:
        log.append((old, step, new))

    conn = C.ClientConnection(on_transition=hook)
    conn.receive_data(b"220 mx.test ESMTP\r\n")
    conn.ehlo("client.test")
    conn.data_to_send()
    conn.receive_data(EHLO)
    drain(conn)
    return conn, log


def drain(conn: C.ClientConnection) -> list[C.Event]:
    out: list[C.Event] = []
    for _ in range(1000):
        ev = conn.next_event()
        if isinstance(ev, C.NeedData):
            return out
        out.append(ev)
        if isinstance(ev, C.ConnectionClosed):
            return out
    raise AssertionError("the core never ran out of events")


def replies(data: bytes) -> Callable[[C.ClientConnection], None]:
    def reply(conn: C.ClientConnection) -> None:
        conn.data_to_send()
        conn.receive_data(data)
        drain(conn)

    return reply


# Each step, taken from the phase SETUP leaves the connection in. In DATA_SENT the server has answered
# MAIL only, so the replies to RCPT and DATA are still to come.
RECIPES: dict[C.Step, Callable[[C.ClientConnection], None]] = {
    Step.MAIL: lambda conn: conn.mail("a@x.example"),
    Step.RCPT: lambda conn: conn.rcpt("b@y.example"),
    Step.DATA: lambda conn: conn.data(),
    Step.BDAT: lambda conn: conn.bdat(),
    Step.GO_AHEAD: replies(b"250 2.1.5 ok\r\n354 go\r\n"),
    Step.NO_GO: replies(b"550 5.1.1 no such user\r\n354 go\r\n"),
    Step.DATA_REFUSED: replies(b"250 2.1.5 ok\r\n554 5.5.1 no\r\n"),
    Step.END_DATA: lambda conn: conn.end_data(),
    Step.FINAL: replies(b"250 2.0.0 queued\r\n"),
    Step.RSET: lambda conn: conn.rset(),
}
ENVELOPE = [RECIPES[Step.MAIL], RECIPES[Step.RCPT], RECIPES[Step.DATA]]
GO = replies(b"250 ok\r\n250 ok\r\n354 go\r\n")
SETUP: dict[C.Phase, list[Callable[[C.ClientConnection], None]]] = {
    Phase.READY: [],
    Phase.ENVELOPE: ENVELOPE[:2],
    Phase.DATA_SENT: [*ENVELOPE, replies(b"250 2.1.0 ok\r\n")],
    Phase.BODY: [*ENVELOPE, GO, lambda conn: conn.send_body(b"hi\r\n")],
    Phase.ENDED: [*ENVELOPE, GO, RECIPES[Step.END_DATA]],
}
PAIRS = [(phase, step) for phase, row in TRANSITIONS.items() for step in row]
CALLS = [Step.MAIL, Step.RCPT, Step.DATA, Step.BDAT, Step.END_DATA, Step.RSET]  # the steps the shell takes by a call
ABSENT_CALLS = [(phase, step) for phase in Phase for step in CALLS if step not in TRANSITIONS[phase]]


def session_in(phase: C.Phase) -> tuple[C.ClientConnection, list[Transition]]:
    conn, log = recording()
    for action in SETUP[phase]:
        action(conn)
    assert conn.phase is phase
    log.clear()
    return conn, log


def test_the_table_covers_every_phase_and_step() -> None:
    assert set(TRANSITIONS) == set(Phase)
    assert {step for row in TRANSITIONS.values() for step in row} == set(Step) == set(RECIPES)
    assert all(Step.RSET in row for phase, row in TRANSITIONS.items() if phase is not Phase.BODY)


@pytest.mark.parametrize(("phase", "step"), PAIRS, ids=[f"{p.name}-{s.name}" for p, s in PAIRS])
def test_every_step_in_the_table_is_taken(phase: C.Phase, step: C.Step) -> None:
    conn, log = session_in(phase)
    RECIPES[step](conn)
    assert log == [(phase, step, TRANSITIONS[phase][step])]
    assert conn.phase is TRANSITIONS[phase][step]
    assert conn.in_data == (conn.phase is Phase.BODY)


@pytest.mark.parametrize(("phase", "step"), ABSENT_CALLS, ids=[f"{p.name}-{s.name}" for p, s in ABSENT_CALLS])
def test_a_call_the_table_does_not_list_raises_and_moves_nothing(phase: C.Phase, step: C.Step) -> None:
    conn, log = session_in(phase)
    with pytest.raises(LocalProtocolError):
        RECIPES[step](conn)
    assert log == []
    assert conn.phase is phase


REPLIES = [*[b"250 2.0.0 ok\r\n"] * 3, *[b"354 go\r\n"] * 2, b"550 5.1.1 no\r\n", b"451 4.3.0 later\r\n",
           b"221 bye\r\n", b"421 4.3.2 closing\r\n", b"250-mx\r\n250 PIPELINING\r\n", b"25"]
# Mostly replies, now and then any bytes (which mostly end the session: the parser refuses them).
reply = st.integers(0, 7).flatmap(lambda n: st.binary(max_size=8) if n == 0 else st.sampled_from(REPLIES))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_replies_move_the_client_only_along_the_table(data: st.DataObject) -> None:
    """A shell that follows the protocol, one transaction after another, against a server that says anything."""
    conn, log = recording()
    at, checked = Phase.READY, 0
    seen: collections.Counter[str] = collections.Counter()

    def check() -> None:
        nonlocal at, checked
        for old, step, new in log[checked:]:
            assert old is at and TRANSITIONS[old].get(step) is new, (old, step, new)
            at = new
        assert conn.phase is at
        checked = len(log)

    def count(events: list[C.Event]) -> bool:
        """Tally the events; True if the server is gone."""
        for ev in events:
            if isinstance(ev, C.DataReply):
                seen["go" if ev.go_ahead else "no go"] += 1
            elif isinstance(ev, C.MessageReply):
                seen["message"] += 1
        return any(isinstance(ev, C.Closing | C.ConnectionClosed) for ev in events)

    try:
        for _ in range(data.draw(st.integers(5, 40), label="turns")):
            if conn.idle and data.draw(st.booleans()):
                conn.mail("a@x.example")
                for i in range(data.draw(st.integers(1, 3))):
                    conn.rcpt(f"r{i}@y.example")
                conn.data()
            elif conn.phase is Phase.BODY:
                conn.send_body(b"hi\r\n")
                conn.end_data()
            elif conn.idle and data.draw(st.integers(0, 5)) == 0:
                conn.rset()
            check()
            conn.data_to_send()
            conn.receive_data(data.draw(reply))
            gone = count(drain(conn))
            check()
            if gone:
                break
    except RemoteProtocolError:
        count(drain(conn))  # the shell drops a server that makes no sense; what happened until then still holds
    check()
    steps = collections.Counter(step for _, step, _ in log)
    assert steps[Step.GO_AHEAD] == seen["go"]
    assert steps[Step.NO_GO] + steps[Step.DATA_REFUSED] == seen["no go"]
    assert steps[Step.FINAL] + steps[Step.DATA_REFUSED] == seen["message"]
