"""The server core's transition table is its whole state machine (the client's: test_smtp_client_states.py).

``mta.smtp.server.TRANSITIONS`` claims to be the only way the state changes.
These tests hold it to that from three sides: every (state, step) pair it
lists is reached by client input and leads where the table says; every pair
it does not list cannot be taken, the same input leaves the state alone; and
for any byte stream and any decisions, the steps the core reports through its
``on_transition`` hook are steps of the table, one after the other, matching
the events the shell saw. Between them, what the steps that end a transaction
or a session make the core forget.
"""

from __future__ import annotations

import base64
import collections
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mta.smtp import server as S
from mta.smtp.common import LocalProtocolError, Reply, ReplyParser

State, Step, TRANSITIONS = S.State, S.Step, S.TRANSITIONS
Transition = tuple[S.State, S.Step, S.State]
Decider = Callable[[S.ServerConnection, S.Event], None]
MAX_ERRORS = 5  # above the errors any one recipe below makes, except TOO_MANY_ERRORS's own


def recording(**opts: object) -> tuple[S.ServerConnection, list[Transition]]:
    log: list[Transition] = []

    def hook(old: S.State, step: S.Step, new: S.State) -> None:
        log.append((old, step, new))

    conn = S.ServerConnection("mx.test", on_transition=hook, **opts)  # type: ignore[arg-type]
    return conn, log


def accept(conn: S.ServerConnection, ev: S.Event) -> None:
    conn.accept()


def reject(conn: S.ServerConnection, ev: S.Event) -> None:
    conn.reject(Reply(554, "5.7.1", "Refused"))


def pump(conn: S.ServerConnection, data: bytes, decide: Decider = accept) -> list[Reply]:
    """Feed ``data`` (``b""``: EOF), then take events, deciding each decision, until the core waits or closes.

    Returns the replies sent meanwhile.
    """
    conn.receive_data(data)
    out = bytearray()
    for _ in range(1000):
        ev = conn.next_event()
        if isinstance(ev, S.MailFrom | S.RcptTo | S.EndOfData | S.StartTls | S.AuthRequest):
            decide(conn, ev)
        out += conn.data_to_send()
        if isinstance(ev, S.NeedData | S.ConnectionClosed) or conn.state is State.TLS:  # TLS: the shell's turn
            return ReplyParser().feed(bytes(out))
    raise AssertionError("the core never asked for more input")


def sends(data: bytes, decide: Decider = accept) -> Callable[[S.ServerConnection], None]:
    def send(conn: S.ServerConnection) -> None:
        pump(conn, data, decide)

    return send


def handshake(conn: S.ServerConnection) -> None:
    conn.tls_started()  # what the shell calls once the TLS handshake is done


# What a client sends to take each step; TLS_STARTED is the shell's (tls_started() after the handshake).
SAYS: dict[S.Step, bytes] = {
    Step.HELLO: b"EHLO c.example\r\n",
    Step.MAIL_ACCEPTED: b"MAIL FROM:<a@x.example>\r\n",
    Step.RCPT_ACCEPTED: b"RCPT TO:<b@y.example>\r\n",
    Step.DATA_STARTED: b"DATA\r\n",
    Step.BDAT_STARTED: b"BDAT 3\r\nabc",  # a chunk, read whole: the session waits between chunks
    Step.MESSAGE_ACCEPTED: b"body\r\n.\r\n",
    Step.MESSAGE_REJECTED: b"body\r\n.\r\n",
    Step.MESSAGE_REFUSED: b"bare\nLF\r\n.\r\n",
    Step.RSET: b"RSET\r\n",
    Step.STARTTLS_ACCEPTED: b"STARTTLS\r\n",
    Step.QUIT: b"QUIT\r\n",
    Step.TOO_MANY_ERRORS: b"FOO\r\n",
    Step.EOF: b"",
    Step.AUTH_STARTED: b"AUTH PLAIN\r\n",  # the empty challenge: the session waits in AUTH for the response
    Step.AUTH_SUCCEEDED: base64.b64encode(b"\0user\0password") + b"\r\n",
    Step.AUTH_FAILED: base64.b64encode(b"\0user\0password") + b"\r\n",
    Step.AUTH_ABORTED: b"*\r\n",
}
# Between BDAT chunks the content ends with a BDAT LAST, not with a dot.
SAYS_IN: dict[tuple[S.State, S.Step], bytes] = {
    (State.CHUNKS, Step.MESSAGE_ACCEPTED): b"BDAT 0 LAST\r\n",
    (State.CHUNKS, Step.MESSAGE_REJECTED): b"BDAT 0 LAST\r\n",
    (State.CHUNKS, Step.MESSAGE_REFUSED): b"BDAT 4 LAST\r\nb\nLF",
}


