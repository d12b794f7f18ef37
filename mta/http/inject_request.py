"""The body of ``POST /api/inject/v1`` as KumoMTA defines it, read into frozen records.

Fields (KumoMTA's names, so its clients work unchanged): ``envelope_sender``,
``content`` (a whole RFC 5322 message as a string, or a builder object:
``text_body``, ``html_body``, ``amp_html_body``, ``headers``, ``attachments``,
``from``, ``subject``, ``reply_to``), ``recipients`` (``email``, ``name``,
``substitutions``, ``metadata``), global ``substitutions``,
``template_dialect`` (``Jinja``, the default, or ``Static``: no templating),
``deferred_generation`` (``false`` only: every message is made before the
answer) and ``trace_headers`` (``received_header``). A field this relay does
not know is refused with its name, never ignored: a client must not believe
a setting took effect.

``parse_request`` raises ``BadInjection`` (answered ``400`` with its text).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["Attachment", "BadInjection", "Builder", "InjectRequest", "Mailbox", "Recipient", "parse_request"]

DIALECTS = ("Jinja", "Static")
MAX_KEY = 255  # Idempotency-Key, in characters


class BadInjection(ValueError):
    """The request cannot be taken as it stands; the text says what to change (answered 400)."""


@attrs.frozen
class Mailbox:
    email: str
    name: str | None = None


@attrs.frozen
class Attachment:
    content_type: str
    data: bytes
    file_name: str | None = None
    content_id: str | None = None  # set: inline, in a multipart/related beside the HTML


@attrs.frozen
class Builder:
    """``content`` as an object: the message is built (MIME, by ``mta.http.compose``)."""

    text_body: str | None = None
    html_body: str | None = None
    amp_html_body: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    attachments: tuple[Attachment, ...] = ()
    from_: Mailbox | None = None
    subject: str | None = None
    reply_to: Mailbox | None = None


@attrs.frozen
class Recipient:
    email: str
    name: str | None = None
    substitutions: Mapping[str, Any] = attrs.field(factory=dict, hash=False)
    metadata: Mapping[str, Any] = attrs.field(factory=dict, hash=False)


@attrs.frozen
class InjectRequest:
    envelope_sender: str
    content: str | Builder
    recipients: tuple[Recipient, ...]
    substitutions: Mapping[str, Any] = attrs.field(factory=dict, hash=False)
    templated: bool = True
    received_header: bool = True


TOP = {"envelope_sender", "content", "recipients", "substitutions", "template_dialect", "deferred_generation",
       "trace_headers"}
BUILDER = {"text_body", "html_body", "amp_html_body", "headers", "attachments", "from", "subject", "reply_to"}
RECIPIENT = {"email", "name", "substitutions", "metadata"}
ATTACHMENT = {"data", "base64", "content_type", "content_id", "file_name"}
TRACE = {"received_header"}


def parse_request(body: bytes, max_recipients: int) -> InjectRequest:
    try:
        raw = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadInjection(f"the body is not JSON: {exc}") from None
    top = _object(raw, "the body")
    _known(top, TOP, "")
    if top.get("deferred_generation", False) is not False:
        raise BadInjection("deferred_generation: only false is supported (every message is made, and durable, "
                           "before the answer)")
    dialect = top.get("template_dialect", "Jinja")
    if dialect not in DIALECTS:
        raise BadInjection(f"template_dialect: {dialect!r} is not supported (one of {', '.join(DIALECTS)})")
    trace = _object(top.get("trace_headers", {}), "trace_headers")
    _known(trace, TRACE, "trace_headers.")
    recipients = _list(top.get("recipients"), "recipients")
    if not recipients:
        raise BadInjection("recipients: at least one is needed")
    if len(recipients) > max_recipients:
        raise BadInjection(f"recipients: {len(recipients)} are more than this relay takes in one request "
                           f"({max_recipients})")
    return InjectRequest(
        envelope_sender=_text(top.get("envelope_sender"), "envelope_sender", empty=True),
        content=_content(top.get("content")),
        recipients=tuple(_recipient(r, i) for i, r in enumerate(recipients)),
        substitutions=_object(top.get("substitutions", {}), "substitutions"),
        templated=dialect == "Jinja",
        received_header=_bool(trace.get("received_header", True), "trace_headers.received_header"))


def _content(raw: object) -> str | Builder:
    if isinstance(raw, str):
        if not raw:
            raise BadInjection("content: an empty message")
        return raw
    if not isinstance(raw, dict):
        raise BadInjection("content: a message string or a builder object is needed")
    _known(raw, BUILDER, "content.")
    headers = _object(raw.get("headers", {}), "content.headers")
    builder = Builder(
        text_body=_maybe_text(raw.get("text_body"), "content.text_body"),
        html_body=_maybe_text(raw.get("html_body"), "content.html_body"),
        amp_html_body=_maybe_text(raw.get("amp_html_body"), "content.amp_html_body"),
        headers=tuple((_header_name(k), _text(v, f"content.headers.{k}", empty=True)) for k, v in headers.items()),
        attachments=tuple(_attachment(a, i) for i, a in enumerate(_list(raw.get("attachments", []),
                                                                         "content.attachments"))),
        from_=_mailbox(raw.get("from"), "content.from"),
        subject=_maybe_text(raw.get("subject"), "content.subject"),
        reply_to=_mailbox(raw.get("reply_to"), "content.reply_to"))
    if builder.text_body is None and builder.html_body is None and builder.amp_html_body is None \
            and not builder.attachments:
        raise BadInjection("content: a builder needs text_body, html_body, amp_html_body or attachments")
    return builder


def _recipient(raw: object, i: int) -> Recipient:
    where = f"recipients[{i}]"
    obj = _object(raw, where)
    _known(obj, RECIPIENT, where + ".")
    return Recipient(email=_text(obj.get("email"), where + ".email"),
                     name=_maybe_text(obj.get("name"), where + ".name"),
                     substitutions=_object(obj.get("substitutions", {}), where + ".substitutions"),
                     metadata=_object(obj.get("metadata", {}), where + ".metadata"))


def _attachment(raw: object, i: int) -> Attachment:
    where = f"content.attachments[{i}]"
    obj = _object(raw, where)
    _known(obj, ATTACHMENT, where + ".")
    data = _text(obj.get("data"), where + ".data", empty=True)
    content_type = _text(obj.get("content_type"), where + ".content_type")
    if content_type.count("/") != 1 or any(c in content_type for c in "\r\n;"):
        raise BadInjection(f"{where}.content_type: {content_type!r} is not type/subtype")
    if _bool(obj.get("base64", False), where + ".base64"):
        try:
            payload = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise BadInjection(f"{where}.data: not base64") from None
    else:
        payload = data.encode("utf-8")
    return Attachment(content_type=content_type.lower(), data=payload,
                      file_name=_maybe_text(obj.get("file_name"), where + ".file_name"),
                      content_id=_maybe_text(obj.get("content_id"), where + ".content_id"))


def _mailbox(raw: object, where: str) -> Mailbox | None:
    if raw is None:
        return None
    obj = _object(raw, where)
    _known(obj, {"email", "name"}, where + ".")
    return Mailbox(_text(obj.get("email"), where + ".email"), _maybe_text(obj.get("name"), where + ".name"))


def _header_name(name: str) -> str:
    if not name or any(not (33 <= ord(c) <= 126) or c == ":" for c in name):
        raise BadInjection(f"content.headers: {name!r} is not a header field name")
    return name


def _known(obj: Mapping[str, Any], known: set[str], prefix: str) -> None:
    unknown = sorted(set(obj) - known)
    if unknown:
        raise BadInjection(f"{prefix}{unknown[0]}: not a field this relay knows")


def _object(raw: object, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise BadInjection(f"{where}: an object is needed")
    return raw


def _list(raw: object, where: str) -> list[Any]:
    if not isinstance(raw, list):
        raise BadInjection(f"{where}: a list is needed")
    return raw


def _text(raw: object, where: str, *, empty: bool = False) -> str:
    if not isinstance(raw, str) or (not raw and not empty):
        raise BadInjection(f"{where}: a string is needed" if not isinstance(raw, str) else f"{where}: empty")
    return raw


def _maybe_text(raw: object, where: str) -> str | None:
    return None if raw is None else _text(raw, where, empty=True)


def _bool(raw: object, where: str) -> bool:
    if not isinstance(raw, bool):
        raise BadInjection(f"{where}: true or false is needed")
    return raw


def check_key(raw: bytes | None) -> str | None:
    """The ``Idempotency-Key`` header's value, or None; printable ASCII, at most ``MAX_KEY`` characters."""
    if raw is None:
        return None
    key = raw.strip()
    if not key or len(key) > MAX_KEY or not all(33 <= c <= 126 for c in key):
        raise BadInjection(f"Idempotency-Key: 1 to {MAX_KEY} printable ASCII characters without spaces")
    return key.decode("ascii")
