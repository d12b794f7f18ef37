"""One message per recipient of an injection: its templates rendered, its MIME built, its bytes in wire form.

Templates are Jinja (``jinja2``'s ``ImmutableSandboxedEnvironment``, the
syntax KumoMTA's minijinja speaks): a template is code sent by a client, so
it runs sandboxed, with no access to Python attributes beyond what the
sandbox allows, and it cannot change the values it is given. Each template
of a request is compiled once and rendered once per recipient, with the
request's ``substitutions`` overlaid by the recipient's, and ``email``,
``name`` and ``to_header`` (``"Name" <email>``) set from the recipient.
An undefined name renders empty, as in minijinja.

A whole-message ``content`` is rendered as one template and sent as it
stands, line ends made CRLF. A builder's ``text_body``, ``html_body``,
``amp_html_body``, ``subject`` and ``headers`` are templates; the message is
built by ``mta.http.mime`` (7-bit transfer encodings, so that
no next hop needs 8BITMIME): ``multipart/alternative`` for several bodies,
``multipart/related`` around the HTML for attachments with a
``content_id``, ``multipart/mixed`` for the other attachments. ``From``,
``Reply-To``, ``Subject``, ``To`` (the recipient, unless ``headers`` names
one), ``Date`` and ``Message-ID`` are set when the request does not set
them.

``compose`` raises ``RecipientFailed`` for one recipient whose message cannot
be made (the request's answer lists it in ``failed_recipients``), and
``BadInjection`` for a template that does not compile (the whole request).
"""

from __future__ import annotations

import email.utils
import re
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mta.http.inject_request import Builder, InjectRequest, Recipient
from mta.http.mime import Skeleton, address_line, header_line
from mta.smtp.addresses import parse_mailbox

__all__ = ["Composer", "RecipientFailed"]

MAX_LINE = 998  # RFC 5321 §4.5.3.1.6, without the CRLF
_LINE_END = re.compile(rb"\r\n|\r|\n")
_ENV = ImmutableSandboxedEnvironment(autoescape=False, keep_trailing_newline=True)
_GLOBALS = dict(_ENV.globals)  # range, dict, namespace, ...: what a template may call besides its values


class RecipientFailed(ValueError):
    """This recipient's message cannot be made; the text is the reason given in the answer."""


Render = Callable[[Mapping[str, Any]], str]


def _template(text: str | None, templated: bool, where: str) -> Render | None:
    from mta.http.inject_request import BadInjection

    if text is None:
        return None
    if not templated or ("{" not in text):
        return lambda _: text
    try:
        compiled = _ENV.from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise BadInjection(f"{where}: template error at line {exc.lineno}: {exc.message}") from None

    def render(context: Mapping[str, Any]) -> str:
        # ``context`` already holds the environment's globals (``Composer.compose``): shared, it is used as it
        # is, where ``Template.render`` would chain it with the globals again for every part of every recipient.
        return _ENV.concat(compiled.root_render_func(compiled.new_context(dict(context), shared=True)))

    return render


def _joint(parts: list[tuple[str, str]], templated: bool) -> Callable[[Mapping[str, Any]], list[str]]:
    """All the templates of a builder rendered by one call per recipient: ``parts`` are (field, text).

    Why: each render of a Jinja template costs its context's setup (about 15 µs); a builder has four or
    more templates, rendered for every recipient. They are joined by a marker of 16 random bytes made for
    this request, compiled as one template and its output split again. Each part is first compiled alone,
    so that an error names its field and a block cannot open in one part and close in another.
    """
    texts = [text for _, text in parts]
    if not templated or not any("{" in t for t in texts):
        return lambda _: texts
    for field, text in parts:
        _template(text, True, field)  # BadInjection, naming the field
    marker = "\x1e" + secrets.token_hex(16) + "\x1e"
    render = _template(marker.join(texts), True, "content")
    assert render is not None

    def render_all(context: Mapping[str, Any]) -> list[str]:
        out = render(context).split(marker)
        if len(out) != len(texts):
            raise RecipientFailed("template: its output cannot be split into the message's parts")
        return out

    return render_all


@attrs.frozen
class _Templates:
    """A builder's templated fields: ``names`` (``subject``, ``text``, ``amp``, ``html``, ``header:NAME``) and
    ``render``, which gives their values for one recipient in that order."""

    names: tuple[str, ...]
    render: Callable[[Mapping[str, Any]], list[str]]


