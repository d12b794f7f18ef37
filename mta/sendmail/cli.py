"""``sendmail`` and ``mailq``: the commands cron, logwatch and PHP's ``mail()`` call, as Postfix installs them.

``sendmail [-t] [-i|-oi] [-f sender] [-F name] [-C config] [-bm|-bp] [rcpt ...]``
reads one message from standard input. It exits 0 only once the message is
durable: answered ``250`` by the running relay (over SMTP to the first
``[server] listen`` address, from loopback), or, when the relay cannot take
it now (not running, or a ``4xx``), written into the drop directory
(``mta.inbound.maildrop``) that the relay takes in. Anything else is one
line on stderr and a status of sysexits.h: ``EX_USAGE`` for bad arguments or
no recipient, ``EX_DATAERR`` for input that is no message or that the relay
refused for good, ``EX_NOUSER`` for a recipient it refused, ``EX_CONFIG``
for a bad config, ``EX_TEMPFAIL`` when neither path worked (a retry can).

Flags of other sendmails that change nothing here are accepted and ignored
(``-oem``, ``-odi``, ``-odb``, ``-o*``, ``-v``, ``-N DSN``, ``-B TYPE``,
``-R RET``, ``-V ENVID``, ``-X FILE``, ``-L LABEL``), so existing scripts run;
``-bs`` (SMTP on standard input) and the other modes are refused with
``EX_USAGE``. ``-bp`` is ``mailq``; ``mailq`` is ``mta queue list``.
"""

from __future__ import annotations

import getpass
import os
import smtplib
import sys
from collections.abc import Sequence

import attrs

from mta.config import Config, ConfigError, load_config
from mta.inbound import maildrop
from mta.sendmail.message import MessageError, prepare

SMTP_TIMEOUT = 60.0  # the whole hand-over to a running relay; past it the message goes into the drop directory
_IGNORED_WITH_VALUE = frozenset("NBRVXL")  # -N DSN, -B TYPE, -R RET, -V ENVID, -X FILE, -L LABEL


