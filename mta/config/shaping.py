"""``[shaping]``: per-provider and per-domain delivery limits, and the rules that adapt them to replies.

The section only says whether shaping is on and where the table is: the
table itself (providers matched by MX host suffix or domain, per-domain
limits, adaptive rules) is TOML in its own file, read by
``mta.shaping.table`` over the table logspool ships. A file that cannot be
read or holds a bad entry stops the start (and ``mta config check``) in one
line naming the file and the entry. docs/operations.md, "Shaping".
"""

from __future__ import annotations

import attrs

from spool import Boolean, Optional, Path, setting

__all__ = ["ShapingSection"]


@attrs.frozen(kw_only=True)
class ShapingSection:
    """``[shaping]``: on or off, the shipped table or not, and the operator's table."""

    enabled: bool = setting(
        Boolean(), "apply the shaping table to MX-routed mail: per-provider and per-domain connections, messages "
        "per connection, message rates, TLS required, and the adaptive rules", True)
    builtin: bool = setting(
        Boolean(), "start from the table logspool ships (big providers' limits and rules, \"Shaping\"); false: "
        "only `file`'s", True)
    file: str | None = setting(
        Optional(Path()), "the operator's shaping table (TOML: `[provider.NAME]`, `[domain.\"D\"]`, `[[rule]]`), "
        "over the shipped one field by field; not set: the shipped table alone", None)
