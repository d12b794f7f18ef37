"""The bearer tokens the HTTP API accepts, read at start from a private file, and again on SIGHUP.

A token is a password: the file must be readable by its owner only (mode
0600 or 0400), or the relay refuses to start, in one line. Comparison is in
constant time per token (``hmac.compare_digest``), so the answer's timing
tells a guesser nothing about how much of a token was right.
"""

from __future__ import annotations

import hmac
import os
import stat

from mta.errors import StartError

__all__ = ["Tokens", "read_tokens"]

KEY = "http.tokens_file"


class Tokens:
    """The accepted tokens; ``accepts`` takes the ``Authorization`` header's value (or None)."""

    def __init__(self, tokens: tuple[bytes, ...]) -> None:
        self._tokens = tokens

    def replace(self, other: Tokens) -> None:
        """Accept ``other``'s tokens from now on (a reload: the server keeps this object)."""
        self._tokens = other._tokens

    def accepts(self, authorization: bytes | None) -> bool:
        if authorization is None:
            return False
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return False
        token = token.strip()
        ok = False
        for known in self._tokens:  # every one compared: the time does not say which matched
            ok |= hmac.compare_digest(known, token)
        return ok


def read_tokens(path: str | None, config_file: str = "") -> Tokens:
    """The tokens of ``path``.

    Raises:
        StartError: no file named, a file missing or unreadable, open to other users, or holding no token.
    """
    if path is None:
        raise StartError("is required when [http] listen is set (no API without authentication)", config_file, KEY)
    try:
        st = os.stat(path)
        mode = stat.S_IMODE(st.st_mode)
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise StartError(f"{path} is open to other users (mode {mode:04o}); chmod 600 it", config_file, KEY)
        with open(path, "rb") as f:
            text = f.read()
    except OSError as exc:
        if isinstance(exc, StartError):
            raise
        raise StartError(f"{path}: {exc.strerror or exc}", config_file, KEY) from None
    tokens = tuple(line.split(b"#", 1)[0].strip() for line in text.splitlines())
    tokens = tuple(t for t in tokens if t)
    if not tokens:
        raise StartError(f"{path} holds no token", config_file, KEY)
    if any(not t.isascii() or any(c <= 0x20 for c in t) for t in tokens):
        raise StartError(f"{path}: a token must be printable ASCII without spaces", config_file, KEY)
    return Tokens(tokens)
