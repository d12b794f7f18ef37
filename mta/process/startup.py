"""What ``mta serve`` checks before it opens the spool, and how a failed start reads.

Theory of operation
-------------------
A relay that cannot start says why in one line that names the setting, and
exits 2 when the config must change (``ConfigError``) or 1 when something
outside the config stands in the way (``StartError``, an ``OSError``: a port
another program holds, a key file's mode, a resolver that is down). Never a
traceback: that is for bugs.

``check_start`` runs everything that a config file alone cannot tell but this
host can, before any file is created or any socket bound: the TLS certificate
and key (PEM, matching, the key private), the DKIM keys (private, and able to
sign: ``mta.dkim.keys``), and the control socket's path (short
enough for a Unix socket, in a directory that exists and that no other user
may write, and not a file that is not a socket). Listening addresses are
checked where they are bound (``mta.inbound.listen``, ``mta.process.supervisor``), with the
same kind of message.

Errors that arise inside the event loop come out of trio's nurseries wrapped
in exception groups; ``sole_error`` takes the one error back out so that the
command can print it as one line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import ssl
import stat
from collections.abc import Iterator
from typing import NoReturn

from mta.config import Config, ConfigError, ListenAddress
from mta.errors import StartError
from mta.http.tokens import read_tokens
from mta.process.security import UnsafeFile, check_control_dir, check_tls_key

__all__ = ["MAX_UNIX_PATH", "StartError", "check_start", "sole_error"]

# sun_path holds 108 bytes on Linux; one is kept for the NUL that most other programs expect.
MAX_UNIX_PATH = 107


def check_start(config: Config, *, listen: bool = True) -> None:
    """Refuse, in one line, a start that would fail later with a traceback or run unsafely.

    ``listen``: also try each SMTP address (``probe_listen``); the
    supervisor binds them itself instead. The metrics address is tried always
    (each shard has its own).

    Raises:
        ConfigError: a setting that must change (names the file and key).
        StartError: a file's permissions or a host condition (names the key).
    """
    check_tls(config)
    check_dkim_keys(config)
    check_control_socket(config)
    check_users_file(config)
    check_recipient_tables(config)
    check_shaping(config)
    if config.http.listen is not None:
        read_tokens(config.http.tokens_file, config.source)  # the API's tokens: private, and there
    addresses: list[tuple[int | str, ListenAddress]] = list(enumerate(config.server.listen)) if listen else []
    for key in ("listen", "implicit_tls_listen"):
        addresses += [(f"submission.{key}[{i}]", a) for i, a in enumerate(getattr(config.submission, key))]
    if config.server.metrics_listen is not None:
        addresses.append(("server.metrics_listen", config.server.metrics_listen))
    if config.http.listen is not None:
        addresses.append(("http.listen", config.http.listen))
    if config.events.listen is not None:
        addresses.append(("events.listen", config.events.listen))
    probe_listen(config, addresses)


def check_recipient_tables(config: Config) -> None:
    """``[recipients] tables`` read as the sessions will read them. Raises ConfigError naming the file and line."""
    from mta.recipients.maps import load

    load(config)


def probe_listen(config: Config, addresses: list[tuple[int | str, ListenAddress]]) -> None:
    """Bind (and let go) each address the relay will listen on, as trio will, before the spool is opened.

    So a port in use or an address this host lacks is one line before
    recovery logs anything. Something that takes the port in between still
    gets the same line, from ``mta.inbound.listen``. ``addresses``: (index in
    ``server.listen``, or the key) and the address.
    """
    from mta.inbound.listen import bind_error

    for index, addr in addresses:
        try:
            infos = socket.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            for family, type_, proto, _, sockaddr in infos:
                try:
                    sock = socket.socket(family, type_, proto)
                except OSError as exc:
                    if exc.errno == errno.EAFNOSUPPORT:
                        continue  # as trio.open_tcp_listeners: this host has no such family
                    raise
                with sock:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    if family == socket.AF_INET6:
                        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                    sock.bind(sockaddr)
        except OSError as exc:
            error = bind_error(addr, index, exc)
            if isinstance(error, ConfigError):
                raise ConfigError(error.problem, config.source, error.key) from None
            raise error.located(config.source) from None


def _config_error(config: Config, key: str, problem: str) -> ConfigError:
    return ConfigError(problem, config.source, key)


def check_users_file(config: Config) -> None:
    """With submission on: the users file exists, is private and reads as one (``mta.auth.users``)."""
    from mta.auth.users import UsersFileError, check_private, read_users

    path = config.submission.users_file
    if not config.submission.enabled or path is None:
        return
    key = "submission.users_file"
    try:
        check_private(path)
        read_users(path)
    except FileNotFoundError:
        raise _config_error(config, key, f"no such file: {path} (mta user add NAME creates it)") from None
    except OSError as exc:
        raise StartError(f"cannot read {path}: {exc.strerror or exc}", config.source, key) from None
    except UsersFileError as exc:
        raise StartError(f"{exc}; refusing to start", config.source, key) from None


def check_tls(config: Config) -> None:
    """The certificate is PEM, the key is PEM, private, and belongs to the certificate."""
    cert, key = config.server.tls_cert, config.server.tls_key
    if cert is None or key is None:
        if config.client_certs.ca_file is not None:
            raise ConfigError("client_certs.ca_file needs TLS on the listeners (server.tls_cert and server.tls_key)",
                              config.source, "client_certs.ca_file")
        return
    try:
        check_tls_key(key)
    except UnsafeFile as exc:
        raise StartError(f"{exc}; refusing to start", config.source, "server.tls_key") from None
    except OSError as exc:
        raise _config_error(config, "server.tls_key", f"cannot read {key}: {exc.strerror or exc}") from None
    try:
        with open(cert, "rb") as f:
            pem = f.read()
    except OSError as exc:
        raise _config_error(config, "server.tls_cert", f"cannot read {cert}: {exc.strerror or exc}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        if b"-----BEGIN CERTIFICATE-----" not in pem:
            raise ValueError("no BEGIN CERTIFICATE line")
        context.load_verify_locations(cadata=pem.decode("ascii"))
    except (ssl.SSLError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise _config_error(config, "server.tls_cert", f"{cert} is not a PEM certificate ({_reason(exc)})") from None

    if config.client_certs.ca_file is not None:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cafile=config.client_certs.ca_file)
        except (ssl.SSLError, ValueError, OSError) as exc:
            raise _config_error(config, "client_certs.ca_file", f"{config.client_certs.ca_file} holds no PEM CA "
                                f"certificate ({_reason(exc)})") from None

    def encrypted() -> NoReturn:
        raise ConfigError(f"{key} is encrypted; the relay needs a key without a passphrase", config.source,
                          "server.tls_key")

    try:
        context.load_cert_chain(cert, key, password=encrypted)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise _config_error(config, "server.tls_key",
                                f"{key} does not match the certificate in {cert}") from None
        raise _config_error(config, "server.tls_key", f"{key} is not a PEM private key ({_reason(exc)})") from None
    except OSError as exc:
        raise _config_error(config, "server.tls_key", f"cannot read {key}: {exc.strerror or exc}") from None


def check_shaping(config: Config) -> None:
    """The shaping table ``[shaping]`` names, loaded, and each ``[egress.providers]`` name one of its providers.

    Raises ShapingError or ConfigError (one line, exit 2). The provider names are checked here, not by the
    loader: only the table knows them, and ``mta.config`` does not import ``mta.shaping``.
    """
    if config.shaping.enabled:
        from mta.shaping.setup import table_of

        table = table_of(config)
        known = {p.name for p in table.providers}
        for name, _ in config.egress.providers:
            if name not in known:
                raise ConfigError(f"{name!r} is not a provider of the shaping table (its providers: "
                                  f"{', '.join(sorted(known)) or 'none'})", config.source, f"egress.providers[{name}]")


def check_dkim_keys(config: Config) -> None:
    """Each ``[[dkim.key]]`` file private (as a TLS key must be), readable, and a key that signs.

    Raises:
        StartError: a key file others may read or change (exit 1, as for the TLS key).
        ConfigError: a key file that cannot be read or used (``mta.dkim.keys.KeyProblem``, exit 2).
    """
    from mta.dkim.keys import load_key

    for i, key in enumerate(config.dkim_keys):
        try:
            check_tls_key(key.key_file)
        except UnsafeFile as exc:
            raise StartError(f"the key of {key.domain} (selector {key.selector}): {exc}; refusing to start",
                             config.source, f"dkim.key[{i}]") from None
        except OSError:
            pass  # unreadable: load_key says so, as a config error
        load_key(key, f"dkim.key[{i}]", config.source)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return "not ASCII text"
    return str(getattr(exc, "reason", None) or exc).split(" (_ssl.c")[0]


def check_control_socket(config: Config) -> None:
    """A path a Unix socket can have, in a directory that exists and that no other user can write.

    The spool directory (the default's) is made at start, so it need not exist yet.
    """
    path = config.server.control_socket
    size = len(os.fsencode(path))
    if size > MAX_UNIX_PATH:
        raise _config_error(config, "server.control_socket",
                            f"{path} is {size} bytes long; a Unix socket path holds at most {MAX_UNIX_PATH}")
    directory = os.path.dirname(path)
    spool = os.path.normpath(config.spool.dir)
    inside_spool = os.path.commonpath([spool, os.path.normpath(directory)]) == spool
    if not os.path.isdir(directory):
        if os.path.exists(directory):
            raise _config_error(config, "server.control_socket", f"{directory} is not a directory")
        if not inside_spool:
            raise _config_error(config, "server.control_socket", f"directory {directory} does not exist")
        return  # made with the spool at start
    if not inside_spool:  # the spool's own check covers it, in its own words
        try:
            check_control_dir(directory)
        except UnsafeFile as exc:
            raise StartError(f"{exc}; refusing to start", config.source, "server.control_socket") from None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):  # the relay replaces a stale socket at start, and nothing else
        raise _config_error(config, "server.control_socket", f"{path} exists and is not a socket")


def sole_error(exc: BaseException) -> BaseException:
    """The one exception inside (nested) exception groups, or ``exc`` itself if there are several or none."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


@contextlib.contextmanager
def unwrapped() -> Iterator[None]:
    """Re-raise a lone exception that trio wrapped in groups, so ``except OSError`` and friends see it."""
    try:
        yield
    except BaseExceptionGroup as group:
        inner = sole_error(group)
        if inner is group:
            raise
        raise inner from None