class Composer:
    """The messages of one request; ``hostname``: the relay's, for Message-ID and Received:.

    Raises BadInjection at construction for a template that does not compile.
    """

    def __init__(self, request: InjectRequest, hostname: str, client: str, max_size: int) -> None:
        self.request = request
        self.hostname = hostname
        self.client = client
        self.max_size = max_size
        self._skeleton: Skeleton | None = None  # a builder's layout, made at the first recipient
        self._date = email.utils.formatdate(time.time(), localtime=False)  # the request's: one for its messages
        self._id_prefix = secrets.token_hex(8)
        self._made = 0
        t = request.templated
        content = request.content
        if isinstance(content, str):
            self._whole = _template(content, t, "content")
            self._parts: _Templates | None = None
        else:
            self._whole = None
            fields = [(name, field, text) for name, field, text in (
                ("subject", "content.subject", content.subject), ("text", "content.text_body", content.text_body),
                ("amp", "content.amp_html_body", content.amp_html_body),
                ("html", "content.html_body", content.html_body),
                *((f"header:{h}", f"content.headers.{h}", v) for h, v in content.headers)) if text is not None]
            self._parts = _Templates(tuple(name for name, _, _ in fields),
                                     _joint([(field, text) for _, field, text in fields], t))

    def compose(self, rcpt: Recipient) -> bytes:
        """The message for ``rcpt``, CRLF line ends, not dot-stuffed.

        Raises RecipientFailed.
        """
        if not parse_mailbox(rcpt.email):
            raise RecipientFailed(f"{rcpt.email!r} is not a mailbox")
        context = {**_GLOBALS, **self.request.substitutions, **rcpt.substitutions, "email": rcpt.email,
                   "name": rcpt.name or "", "to_header": _to_header(rcpt)}
        try:
            if self._whole is not None:
                data = _wire(self._whole(context).encode("utf-8"))
            else:
                assert self._parts is not None and isinstance(self.request.content, Builder)
                data = self._build(self.request.content, self._parts, context, rcpt)
        except RecipientFailed:
            raise
        except (SecurityError, jinja2.TemplateError) as exc:
            raise RecipientFailed(f"template: {exc}") from None
        except (ValueError, TypeError) as exc:
            raise RecipientFailed(f"cannot be built: {exc}") from None
        if self.request.received_header:
            data = self._received() + data
        if len(data) > self.max_size:
            raise RecipientFailed(f"the message is {len(data)} bytes, more than this relay takes ({self.max_size})")
        return data

    def _received(self) -> bytes:
        return (f"Received: from [{self.client}] by {self.hostname} (logspool) with HTTP;\r\n\t{self._date}\r\n"
                .encode("ascii", "replace"))

    def _build(self, content: Builder, parts: _Templates, context: Mapping[str, Any], rcpt: Recipient) -> bytes:
        values = dict(zip(parts.names, parts.render(context), strict=True))
        if self._skeleton is None:
            self._skeleton = Skeleton(content.attachments, "html" in values)
        headers = [(name[7:], value) for name, value in values.items() if name.startswith("header:")]
        given = {name.lower() for name, _ in headers}
        head: list[str] = []
        if content.from_ is not None and "from" not in given:
            head.append(address_line("From", content.from_.name, content.from_.email))
        if content.reply_to is not None and "reply-to" not in given:
            head.append(address_line("Reply-To", content.reply_to.name, content.reply_to.email))
        if "subject" in values and "subject" not in given:
            head.append(header_line("Subject", values["subject"]))
        if "to" not in given:
            head.append(address_line("To", rcpt.name, rcpt.email))
        head.extend(header_line(name, value) for name, value in headers)
        if "date" not in given:
            head.append(f"Date: {self._date}\r\n")
        if "message-id" not in given:
            self._made += 1  # unique: 64 random bits per request, then the message's number in it
            head.append(header_line("Message-ID", f"<{self._id_prefix}.{self._made}@{self.hostname}>"))
        bodies = [(sub, values[name]) for name, sub in (("text", "plain"), ("amp", "x-amp-html"), ("html", "html"))
                  if name in values]
        return ("".join(head) + self._skeleton.body(bodies)).encode("ascii")


def _to_header(rcpt: Recipient) -> str:
    return email.utils.formataddr((rcpt.name or "", rcpt.email))


def _wire(data: bytes) -> bytes:
    """A whole message as the client wrote it, with CRLF line ends; a line longer than SMTP allows is refused."""
    lines = _LINE_END.split(data)
    if lines and lines[-1] == b"":
        lines.pop()
    if any(len(line) > MAX_LINE for line in lines):
        raise RecipientFailed(f"a line is longer than {MAX_LINE} bytes (RFC 5321 §4.5.3.1.6)")
    if not lines or b":" not in lines[0]:
        raise RecipientFailed("the content is no message: it does not begin with a header field")
    return b"\r\n".join(lines) + b"\r\n"
