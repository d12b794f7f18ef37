"""One milter for one SMTP session, over trio: a TCP or unix socket around ``mta.milter.session.Conversation``.

Why a connection per session: a milter's conversation is the session's
(connect, HELO, then each message), and a filter that hangs then holds up
only the session that waits on it. Every wait has a deadline (the connect
and negotiation, each step's reply, a message's whole content), and every
way it can fail (refused, reset, silent, a packet that breaks the protocol)
is one exception, ``MilterFailed``, for the caller's failure default.

Resource handling: ``aclose`` closes the socket; the caller calls it when the
session ends (QUIT is sent first, without waiting: crash-only, the milter
copes with a vanished peer anyway).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import trio

from mta.config.filters import MilterAddress
from mta.milter.changes import Change, Continue, Negotiated, Progress, Skip, Verdict
from mta.milter.protocol import MilterProtocolError
from mta.milter.session import Conversation, Stage

READ_SIZE = 65536


class MilterFailed(Exception):
    """The milter cannot be asked now: down, too slow, gone, or it broke the protocol. ``reason`` names which."""

    def __init__(self, address: MilterAddress, reason: str, detail: str = "") -> None:
        self.address = address
        self.reason = reason
        self.detail = detail
        super().__init__(f"milter {address}: {reason}" + (f" ({detail})" if detail else ""))


@attrs.frozen
class MilterLimits:
    connect_timeout: float
    command_timeout: float
    message_timeout: float


@attrs.frozen
class Answer:
    """A stage's outcome from one milter: its verdict (None: it was not asked or owes no reply) and its changes."""

    verdict: Verdict | None
    changes: tuple[Change, ...] = ()


class MilterClient:
    def __init__(self, address: MilterAddress, limits: MilterLimits) -> None:
        self.address = address
        self.limits = limits
        self.conv = Conversation()
        self._stream: trio.abc.Stream | None = None

    @property
    def negotiated(self) -> Negotiated | None:
        return self.conv.negotiated

    async def open(self) -> None:
        """Connect and negotiate, within ``connect_timeout``. Raises MilterFailed."""
        deadline = trio.current_time() + self.limits.connect_timeout
        try:
            with trio.fail_at(deadline):
                if self.address.path:
                    self._stream = await trio.open_unix_socket(self.address.path)
                else:
                    self._stream = await trio.open_tcp_stream(self.address.host, self.address.port)
        except trio.TooSlowError:
            raise MilterFailed(self.address, "connect_timeout") from None
        except OSError as exc:
            raise MilterFailed(self.address, "down", exc.strerror or str(exc)) from None
        await self._send(self.conv.start())
        await self._answer(Stage.NEGOTIATE, deadline)

    async def ask(self, stage: Stage, packets: Sequence[bytes], values: Mapping[str, str],
                  message_deadline: float) -> Answer:
        """Send ``stage`` and wait for its verdict, within a command's time and ``message_deadline``.

        Raises MilterFailed.
        """
        try:
            data = self.conv.send(stage, packets, values)
        except MilterProtocolError as exc:
            raise MilterFailed(self.address, "protocol", str(exc)) from None
        if not data:
            return Answer(None)
        await self._send(data)
        if self.conv.awaiting is None:
            return Answer(None)
        return await self._answer(stage, message_deadline)

    async def new_message(self) -> None:
        data = self.conv.new_message()
        if data:
            await self._send(data)

    async def _send(self, data: bytes) -> None:
        assert self._stream is not None
        try:
            with trio.fail_after(self.limits.command_timeout):
                await self._stream.send_all(data)
        except trio.TooSlowError:
            raise MilterFailed(self.address, "timeout", "sending") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise MilterFailed(self.address, "gone", str(exc) or type(exc).__name__) from None

    async def _answer(self, stage: Stage, limit: float) -> Answer:
        assert self._stream is not None
        changes: list[Change] = []
        deadline = min(trio.current_time() + self.limits.command_timeout, limit)
        while True:
            try:
                reply = self.conv.next_event()
            except MilterProtocolError as exc:
                raise MilterFailed(self.address, "protocol", str(exc)) from None
            if reply is None:
                data = await self._receive(deadline, stage)
                self.conv.receive_data(data)
            elif isinstance(reply, Progress):
                deadline = min(trio.current_time() + self.limits.command_timeout, limit)
            elif isinstance(reply, Negotiated):
                return Answer(None)
            elif isinstance(reply, Skip):
                return Answer(Continue())
            elif isinstance(reply, Verdict):
                return Answer(reply, tuple(changes))
            else:
                changes.append(reply)

    async def _receive(self, deadline: float, stage: Stage) -> bytes:
        assert self._stream is not None
        try:
            with trio.fail_at(deadline):
                data = await self._stream.receive_some(READ_SIZE)
        except trio.TooSlowError:
            raise MilterFailed(self.address, "timeout", f"no reply to {stage.value}") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise MilterFailed(self.address, "gone", str(exc) or type(exc).__name__) from None
        if not data:
            raise MilterFailed(self.address, "gone", f"closed at {stage.value}")
        return bytes(data)

    async def aclose(self) -> None:
        """QUIT (not waited for) and close. Never raises for a milter already gone."""
        stream, self._stream = self._stream, None
        if stream is None:
            return
        if self.conv.negotiated is not None and self.conv.awaiting is None:
            with trio.move_on_after(0.5):
                try:
                    await stream.send_all(self.conv.quit())
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
        await trio.aclose_forcefully(stream)