def says(state: S.State, step: S.Step) -> bytes:
    return SAYS_IN.get((state, step), SAYS[step])


# The input that takes each step, from any state the table lets it start in (but SAYS_IN's).
RECIPES: dict[S.Step, Callable[[S.ServerConnection], None]] = {
    **{step: sends(said) for step, said in SAYS.items()},
    Step.MESSAGE_REJECTED: sends(SAYS[Step.MESSAGE_REJECTED], reject),
    Step.AUTH_FAILED: sends(SAYS[Step.AUTH_FAILED], reject),
    Step.TOO_MANY_ERRORS: sends(SAYS[Step.TOO_MANY_ERRORS] * MAX_ERRORS),
    Step.TLS_STARTED: handshake,
}
RECIPES_IN: dict[tuple[S.State, S.Step], Callable[[S.ServerConnection], None]] = {
    **{pair: sends(said) for pair, said in SAYS_IN.items()},
    (State.CHUNKS, Step.MESSAGE_REJECTED): sends(SAYS_IN[State.CHUNKS, Step.MESSAGE_REJECTED], reject),
}


def recipe(state: S.State, step: S.Step) -> Callable[[S.ServerConnection], None]:
    return RECIPES_IN.get((state, step), RECIPES[step])


PAIRS = [(state, step) for state, row in TRANSITIONS.items() for step in row]
ABSENT = [(state, step) for state in State for step in Step if step not in TRANSITIONS[state]]


def paths() -> dict[S.State, list[S.Step]]:
    """The shortest run of steps from CONNECTED to each state, found in the table itself."""
    found: dict[S.State, list[S.Step]] = {State.CONNECTED: []}
    queue = collections.deque([State.CONNECTED])
    while queue:
        state = queue.popleft()
        for step, nxt in TRANSITIONS[state].items():
            if nxt not in found:
                found[nxt] = [*found[state], step]
                queue.append(nxt)
    return found


def session_in(state: S.State) -> tuple[S.ServerConnection, list[Transition]]:
    """A session driven into ``state`` by the recipes along its path, with the log emptied."""
    conn, log = recording(tls_available=True, auth=True, auth_without_tls=True, max_errors=MAX_ERRORS)
    at = State.CONNECTED
    for step in paths()[state]:
        recipe(at, step)(conn)
        at = TRANSITIONS[at][step]
    assert conn.state is state
    log.clear()
    return conn, log


def test_the_table_covers_every_state_and_step_and_closed_is_final() -> None:
    assert set(TRANSITIONS) == set(State)
    assert set(paths()) == set(State), "a state no step leads to"
    assert {step for row in TRANSITIONS.values() for step in row} == set(Step) == set(RECIPES)
    assert TRANSITIONS[State.CLOSED] == {}
    ends = {State.CLOSED}  # the states from which the session can end: all of them, no trap
    while grown := {s for s, row in TRANSITIONS.items() if s not in ends and ends & set(row.values())}:
        ends |= grown
    assert ends == set(State)


@pytest.mark.parametrize(("state", "step"), PAIRS, ids=[f"{a.name}-{s.name}" for a, s in PAIRS])
def test_every_step_in_the_table_is_reached_by_client_input(state: S.State, step: S.Step) -> None:
    conn, log = session_in(state)
    recipe(state, step)(conn)
    assert log == [(state, step, TRANSITIONS[state][step])]
    assert conn.state is TRANSITIONS[state][step]


