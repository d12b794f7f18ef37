"""Which retry class a message deferred by a provider's suspension goes on in.

The spool's deferred classes are runners with fixed intervals: a replacement
envelope of class k is due when its runner passes it, ``interval(k)`` after
the second the envelope was stamped with (records carry whole seconds). There
is no due time of the message's own, so the one choice the relay has is the
class. Mail deferred because its provider is suspended (``[shaping]``, a
``suspend`` rule) would otherwise come back every short interval while the
suspension holds, each time deferred again, or, in a long class, long after
it has ended. The smallest class whose interval reaches the end brings it
back at the first runner pass after the end.

A spread (jitter) of the return is not possible in this mechanism: every
envelope of a class written in the same second is due in the same second, and
a per-message due time would be a change of the on-disk format.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence


def class_reaching(intervals: Sequence[float], now: float, ends: float) -> int:
    """The smallest deferred class (1-based, as the spool numbers them) whose interval reaches ``ends``.

    ``intervals``: the spool's ``retry_intervals``, not decreasing. ``now`` is
    cut to its second, as the envelope's stamp is, so that the message is never
    due before ``ends``. A suspension longer than every interval gets the last
    class: the message comes back once, is deferred again and chooses again.
    """
    if not intervals:
        raise ValueError("no deferred classes")
    wait = ends - math.floor(now)
    for klass, interval in enumerate(intervals, 1):
        if interval >= wait:
            return klass
    return len(intervals)


def class_after_suspension(intervals: Sequence[float], now: float, remaining: Collection[str],
                           suspended: Mapping[str, float], usual: int) -> int | None:
    """The class for a message's ``remaining`` recipients, ``suspended`` (recipient -> the suspension's end)
    among them; None: the spool's usual class (``usual``, which the spool gives when told none).

    Only suspended recipients left: the class reaching the earliest end (an
    earlier end brings back the mail it holds, and the rest chooses again).
    Others deferred for their own reasons too: the earlier of that and
    ``usual``, so that no recipient waits longer than its own retry would make
    it.
    """
    ends = [suspended[r] for r in remaining if r in suspended]
    if not ends:
        return None
    klass = class_reaching(intervals, now, min(ends))
    if len(ends) < len(remaining):
        klass = min(klass, usual)
    return klass
