"""One milter conversation across one SMTP session, with no I/O: what to send at each stage, what may come back.

Theory of operation: the relay walks the stages in Postfix's order
(negotiation, connect, HELO, MAIL, RCPT..., DATA, each header, end of
headers, body chunks, end of message; ABORT between messages, QUIT at the
end). ``send`` gives the bytes for a stage (its macros first) or nothing when
the filter asked not to see that stage or is done with the message. The
replies that come back are checked against ``ALLOWED`` (stage -> replies it
may carry) and the actions negotiated; anything else is a
``MilterProtocolError``, and the caller applies its failure default. A
verdict ends the stage; changes and progress notes come before the verdict
of the end of message.

State that outlives a stage: a filter that answered ``Accept`` at connect or
HELO is asked nothing more in this session, one that answered it at a
message stage nothing more about that message (``asks``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Final

from mta.milter import protocol as p
from mta.milter.changes import (
    Accept,
    AddHeader,
    AddRecipient,
    ChangeHeader,
    ChangeSender,
    Continue,
    CustomReply,
    DeleteRecipient,
    Discard,
    InsertHeader,
    Negotiated,
    Progress,
    Quarantine,
    Reject,
    ReplaceBody,
    Response,
    Skip,
    Tempfail,
)
from mta.milter.protocol import MilterProtocolError


class Stage(enum.Enum):
    NEGOTIATE = "negotiate"
    CONNECT = "connect"
    HELO = "helo"
    MAIL = "mail"
    RCPT = "rcpt"
    DATA = "data"
    HEADER = "header"
    EOH = "eoh"
    BODY = "body"
    EOM = "eom"


_VERDICTS: Final = (Accept, Continue, Reject, Tempfail, CustomReply)
_MESSAGE: Final = (*_VERDICTS, Discard, Progress)
_CHANGES: Final = (AddHeader, InsertHeader, ChangeHeader, ReplaceBody, ChangeSender, AddRecipient, DeleteRecipient,
                   Quarantine)
# The one table: which replies each stage may carry. Changes only at the end of the message (the protocol's rule).
ALLOWED: Final[Mapping[Stage, tuple[type, ...]]] = {
    Stage.NEGOTIATE: (Negotiated,),
    Stage.CONNECT: (*_VERDICTS, Progress),
    Stage.HELO: (*_VERDICTS, Progress),
    Stage.MAIL: _MESSAGE,
    Stage.RCPT: _MESSAGE,
    Stage.DATA: _MESSAGE,
    Stage.HEADER: _MESSAGE,
    Stage.EOH: _MESSAGE,
    Stage.BODY: (*_MESSAGE, Skip),
    Stage.EOM: (*_MESSAGE, *_CHANGES),
}
# The action flag a change needs (negotiated, or the change is a protocol error).
ACTION_OF: Final[Mapping[type, int]] = {
    AddHeader: p.F_ADDHDRS, InsertHeader: p.F_ADDHDRS, ChangeHeader: p.F_CHGHDRS, ReplaceBody: p.F_CHGBODY,
    ChangeSender: p.F_CHGFROM, AddRecipient: p.F_ADDRCPT | p.F_ADDRCPT_PAR, DeleteRecipient: p.F_DELRCPT,
    Quarantine: p.F_QUARANTINE,
}
COMMAND: Final[Mapping[Stage, bytes]] = {
    Stage.CONNECT: p.C_CONNECT, Stage.HELO: p.C_HELO, Stage.MAIL: p.C_MAIL, Stage.RCPT: p.C_RCPT,
    Stage.DATA: p.C_DATA, Stage.HEADER: p.C_HEADER, Stage.EOH: p.C_EOH, Stage.BODY: p.C_BODY,
    Stage.EOM: p.C_BODYEOB,
}
NOT_WANTED: Final[Mapping[Stage, int]] = {
    Stage.CONNECT: p.P_NOCONNECT, Stage.HELO: p.P_NOHELO, Stage.MAIL: p.P_NOMAIL, Stage.RCPT: p.P_NORCPT,
    Stage.DATA: p.P_NODATA, Stage.HEADER: p.P_NOHDRS, Stage.EOH: p.P_NOEOH, Stage.BODY: p.P_NOBODY,
}
NO_REPLY: Final[Mapping[Stage, int]] = {
    Stage.CONNECT: p.P_NR_CONN, Stage.HELO: p.P_NR_HELO, Stage.MAIL: p.P_NR_MAIL, Stage.RCPT: p.P_NR_RCPT,
    Stage.DATA: p.P_NR_DATA, Stage.HEADER: p.P_NR_HDR, Stage.EOH: p.P_NR_EOH, Stage.BODY: p.P_NR_BODY,
}
# The macros sent at each stage unless the filter asks for others: Postfix's milter_*_macros defaults.
DEFAULT_MACROS: Final[Mapping[bytes, tuple[str, ...]]] = {
    p.C_CONNECT: ("j", "_", "v", "daemon_name", "daemon_addr", "client_addr", "client_port", "client_name",
                  "client_ptr"),
    p.C_HELO: ("tls_version", "cipher", "cipher_bits", "cert_subject", "cert_issuer"),
    p.C_MAIL: ("i", "auth_type", "auth_authen", "auth_author", "mail_addr", "mail_host", "mail_mailer"),
    p.C_RCPT: ("i", "rcpt_addr", "rcpt_host", "rcpt_mailer"),
    p.C_DATA: ("i",),
    p.C_EOH: ("i",),
    p.C_BODYEOB: ("i",),
}
_MESSAGE_STAGES: Final = frozenset({Stage.MAIL, Stage.RCPT, Stage.DATA, Stage.HEADER, Stage.EOH, Stage.BODY,
                                    Stage.EOM})


class Conversation:
    """The protocol state of one filter for one SMTP session.

    ``awaiting``: the stage whose verdict is still to come (None: nothing is
    owed). ``negotiated``: the filter's answer to the negotiation, once in.
    """

    def __init__(self, actions: int = p.ALL_ACTIONS) -> None:
        self.offered_actions = actions
        self.negotiated: Negotiated | None = None
        self.awaiting: Stage | None = None
        self.done_session = False  # Accept at connect or HELO
        self.done_message = False  # Accept (or Discard) at a message stage
        self.skip_body = False
        self._decoder = p.Decoder()

    def start(self) -> bytes:
        self.awaiting = Stage.NEGOTIATE
        return p.optneg(self.offered_actions)

    def _flags(self) -> int:
        assert self.negotiated is not None
        return self.negotiated.protocol

    def asks(self, stage: Stage) -> bool:
        """Whether the filter is to hear of ``stage`` at all."""
        if self.negotiated is None or self.done_session:
            return False
        if stage in _MESSAGE_STAGES and self.done_message:
            return False
        if stage is Stage.BODY and self.skip_body:
            return False
        flag = NOT_WANTED.get(stage, 0)
        return not self._flags() & flag

    def send(self, stage: Stage, packets: Sequence[bytes], values: Mapping[str, str]) -> bytes:
        """The bytes for ``stage`` (b"" if the filter does not hear of it): its macros, then ``packets``.

        Raises MilterProtocolError if a verdict is still owed (the caller's bug or a desynchronised filter).
        """
        if self.awaiting is not None:
            raise MilterProtocolError(f"{stage.value} sent while the reply to {self.awaiting.value} is owed")
        if not self.asks(stage):
            return b""
        command = COMMAND[stage]
        out = bytearray()
        assert self.negotiated is not None
        names = self.negotiated.macros.get(command, DEFAULT_MACROS.get(command, ()))
        chosen = {(n if len(n) == 1 else "{" + n + "}"): values[n] for n in names if n in values}
        if chosen:
            out += p.macros(command, chosen)
        for packet in packets:
            out += packet
        if stage is Stage.EOM or not self._flags() & NO_REPLY[stage]:
            self.awaiting = stage
        return bytes(out)

    def receive_data(self, data: bytes) -> None:
        self._decoder.receive_data(data)

    def next_event(self) -> Response | None:
        """The next reply the filter sent, checked; None: more bytes are needed.

        Raises MilterProtocolError for a reply the stage may not carry, or a change not negotiated.
        """
        packet = self._decoder.next_packet()
        if packet is None:
            return None
        stage = self.awaiting
        if stage is None:
            raise MilterProtocolError(f"reply {packet.command!r} when none was owed")
        reply = p.parse_reply(packet)
        if not isinstance(reply, ALLOWED[stage]):
            raise MilterProtocolError(f"{type(reply).__name__} is not a reply to {stage.value}")
        if isinstance(reply, Negotiated):
            self._negotiate(reply)
        elif isinstance(reply, Skip):
            if not self._flags() & p.P_SKIP:
                raise MilterProtocolError("SKIP was not negotiated")
            self.skip_body = True
            self.awaiting = None
        elif isinstance(reply, _CHANGES):
            assert self.negotiated is not None
            if not self.negotiated.actions & ACTION_OF[type(reply)]:
                raise MilterProtocolError(f"{type(reply).__name__} was not negotiated")
        elif not isinstance(reply, Progress):
            self.awaiting = None
            if isinstance(reply, Accept | Discard):
                if stage in (Stage.CONNECT, Stage.HELO):
                    self.done_session = True
                else:
                    self.done_message = True
        return reply

    def _negotiate(self, reply: Negotiated) -> None:
        if reply.actions & ~self.offered_actions:
            raise MilterProtocolError(f"filter wants actions {reply.actions:#x} beyond those offered")
        if reply.protocol & ~p.OFFERED_PROTOCOL & 0xFFFFF:
            raise MilterProtocolError(f"filter wants protocol steps {reply.protocol:#x} not offered")
        self.negotiated = reply
        self.awaiting = None

    def new_message(self) -> bytes:
        """Between messages: ``ABORT`` (no reply) so the filter forgets the last one; the message state resets."""
        self.done_message = False
        self.skip_body = False
        if self.negotiated is None or self.done_session or self.awaiting is not None:
            return b""
        return p.packet(p.C_ABORT)

    def quit(self) -> bytes:
        return p.packet(p.C_QUIT)
