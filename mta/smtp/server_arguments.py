"""What the SMTP server core makes of MAIL's and RCPT's arguments: the address, and the ESMTP parameters it takes.

The syntax of a path and of ``KEY=VALUE`` parameters is ``mta.smtp.addresses``';
this module decides which parameters the server supports and what their
values may be: SIZE (RFC 1870), BODY (7BIT or 8BITMIME, RFC 6152),
SMTPUTF8 (RFC 6531), RET and ENVID (RFC 3461) on MAIL, NOTIFY and ORCPT
(RFC 3461, checked in ``mta.smtp.dsn_params``) on RCPT; and that a
non-ASCII address needs SMTPUTF8. A client's mistake raises ``RemoteProtocolError`` with the
reply to send (the core counts it as an error). A declared SIZE over the
limit is no mistake: it is a ``Refusal``, answered ``552`` and not counted.
"""

from __future__ import annotations

import attrs

from mta.smtp import dsn_params
from mta.smtp.addresses import parse_mail_from, parse_rcpt_to
from mta.smtp.common import R_TOO_BIG, RemoteProtocolError, Reply, printable
from mta.smtp.server_events import MailFrom, RcptTo
from mta.smtp.server_replies import R_NEED_UTF8, R_PARAMS_NEED_EHLO


@attrs.frozen
class Refusal:
    """A well-formed MAIL the server will not take (the declared size): the reply and the Rejection's reason."""

    reply: Reply
    reason: str


def _unsupported(key: str) -> RemoteProtocolError:
    return RemoteProtocolError("unknown param", Reply(555, "5.5.4", f"Unsupported parameter {printable(key, 40)}"))


def mail_from(arg: str, *, esmtp: bool, max_message_size: int) -> MailFrom | Refusal:
    """MAIL's argument (``FROM:<a@b> SIZE=1``) after EHLO (``esmtp``) or HELO. Raises RemoteProtocolError."""
    address, params = parse_mail_from(arg)
    if params and not esmtp:
        raise RemoteProtocolError("params after HELO", R_PARAMS_NEED_EHLO)
    for key, value in params.items():
        if key == "SIZE":
            if value is None or not value.isdigit() or len(value) > 20:
                raise RemoteProtocolError("bad SIZE", Reply(501, "5.5.4", "Bad SIZE value"))
            if int(value) > max_message_size:
                return Refusal(R_TOO_BIG, "size")
        elif key == "BODY":
            if value is None or value.upper() not in ("7BIT", "8BITMIME"):
                raise RemoteProtocolError("bad BODY", Reply(501, "5.5.4", "BODY must be 7BIT or 8BITMIME"))
        elif key == "SMTPUTF8":
            if value is not None:
                raise RemoteProtocolError("bad SMTPUTF8", Reply(501, "5.5.4", "SMTPUTF8 takes no value"))
        elif key == "RET":
            params[key] = dsn_params.parse_ret(value)
        elif key == "ENVID":
            params[key] = dsn_params.parse_envid(value)
        else:
            raise _unsupported(key)
    if not address.isascii() and "SMTPUTF8" not in params:
        raise RemoteProtocolError("utf8 sender", R_NEED_UTF8)
    return MailFrom(address, params)


def rcpt_to(arg: str, *, smtputf8: bool) -> RcptTo:
    """RCPT's argument (``TO:<a@b>``) in a transaction whose MAIL said SMTPUTF8 or not. Raises RemoteProtocolError."""
    address, params = parse_rcpt_to(arg)
    for key, value in params.items():
        if key == "NOTIFY":
            params[key] = dsn_params.parse_notify(value)
        elif key == "ORCPT":
            params[key] = dsn_params.parse_orcpt(value)
        else:
            raise _unsupported(key)
    if not address.isascii() and not smtputf8:
        raise RemoteProtocolError("utf8 rcpt", R_NEED_UTF8)
    return RcptTo(address, params)
