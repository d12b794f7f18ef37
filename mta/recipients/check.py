"""What the SMTP server asks about each RCPT: the tables and aliases first, then the next hop if verified.

One object and one call, so that the session's RCPT hook stays one line
(``mta.inbound.session``): ``await check.rcpt(config, address, before_wait)``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from mta.config import Config
from mta.recipients.maps import RecipientMaps
from mta.recipients.table import Expanded, Refused
from mta.recipients.verify import Verifier

__all__ = ["RecipientCheck"]


class RecipientCheck:
    """The recipient tables (``maps``) and the verification cache (``verifier``) of one SMTP server."""

    def __init__(self, config: Config) -> None:
        self.maps = RecipientMaps(config)
        self.verifier = Verifier(config.recipients.verify_cache)

    async def rcpt(self, config: Config, address: str,
                   before_wait: Callable[[], Awaitable[None]] | None = None) -> Expanded | Refused:
        """What ``address`` becomes in the envelope, or the RCPT's refusal.

        ``before_wait``: awaited before a probe of the next hop (which may take seconds), so that replies
        the session already decided go out first rather than wait behind it.
        """
        resolved = self.maps.resolve(config, address)
        if isinstance(resolved, Refused) or resolved.recipients != (address,):
            return resolved  # an alias, or a local address the tables decided: nothing to ask a next hop
        if not self.verifier.wanted(config, address):
            return resolved
        if before_wait is not None:
            await before_wait()
        refused = await self.verifier.check(config, address)
        return resolved if refused is None else refused