class Failed(Exception):
    """The command ends with ``status`` and one line."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status


@attrs.define
class Args:
    extract: bool = False
    dot_ends: bool = True
    sender: str | None = None
    full_name: str | None = None
    config: str | None = None
    list_queue: bool = False
    recipients: list[str] = attrs.Factory(list)


def parse_args(argv: Sequence[str]) -> Args:
    """Sendmail's flags, as Postfix's ``sendmail`` reads them. Raises: Failed (EX_USAGE)."""
    args = Args()
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":
            args.recipients += argv[i:]
            break
        if not arg.startswith("-") or arg == "-":
            args.recipients.append(arg)
            continue
        flag, value = arg[1], arg[2:]
        if flag in "fFrC" + "".join(_IGNORED_WITH_VALUE) and not value:
            if i >= len(argv):
                raise Failed(os.EX_USAGE, f"option -{flag} needs a value")
            value, i = argv[i], i + 1
        if flag in "fr":
            args.sender = value.strip().removeprefix("<").removesuffix(">")
        elif flag == "F":
            args.full_name = value
        elif flag == "C":
            args.config = value
        elif arg == "-t":
            args.extract = True
        elif arg in ("-i", "-oi"):
            args.dot_ends = False
        elif arg == "-bm":
            pass
        elif arg == "-bp":
            args.list_queue = True
        elif flag == "b":
            raise Failed(os.EX_USAGE, f"mode {arg} is not supported (only -bm, to deliver, and -bp, the queue)")
        elif flag in ("o", "v") or flag in _IGNORED_WITH_VALUE:
            pass  # other sendmails' queueing, error-mode and verbosity flags: nothing to change here
        else:
            raise Failed(os.EX_USAGE, f"unknown option {arg}")
    return args


def _relay_address(config: Config) -> tuple[str, int]:
    first = config.server.listen[0]
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(first.host, first.host)
    return host, first.port


def _reply_text(code: int, text: bytes) -> str:
    return f"{code} " + " ".join(text.decode("utf-8", "replace").split())


def submit(config: Config, sender: str, recipients: Sequence[str], message: bytes) -> str | None:
    """Hand the message to the running relay; None once it answered 250, else why it could not take it now.

    Raises: Failed for a permanent refusal (EX_NOUSER for a recipient, EX_DATAERR otherwise).
    """
    host, port = _relay_address(config)
    try:
        with smtplib.SMTP(host, port, local_hostname=config.server.hostname, timeout=SMTP_TIMEOUT) as smtp:
            code, text = smtp.ehlo()
            if code != 250:
                return _reply_text(code, text)
            options = ["SMTPUTF8"] if not (sender + "".join(recipients)).isascii() else []
            code, text = smtp.mail(sender, options)
            if code >= 500:
                raise Failed(os.EX_DATAERR, f"sender <{sender}> refused: {_reply_text(code, text)}")
            if code != 250:
                return _reply_text(code, text)
            for rcpt in recipients:
                code, text = smtp.rcpt(rcpt)
                if code >= 500:
                    smtp.rset()
                    raise Failed(os.EX_NOUSER, f"<{rcpt}>: {_reply_text(code, text)}")
                if code not in (250, 251):
                    return _reply_text(code, text)
            code, text = smtp.data(message)
            if code >= 500:
                raise Failed(os.EX_DATAERR, f"message refused: {_reply_text(code, text)}")
            return None if code == 250 else _reply_text(code, text)
    except (OSError, smtplib.SMTPException) as exc:
        return f"the relay at {host}:{port} cannot be reached: {exc}"


def send(args: Args, data: bytes, config: Config) -> str:
    """The message submitted or dropped; what happened, for ``-v`` readers. Raises: Failed."""
    user = getpass.getuser()
    sender = args.sender if args.sender is not None else f"{user}@{config.server.hostname}"
    if len(data) > config.server.max_message_size:
        raise Failed(os.EX_DATAERR, f"message of {len(data)} bytes is larger than the relay takes "
                                    f"({config.server.max_message_size})")
    try:
        prepared = prepare(data, dot_ends=args.dot_ends, extract=args.extract, sender=sender,
                           full_name=args.full_name, hostname=config.server.hostname)
    except MessageError as exc:
        raise Failed(os.EX_DATAERR, str(exc)) from None
    recipients = list(dict.fromkeys([*args.recipients, *prepared.header_recipients]))
    if not recipients:
        raise Failed(os.EX_USAGE, "no recipients (give them as arguments, or -t to read To:, Cc: and Bcc:)")
    why = submit(config, sender, recipients, prepared.message)
    if why is None:
        return "queued by the relay"
    dropped = maildrop.Dropped(sender, tuple(recipients), user, prepared.message)
    try:
        path = maildrop.write(config.sendmail.drop_dir, dropped)
    except OSError as exc:
        raise Failed(os.EX_TEMPFAIL, f"not sent, try again: the relay could not take it ({why}) and the drop "
                                     f"directory {config.sendmail.drop_dir} cannot be written "
                                     f"({exc.strerror or exc})") from None
    return f"left in {path} for the relay ({why})"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
        if args.list_queue:
            return mailq(["--config", args.config] if args.config else [])
        try:
            config = load_config(args.config)
        except ConfigError as exc:
            raise Failed(os.EX_CONFIG, f"config: {exc}") from None
        send(args, sys.stdin.buffer.read(), config)
    except Failed as exc:
        print(f"sendmail: {exc}", file=sys.stderr)
        return exc.status
    except (OSError, UnicodeError) as exc:
        print(f"sendmail: {exc}", file=sys.stderr)
        return os.EX_TEMPFAIL
    return 0


def mailq(argv: Sequence[str] | None = None) -> int:
    """``mailq [ARGS]``: ``mta queue list [ARGS]``, with its output and exit statuses."""
    from mta.cli import main as mta_main

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        mta_main(["queue", "list", *args], prog_name="mailq")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


def sendmail_entry() -> None:
    sys.exit(main())


def mailq_entry() -> None:
    sys.exit(mailq())
