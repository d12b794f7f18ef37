"""Hostile input never takes the relay down, end to end on 127.0.0.1.

Every test drives the real relay (``relay_support``) with raw sockets and then
proves that it still serves: a fresh client gets ``220`` and a well-formed
message reaches the next hop (``still_serving``).

Failures are injected where a peer's input reaches code that can fail: a
``Config`` whose routing raises for chosen domains (``hostile``). That is a
bug reached through a client's RCPT (the session's boundary) or through a
queued recipient (the scheduler's), not a stand-in for the server.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import attrs
import pytest
import trio
from relay_support import DeliveryWatch, NextHop, RawClient, relay_config, start_relay

from fault_injection.faults import Fault, FaultyFileIO
from mta.config import Config, NoRoute, Route
from mta.containment import is_fatal
from mta.delivery import dsn as dsnmod
from mta.delivery.transport import Destination, Job, OnOutcome, Transport
from mta.process.relay import Relay
from mta.smtp.common import Reply
from spool.errors import SpoolError, SyncFailed
from spool.format.record import Outcome, Status


def hostile(cfg: Config, raising: dict[str, Callable[[str], BaseException]]) -> Config:
    """``cfg`` whose ``route_for`` raises ``raising[domain](domain)`` for the domains named."""

    class HostileConfig(Config):
        def route_for(self, domain: str) -> Route | NoRoute:
            make = raising.get(domain.lower())
            if make is not None:
                raise make(domain)
            return super().route_for(domain)

    return HostileConfig(**{f.name: getattr(cfg, f.name) for f in attrs.fields(Config)})


def assert_printable(reply: list[bytes]) -> None:
    """No raw client byte comes back: every reply line is printable ASCII."""
    for line in reply:
        assert all(0x20 <= b <= 0x7E for b in line), line


async def still_serving(port: int, hop: NextHop, n: int) -> None:
    """A fresh client gets 220 and its message is the ``n``-th the next hop receives."""
    c = await RawClient.connect(port)
    assert (await c.reply())[0].startswith(b"220 ")
    await c.command(b"EHLO fresh.example")
    assert (await c.command(b"MAIL FROM:<fresh@example.org>"))[0].startswith(b"250")
    assert (await c.command(b"RCPT TO:<fresh%d@far.example>" % n))[0].startswith(b"250")
    assert (await c.command(b"DATA"))[0].startswith(b"354")
    assert (await c.command(b"Subject: fresh\r\n\r\nstill here\r\n."))[0].startswith(b"250 2.0.0")
    await c.command(b"QUIT")
    await c.aclose()
    msgs = await hop.wait_messages(n)
    assert msgs[n - 1].recipients == [f"fresh{n}@far.example"] and b"still here" in msgs[n - 1].data


# ------------------------------------------------------------------ section 1: hostile bytes in commands

# (what the session has done first, the hostile line, the reply it must get)
HOSTILE_LINES: list[tuple[str, bytes, bytes]] = [
    ("ehlo", b"MAIL FROM:<a\x00@x.test>", b"501 5.1.7 "),
    ("ehlo", b"MAIL FROM:<a\x01b@x.test>", b"501 5.1.7 "),
    ("ehlo", b"MAIL FROM:<a\x1b[2J@x.test>", b"501 5.1.7 "),
    ("ehlo", b"MAIL FROM:<a\tb@x.test>", b"501 5.1.7 "),
    ("ehlo", b"MAIL FROM:<a\x7f@x.test>", b"501 5.1.7 "),
    ("ehlo", b"MAIL FROM:<a\xc2\x85@x.test> SMTPUTF8", b"501 5.1.7 "),  # C1 control (NEL) in UTF-8
    ("ehlo", b"MAIL FROM:<\xe9@x.test>", b"500 5.5.2 "),  # 8-bit, not UTF-8
    ("ehlo", b"MAIL FROM:<\xc3\xa9@x.test>", b"553 5.6.7 "),  # UTF-8 without SMTPUTF8
    ("ehlo", b"MAIL FROM:<a@x.test> SIZE=10\x00", b"501 5.5.4 "),
    ("ehlo", b"MAIL FROM:<a@x.test> X\x00Y=1", b"501 5.5.4 "),
    ("ehlo", b"MAIL FROM:<a@x.test> BODY=8BIT\xc3\xa9MIME", b"501 5.5.4 "),
    ("ehlo", b"MAIL FROM:<a@x.test> \xe2\x80\xaeX=1", b"501 5.5.4 Bad parameter syntax: \\u202eX=1"),
    ("ehlo", b"MAIL FROM:<\xe2\x80\xae@@x.test> SMTPUTF8", b"501 5.1.7 Bad address syntax: <\\u202e@@x.test>"),
    ("mail", b"RCPT TO:<b\x00@far.example>", b"501 5.1.3 "),
    ("mail", b"RCPT TO:<b\x0b@far.example>", b"501 5.1.3 "),
    ("mail", b"RCPT TO:<\xff@far.example>", b"500 5.5.2 "),
    ("mail", b"RCPT TO:<\xc3\xa9@far.example>", b"553 5.6.7 "),
    ("mail", b"RCPT TO:<b@far.example> NOTIFY=\x00", b"501 5.5.4 "),
    ("mail", b"RCPT TO:<b@far.example> NOTIFY=NEVER\x80", b"500 5.5.2 "),
    ("none", b"EHLO a\x00b", b"501 5.5.4 "),
    ("none", b"HELO a\x1bb", b"501 5.5.4 "),
    ("ehlo", b"VRFY \x00root", b"501 5.5.4 "),
    ("ehlo", b"NOOP \x1b]0;pwned\x07", b"501 5.5.4 "),
    ("ehlo", b"\x00MAIL FROM:<a@x.test>", b"500 5.5.1 "),
]


async def test_control_and_8bit_bytes_in_every_argument_get_a_clear_refusal_and_the_relay_serves_on(
        tmp_path: Path) -> None:
    """A NUL in MAIL FROM once raised while the reply echoed it, and end the relay."""
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"}))
        for stage, line, want in HOSTILE_LINES:
            c = await RawClient.connect(relay.ports[0])
            await c.reply()
            if stage in ("ehlo", "mail"):
                await c.command(b"EHLO client.example")
            if stage == "mail":
                assert (await c.command(b"MAIL FROM:<a@example.org>"))[0].startswith(b"250")
            answer = await c.command(line)
            assert answer[0].startswith(want), (line, answer)
            assert_printable(answer)
            # The session goes on: the refused command changed nothing.
            after = b"RCPT TO:<ok@far.example>" if stage == "mail" else b"NOOP"
            assert (await c.command(after))[0].startswith(b"250"), line
            await c.aclose()
        await still_serving(relay.ports[0], hop, 1)
        nursery.cancel_scope.cancel()


async def test_an_unexpected_exception_in_a_session_ends_that_session_only(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A bug a client's RCPT reaches: that client gets 421 4.3.0; a session in the middle of its data finishes."""
    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        cfg = hostile(relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"}),
                      {"boom.test": lambda d: RuntimeError(f"injected failure routing {d}")})
        relay = await start_relay(nursery, cfg)
        other = await RawClient.connect(relay.ports[0], source="127.0.0.3")  # already in a transaction
        await other.reply()
        await other.command(b"EHLO other.example")
        await other.command(b"MAIL FROM:<other@example.org>")
        assert (await other.command(b"RCPT TO:<bystander@far.example>"))[0].startswith(b"250")
        assert (await other.command(b"DATA"))[0].startswith(b"354")
        await other.send(b"Subject: bystander\r\n\r\nfirst half\r\n")

        c = await RawClient.connect(relay.ports[0])
        await c.reply()
        await c.command(b"EHLO victim.example")
        # Pipelined: the replies already decided come first, then 421, then nothing.
        await c.send(b"MAIL FROM:<v@example.org>\r\nRCPT TO:<v@far.example>\r\nRCPT TO:<x@boom.test>\r\nNOOP\r\n")
        assert (await c.reply())[0].startswith(b"250 2.1.0")
        assert (await c.reply())[0].startswith(b"250 2.1.5")
        assert (await c.reply())[0].startswith(b"421 4.3.0")
        assert await c.closed() == b""

        failures = [r for r in caplog.records if r.name == "mta.smtpd" and r.levelno >= logging.ERROR]
        assert len(failures) == 1 and failures[0].exc_info is not None
        assert "127.0.0.1" in failures[0].getMessage() and "RuntimeError" in failures[0].getMessage()

        await other.send(b"second half\r\n.\r\n")
        assert (await other.reply())[0].startswith(b"250 2.0.0")
        (msg,) = await hop.wait_messages(1)
        assert msg.recipients == ["bystander@far.example"] and b"first half\r\nsecond half" in msg.data
        await still_serving(relay.ports[0], hop, 2)
        nursery.cancel_scope.cancel()