@pytest.mark.parametrize(("state", "step"), ABSENT, ids=[f"{a.name}-{s.name}" for a, s in ABSENT])
def test_a_step_not_in_the_table_is_never_taken(state: S.State, step: S.Step) -> None:
    """The same input, where the table has no such step, moves nothing (a shell call raises).

    Except in AUTH, where a line that is no response ends the exchange (AUTH_ABORTED), as the table says.
    """
    conn, log = session_in(state)
    if state is State.TLS or step is Step.TLS_STARTED:  # the shell calling at the wrong time
        with pytest.raises(LocalProtocolError):
            RECIPES[step](conn)
    else:
        RECIPES[step](conn)
    if state is State.AUTH and log:  # in AUTH every line is a response: one that is not ends the exchange
        assert log[0] == (State.AUTH, Step.AUTH_ABORTED, State.IDLE)
        assert all(TRANSITIONS[old][taken] is new for old, taken, new in log)
        return
    assert log == []
    assert conn.state is state


@pytest.mark.parametrize("step", [Step.RSET, Step.HELLO, Step.MESSAGE_ACCEPTED, Step.MESSAGE_REJECTED,
                                  Step.MESSAGE_REFUSED], ids=lambda step: step.name)
def test_a_step_that_ends_the_transaction_forgets_its_recipients(step: S.Step) -> None:
    """RFC 5321 §4.1.1.5 and §4.1.4: RSET and HELO/EHLO abort the transaction, the end of the content ends it."""
    conn, _ = recording(max_recipients=1, max_errors=MAX_ERRORS)
    pump(conn, b"EHLO first.example\r\n" + SAYS[Step.MAIL_ACCEPTED] + SAYS[Step.RCPT_ACCEPTED])
    if step.name.startswith("MESSAGE"):
        RECIPES[Step.DATA_STARTED](conn)
    RECIPES[step](conn)
    again = pump(conn, SAYS[Step.MAIL_ACCEPTED] + SAYS[Step.RCPT_ACCEPTED])
    assert [(r.code, r.enhanced) for r in again] == [(250, "2.1.0"), (250, "2.1.5")]
    assert conn.helo_name == ("c.example" if step is Step.HELLO else "first.example") and conn.esmtp


def test_tls_started_forgets_the_hello_too() -> None:
    """RFC 3207 §4.2: after the handshake the client starts again, with EHLO."""
    conn, _ = recording(tls_available=True)
    pump(conn, b"EHLO first.example\r\nSTARTTLS\r\n")
    conn.tls_started()
    assert (conn.state, conn.helo_name, conn.esmtp) == (State.CONNECTED, None, False)
    assert [(r.code, r.enhanced) for r in pump(conn, SAYS[Step.MAIL_ACCEPTED])] == [(503, "5.5.1")]


def test_state_cannot_be_assigned_from_outside() -> None:
    conn, _ = recording()
    with pytest.raises(AttributeError):
        conn.state = State.IDLE  # type: ignore[misc]


PIECES = [
    b"HELO c.example\r\n", b"MAIL FROM:<> SIZE=100\r\n", b"RCPT TO:<c@y.example>\r\n", b"NOOP\r\n",
    b"Subject: s\r\n\r\nhi\r\n", b"\r\n.\r\n", b".\r\n", b"\n", b"\r", b"x" * 600, b"y" * 70 + b"\r\n",
    b"BDAT 5\r\n", b"BDAT 2 LAST\r\n", b"BDAT 0 LAST\r\n", b"BDAT x\r\n", b"BDAT 99999999 LAST\r\n",
    *(said for said in (*SAYS.values(), *SAYS_IN.values()) if said),
]
ENDINGS = frozenset({Step.QUIT, Step.TOO_MANY_ERRORS, Step.EOF, Step.TLS_STARTED})
options = st.fixed_dictionaries({
    "tls_available": st.booleans(),
    "auth": st.booleans(),
    "auth_without_tls": st.booleans(),
    "require_auth": st.booleans(),
    "max_errors": st.sampled_from([3, 1000]),
    "max_message_size": st.sampled_from([60, 10_000]),
    "max_line_length": st.sampled_from([40, 1000]),
    "max_recipients": st.sampled_from([1, 5]),
})


