"""rspamd over its own HTTP protocol (``POST /checkv2``), mapped onto the milter's verdicts and changes.

Why beside the milter: rspamd's normal worker answers HTTP directly (as Exim,
Haraka and maddy ask it), without its proxy worker in between. The envelope
goes in request headers (``From``, one ``Rcpt`` each, ``IP``, ``Helo``,
``Hostname``, ``Queue-Id``, ``User``), the message is the request's body, and
the JSON answer's ``action`` and ``milter`` block become the same records a
milter's replies do (``mta.milter.changes``), applied by the same code:

- ``reject``: ``554 5.7.1`` with rspamd's ``messages.smtp_message`` (or
  "Spam message rejected"); ``soft reject`` and ``greylist``: ``451 4.7.1``;
- ``add header``: ``X-Spam: Yes`` added (rspamd's proxy worker does the same in
  milter mode); ``rewrite subject``: the Subject: changed to rspamd's ``subject``;
- the ``milter`` block: ``add_headers`` (a value, a ``{value, order}`` table
  or a list of them), ``remove_headers`` (``{name: n}``: the n-th, 0 all),
  ``change_from``, ``add_rcpt``, ``del_rcpt``, and ``reject = "discard"``.

Raises ``RspamdFailed`` for every way the exchange can fail, for the
caller's failure default.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import attrs
import h11
import trio

from mta.milter.apply import Message
from mta.milter.changes import (
    AddHeader,
    AddRecipient,
    Change,
    ChangeHeader,
    ChangeSender,
    Continue,
    CustomReply,
    DeleteRecipient,
    Discard,
    InsertHeader,
    Verdict,
)
from mta.smtp.common import Reply

MAX_ANSWER = 1 << 20
R_SPAM = Reply(554, "5.7.1", "Spam message rejected")
R_LATER = Reply(451, "4.7.1", "Try again later")
SPAM_HEADER = ("X-Spam", "Yes")


class RspamdFailed(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"rspamd: {reason}" + (f" ({detail})" if detail else ""))


@attrs.frozen
class Envelope:
    """What rspamd is told beside the message."""

    client_ip: str
    helo: str
    hostname: str
    queue_id: str
    user: str | None = None


@attrs.frozen
class Scan:
    verdict: Verdict
    changes: tuple[Change, ...]
    action: str
    score: float | None


async def check(url: str, msg: Message, env: Envelope, timeout: float) -> Scan:
    """Ask rspamd about ``msg`` and read its answer as a verdict and changes. Raises RspamdFailed."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None  # the config's HttpUrl saw to it
    headers = [("Host", f"{parts.hostname}:{parts.port}"), ("From", msg.sender or "<>"), ("IP", env.client_ip),
               ("Helo", env.helo or "unknown"), ("Hostname", "unknown"), ("Queue-Id", env.queue_id),
               ("MTA-Name", env.hostname), ("Connection", "close")]
    headers += [("Rcpt", r) for r in msg.recipients]
    if env.user:
        headers.append(("User", env.user))
    data = msg.to_bytes()
    headers.append(("Content-Length", str(len(data))))
    try:
        with trio.fail_after(timeout):
            status, body = await _post(parts.hostname, parts.port, (parts.path or "") + "/checkv2", headers, data)
    except trio.TooSlowError:
        raise RspamdFailed("timeout") from None
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError) as exc:
        raise RspamdFailed("down", str(exc) or type(exc).__name__) from None
    if status != 200:
        raise RspamdFailed("http_error", f"status {status}")
    try:
        answer = json.loads(body)
    except ValueError:
        raise RspamdFailed("bad_answer", "not JSON") from None
    if not isinstance(answer, dict) or not isinstance(answer.get("action"), str):
        raise RspamdFailed("bad_answer", "no action")
    return read_answer(answer, msg)


async def _post(host: str, port: int, target: str, headers: list[tuple[str, str]], data: bytes) -> tuple[int, bytes]:
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_ANSWER)
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(conn.send(h11.Request(method="POST", target=target, headers=headers))
                              + conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage()))
        status = 0
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_ANSWER:
                    raise h11.RemoteProtocolError("answer too large")
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return status, bytes(body)


def read_answer(answer: dict[str, Any], msg: Message) -> Scan:
    """rspamd's JSON as a verdict and changes (the module docstring has the mapping)."""
    action = str(answer["action"])
    score = answer.get("score")
    text = _smtp_message(answer)
    verdict: Verdict = Continue()
    changes: list[Change] = []
    if action == "reject":
        verdict = CustomReply(Reply(R_SPAM.code, R_SPAM.enhanced, text or R_SPAM.text))
    elif action in ("soft reject", "greylist"):
        verdict = CustomReply(Reply(R_LATER.code, R_LATER.enhanced, text or R_LATER.text))
    elif action == "add header":
        changes.append(AddHeader(*SPAM_HEADER))
    elif action == "rewrite subject" and isinstance(answer.get("subject"), str):
        changes.append(ChangeHeader(1, "Subject", answer["subject"]))
    block = answer.get("milter")
    if isinstance(block, dict):
        changes += _milter_block(block, msg)
        if block.get("reject") == "discard" and isinstance(verdict, Continue):
            verdict = Discard()
    return Scan(verdict, tuple(changes), action, score if isinstance(score, int | float) else None)


def _smtp_message(answer: dict[str, Any]) -> str:
    messages = answer.get("messages")
    text = messages.get("smtp_message") if isinstance(messages, dict) else None
    return "".join(ch for ch in text if ch.isprintable())[:400] if isinstance(text, str) else ""


def _milter_block(block: dict[str, Any], msg: Message) -> Iterator[Change]:
    removes = block.get("remove_headers")
    if isinstance(removes, dict):
        for name, which in removes.items():
            count = sum(1 for f in msg.fields if f.name.lower() == str(name).lower())
            if not isinstance(which, int) or which == 0:
                yield from (ChangeHeader(1, str(name), "") for _ in range(count))
            elif which < 0 and count + which >= 0:
                yield ChangeHeader(count + which + 1, str(name), "")
            elif 0 < which <= count:
                yield ChangeHeader(which, str(name), "")
    adds = block.get("add_headers")
    if isinstance(adds, dict):
        for name, spec in adds.items():
            for one in spec if isinstance(spec, list) else [spec]:
                yield from _one_header(str(name), one)
    if isinstance(block.get("change_from"), str):
        yield ChangeSender(block["change_from"].strip("<>"))
    for address in _strings(block.get("add_rcpt")):
        yield AddRecipient(address.strip("<>"))
    for address in _strings(block.get("del_rcpt")):
        yield DeleteRecipient(address.strip("<>"))


def _one_header(name: str, spec: object) -> Iterator[Change]:
    if isinstance(spec, str):
        yield AddHeader(name, spec)
    elif isinstance(spec, dict) and isinstance(spec.get("value"), str):
        order = spec.get("order")
        if isinstance(order, int) and order >= 0:
            yield InsertHeader(order, name, spec["value"])
        else:
            yield AddHeader(name, spec["value"])


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, str)]
    return []