async def _relay_ends_with(cfg: Config, act: Callable[[Relay], Awaitable[None]]) -> BaseException:
    """Run the relay, do ``act``; return the exception that ended it (it must end by itself)."""
    ended: BaseException | None = None
    with trio.fail_after(30):
        try:
            async with trio.open_nursery() as nursery:
                relay = await start_relay(nursery, cfg)
                await act(relay)
                await trio.sleep_forever()  # the relay must end the nursery; fail_after bounds the wait
        except BaseException as exc:  # the point is what ended it
            ended = exc
    assert ended is not None
    return ended


def _holds(exc: BaseException, kind: type[BaseException]) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return any(_holds(e, kind) for e in exc.exceptions)
    return isinstance(exc, kind)


async def test_a_failed_fsync_reached_from_a_session_still_ends_the_process(tmp_path: Path) -> None:
    """Crash-only is kept: SyncFailed is not contained by the session's boundary."""
    cfg = hostile(relay_config(str(tmp_path), {"*": "discard"}),
                  {"fsync.test": lambda d: SyncFailed("fdatasync failed: [Errno 5] injected")})
    answers: list[bytes] = []

    async def act(relay: Relay) -> None:
        c = await RawClient.connect(relay.ports[0])
        await c.reply()
        await c.command(b"EHLO c.example")
        await c.command(b"MAIL FROM:<a@example.org>")
        await c.send(b"RCPT TO:<x@fsync.test>\r\n")
        answers.append(await c.closed())

    ended = await _relay_ends_with(cfg, act)
    assert _holds(ended, SyncFailed) and is_fatal(ended)
    assert b"421" not in b"".join(answers)  # no pretence of carrying on