@settings(max_examples=300, deadline=None)
@given(options, st.data())
def test_any_byte_stream_moves_the_server_only_along_the_table(opts: dict[str, object], data: st.DataObject) -> None:
    """A client that half the time says what takes the session on along a step of the table, and
    otherwise any piece of SMTP or any bytes, in reads of any size; the shell mostly says yes."""
    conn, log = recording(**opts)
    length = data.draw(st.integers(8, 40), label="pieces before EOF")
    reads: list[bytes] = []
    said = 0
    eof = False
    seen: collections.Counter[str] = collections.Counter()
    at, checked = State.CONNECTED, 0  # where the log says the session is, and how much of the log says so

    def check() -> None:
        """The log is a walk through the table, and it ends where the connection is."""
        nonlocal at, checked
        for old, step, new in log[checked:]:
            assert old is at and TRANSITIONS[old].get(step) is new, (old, step, new)
            at = new
        assert conn.state is at
        checked = len(log)

    for _ in range(10_000):
        ev = conn.next_event()
        check()
        if isinstance(ev, S.NeedData):
            if not reads and not eof:
                said += 1
                choice = data.draw(st.integers(0, 3))
                if said > length:
                    eof = True
                elif choice < 2:  # onwards: the steps that end the session come from the other choices
                    step = data.draw(st.sampled_from([s for s in TRANSITIONS[conn.state] if s not in ENDINGS]))
                    piece = says(conn.state, step)
                else:
                    piece = data.draw(st.sampled_from(PIECES) if choice == 2 else st.binary(min_size=1, max_size=16))
                if not eof:
                    cut = data.draw(st.integers(0, len(piece)))  # in one read or two
                    reads = [part for part in (piece[:cut], piece[cut:]) if part]
            conn.receive_data(reads.pop(0) if reads else b"")
            continue
        name = type(ev).__name__
        if isinstance(ev, S.DataAborted):
            name += "(core)" if ev.reply is not None else "(eof)"
        seen[name] += 1
        if isinstance(ev, S.ConnectionClosed):
            break
        if isinstance(ev, S.MailFrom | S.RcptTo | S.EndOfData | S.StartTls | S.AuthRequest):
            if data.draw(st.integers(0, 3)) > 0:
                conn.accept()
                seen[name + " accepted"] += 1
                if isinstance(ev, S.StartTls):
                    conn.tls_started()
            else:
                conn.reject(Reply(550, "5.7.1", "No"))
            check()
    else:
        raise AssertionError("the core did not finish")

    steps = collections.Counter(step for _, step, _ in log)
    assert steps[Step.HELLO] == seen["Ehlo"] + seen["Helo"]
    assert steps[Step.MAIL_ACCEPTED] == seen["MailFrom accepted"]
    assert steps[Step.RCPT_ACCEPTED] == seen["RcptTo accepted"]
    assert steps[Step.DATA_STARTED] + steps[Step.BDAT_STARTED] == seen["DataStart"]
    assert steps[Step.MESSAGE_ACCEPTED] == seen["EndOfData accepted"]
    assert steps[Step.MESSAGE_REJECTED] == seen["EndOfData"] - seen["EndOfData accepted"]
    assert steps[Step.MESSAGE_REFUSED] == seen["DataAborted(core)"]
    assert steps[Step.RSET] == seen["Rset"]
    assert steps[Step.STARTTLS_ACCEPTED] == steps[Step.TLS_STARTED] == seen["StartTls accepted"]
    assert steps[Step.QUIT] == seen["Quit"]
    assert steps[Step.QUIT] + steps[Step.TOO_MANY_ERRORS] + steps[Step.EOF] == 1
    assert seen["DataAborted(eof)"] == sum(1 for old, step, _ in log
                                           if old in (State.DATA, State.CHUNKS) and step is Step.EOF)
    assert conn.state is State.CLOSED