async def test_a_real_fsync_failure_under_a_client_ends_the_process_before_its_250(tmp_path: Path) -> None:
    cfg = relay_config(str(tmp_path), {"*": "discard"})
    seen: list[bytes] = []

    async def act(relay: Relay) -> None:
        writer = relay.aspool.core.writer
        faulty = FaultyFileIO(writer.io)
        faulty.fault = Fault("fdatasync", 1, "EIO")
        writer.io = faulty
        c = await RawClient.connect(relay.ports[0])
        await c.reply()
        await c.command(b"EHLO c.example")
        await c.command(b"MAIL FROM:<a@example.org>")
        await c.command(b"RCPT TO:<x@far.example>")
        await c.command(b"DATA")
        await c.send(b"Subject: doomed\r\n\r\nbody\r\n.\r\n")
        seen.append(await c.closed())

    ended = await _relay_ends_with(cfg, act)
    assert _holds(ended, SyncFailed)
    assert not seen or b"250" not in seen[0]


# ------------------------------------------------------------------ section 1: outbound containment


async def test_an_exception_routing_a_queued_message_defers_it_with_the_reason(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        cfg = hostile(relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"}, retry='["1h"]'),
                      {"boom.test": lambda d: RuntimeError(f"injected failure routing {d}")})
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        # Queued as the spool would hold it after a config change: the session's check is behind it.
        await relay.aspool.enqueue("a@example.org", ["x@boom.test", "y@far.example"], b"Subject: q\r\n\r\nq\r\n")
        (deferred,) = await watch.wait_for(Status.DEFERRED, 1)
        assert deferred.recipient == "x@boom.test" and deferred.enhanced == "4.3.0"
        assert deferred.reply.startswith("local error: RuntimeError: injected failure routing boom.test")
        await watch.wait_for(Status.DELIVERED, 1, recipient="y@far.example")
        logged = [r for r in caplog.records if r.name == "mta.delivery" and r.levelno >= logging.ERROR]
        assert len(logged) == 1 and logged[0].exc_info is not None and "x@boom.test" in logged[0].getMessage()
        await still_serving(relay.ports[0], hop, 2)
        nursery.cancel_scope.cancel()


async def test_a_failed_fsync_reached_from_delivery_still_ends_the_process(tmp_path: Path) -> None:
    cfg = hostile(relay_config(str(tmp_path), {"*": "discard"}),
                  {"fsync.test": lambda d: SyncFailed("fdatasync failed: [Errno 5] injected")})

    async def act(relay: Relay) -> None:
        await relay.aspool.enqueue("a@example.org", ["x@fsync.test"], b"Subject: q\r\n\r\nq\r\n")

    ended = await _relay_ends_with(cfg, act)
    assert _holds(ended, SyncFailed)


async def test_an_outcome_observer_that_raises_stops_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"}))

        def broken(qid: str, outcome: object) -> None:
            raise KeyError("an observer's bug")

        relay.scheduler.observers.insert(0, broken)
        await still_serving(relay.ports[0], hop, 1)
        watch = DeliveryWatch(relay)
        await still_serving(relay.ports[0], hop, 2)
        await watch.wait_for(Status.DELIVERED, 1)
        assert any(r.name == "mta.delivery" and r.exc_info for r in caplog.records)
        nursery.cancel_scope.cancel()


class FailsOnce:
    """The relay's own transport, except that its first batch raises: a transport bug hit once."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.failed = False

    async def deliver(self, destination: Destination, jobs: Sequence[Job],
                      on_outcome: OnOutcome | None = None) -> list[list[Outcome]]:
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected transport bug")
        return await self.inner.deliver(destination, jobs, on_outcome)


async def test_a_transport_that_raises_defers_its_batch_and_delivery_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"},
                                                        retry='["1h"]'))
        watch = DeliveryWatch(relay)
        relay.scheduler.transports = {**relay.scheduler.transports,
                                      "smtp": FailsOnce(relay.scheduler.transports["smtp"])}
        await relay.aspool.enqueue("a@example.org", ["unlucky@far.example"], b"Subject: q\r\n\r\nq\r\n")
        (deferred,) = await watch.wait_for(Status.DEFERRED, 1)
        assert deferred.reply == "local error: RuntimeError: injected transport bug"
        assert any(r.name == "mta.delivery" and r.exc_info and f"smtp:127.0.0.1:{port}" in r.getMessage()
                   for r in caplog.records)
        await still_serving(relay.ports[0], hop, 1)  # the same destination, not backed off
        nursery.cancel_scope.cancel()


async def test_a_dsn_that_cannot_be_built_defers_the_bounce_instead_of_losing_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(**kwargs: object) -> bytes:
        raise UnicodeError("injected DSN bug")

    monkeypatch.setattr(dsnmod, "build_dsn", broken)
    async with trio.open_nursery() as nursery:
        hop = NextHop(lambda stage, value: Reply(550, "5.1.1", "no such user")
                      if stage == "rcpt" and value == "gone@far.example" else None)
        port = await hop.start(nursery)
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"},
                                                        retry='["1h"]'))
        watch = DeliveryWatch(relay)
        await relay.aspool.enqueue("a@example.org", ["gone@far.example"], b"Subject: q\r\n\r\nq\r\n")
        (deferred,) = await watch.wait_for(Status.DEFERRED, 1)
        assert deferred.reply.startswith("local error: UnicodeError: injected DSN bug (building the DSN); was: ")
        assert "no such user" in deferred.reply and watch.count(Status.BOUNCED) == 0
        await still_serving(relay.ports[0], hop, 1)
        nursery.cancel_scope.cancel()


def test_is_fatal_tells_spool_failures_from_everything_else(tmp_path: Path) -> None:
    from spool.engine.spool import Spool

    assert is_fatal(SyncFailed("x"))
    try:
        try:
            raise SyncFailed("fdatasync failed")
        except SyncFailed as inner:
            raise RuntimeError("while writing") from inner
    except RuntimeError as outer:
        assert is_fatal(outer)
    assert is_fatal(ExceptionGroup("g", [ValueError("a"), SyncFailed("b")]))
    for harmless in (ValueError("bad bytes"), RuntimeError("bug"), KeyError("k"), SpoolError("not found"),
                     OSError(errno.ECONNRESET, "reset"), ExceptionGroup("g", [ValueError("a")])):
        assert not is_fatal(harmless)
    sp = Spool.open(os.fspath(tmp_path))
    try:
        assert not is_fatal(ValueError("x"), sp)
        sp.writer.poisoned = OSError(errno.EIO, "I/O error")  # what a failed write or fsync leaves behind
        assert is_fatal(ValueError("anything, once the writer is poisoned"), sp)
    finally:
        sp.writer.poisoned = None
        sp.close()


# ------------------------------------------------------------------ section 6: postmaster


async def test_postmaster_is_accepted_from_anyone_and_reaches_the_postmaster_maildir(tmp_path: Path) -> None:
    """RFC 5321 §4.5.1; the default postmaster is postmaster@<hostname>, delivered into var/maildir."""
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"},
                           spool_extra='[relay]\nmynetworks = ["127.0.0.1/32"]\n')
        relay = await start_relay(nursery, cfg)
        watch = DeliveryWatch(relay)
        c = await RawClient.connect(relay.ports[0], source="127.0.0.2")  # outside mynetworks
        await c.reply()
        await c.command(b"EHLO outsider.example")
        assert (await c.command(b"MAIL FROM:<outsider@example.org>"))[0].startswith(b"250")
        assert (await c.command(b"RCPT TO:<someone@far.example>"))[0].startswith(b"554 5.7.1")
        assert (await c.command(b"RCPT TO:<postmaster@other.example>"))[0].startswith(b"554 5.7.1")
        assert (await c.command(b"RCPT TO:<postmaster>"))[0].startswith(b"250 2.1.5")
        assert (await c.command(b"RCPT TO:<PostMaster@Relay.Test>"))[0].startswith(b"250 2.1.5")
        assert (await c.command(b"DATA"))[0].startswith(b"354")
        assert (await c.command(b"Subject: to the postmaster\r\n\r\nhello\r\n."))[0].startswith(b"250 2.0.0")
        await c.aclose()
        outcomes = await watch.wait_for(Status.DELIVERED, 1)
        assert {o.recipient for o in outcomes} == {"postmaster@relay.test"}
        box = tmp_path / "var" / "maildir" / "postmaster" / "new"
        (name,) = os.listdir(box)
        assert b"to the postmaster" in (box / name).read_bytes()
        await still_serving(relay.ports[0], hop, 1)
        nursery.cancel_scope.cancel()


async def test_a_configured_postmaster_is_routed_like_any_other_address(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        cfg = relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"},
                           spool_extra='[relay]\nmynetworks = ["127.0.0.1/32"]\npostmaster = "ops@far.example"\n')
        relay = await start_relay(nursery, cfg)
        c = await RawClient.connect(relay.ports[0], source="127.0.0.2")
        await c.reply()
        await c.command(b"EHLO outsider.example")
        await c.command(b"MAIL FROM:<>")
        assert (await c.command(b"RCPT TO:<postmaster>"))[0].startswith(b"250 2.1.5")
        assert (await c.command(b"DATA"))[0].startswith(b"354")
        assert (await c.command(b"Subject: abuse report\r\n\r\nhello\r\n."))[0].startswith(b"250 2.0.0")
        (msg,) = await hop.wait_messages(1)
        assert msg.recipients == ["ops@far.example"] and b"abuse report" in msg.data
        await still_serving(relay.ports[0], hop, 2)
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ section 6: NUL inside DATA

NUL_PAYLOADS = [
    b"Subject: first\r\n\r\nfirst body\r\n\x00.\r\n",  # a next hop that drops NULs would see CRLF.CRLF here
    b"Subject: first\r\n\r\nfirst body\r\n\x00\x00.\r\n",
    b"Subject: first\r\n\r\nfirst\x00body\r\n",
]
SMUGGLED = (b"MAIL FROM:<evil@example.org>\r\nRCPT TO:<victim@far.example>\r\nDATA\r\n"
            b"Subject: smuggled\r\n\r\nsmuggled body\r\n.\r\n")


@pytest.mark.parametrize("normalize", [False, True])
async def test_a_nul_in_data_refuses_the_message_so_nul_dot_never_ends_one_anywhere(
        tmp_path: Path, normalize: bool) -> None:
    async with trio.open_nursery() as nursery:
        hop = NextHop()
        port = await hop.start(nursery)
        extra = "normalize_bare_lf = true\n" if normalize else ""
        relay = await start_relay(nursery, relay_config(str(tmp_path), {"*": f"smtp://127.0.0.1:{port}"}, extra))
        watch = DeliveryWatch(relay)
        for payload in NUL_PAYLOADS:
            c = await RawClient.connect(relay.ports[0])
            await c.reply()
            await c.command(b"EHLO smuggler.example")
            await c.command(b"MAIL FROM:<a@example.org>")
            await c.command(b"RCPT TO:<first@far.example>")
            assert (await c.command(b"DATA"))[0].startswith(b"354")
            await c.send(payload + SMUGGLED)
            answer = await c.reply()
            assert answer[0].startswith(b"550 5.6.0"), (payload, answer)
            await c.send(b"QUIT\r\n")
            rest = await c.closed()  # nothing was answered for the would-be second transaction
            assert rest.startswith(b"221 ") and rest.count(b"\r\n") == 1, rest
        await still_serving(relay.ports[0], hop, 1)
        assert [m.recipients for m in hop.messages] == [["fresh1@far.example"]]
        await watch.wait_for(Status.DELIVERED, 1)
        assert [o.recipient for _, o in watch.outcomes] == ["fresh1@far.example"]
        nursery.cancel_scope.cancel()
