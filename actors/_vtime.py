"""The fair-share counters' rebase (virtual-time counting, ``FairQueue``).

A class's counters (weighted service, ``cost / weight`` summed per tenant) only grow.
As floats, once a counter is large enough a request's increment is lost to rounding
(at 2**53 times an increment, none of it is added) and fair share stops: the tenant
with the least counter is served forever, its counter never moving. So a class's
counters are rebased, all moved down by one amount, once one of them passes a
threshold: they then stay small next to the increments, which keep their precision.

Nothing but differences between counters is ever compared, so a rebase changes no
decision: the amount subtracted is a multiple of the largest counter's ulp, which
makes every subtraction exact (each comparison, each equality, each ``max`` of the
queue gives after it what it gave before).
"""

from __future__ import annotations

import math
from collections.abc import Container

#: A class's counters are rebased once one of them reaches this (in weighted cost
#: units). Below it, a counter's rounding step (its ulp, at most 2**-21) is under a
#: two-thousandth of the smallest increment the configuration allows (a cost of 1 over
#: the largest weight, 1e3: 1e-3); a rebase costs one pass over the class's tenants,
#: and comes after about this much service (see ``rebase`` for counters far apart).
REBASE_AT = 2.0**32


def rebase(
    vt: dict[str, float], active: Container[str], floor: float, threshold: float
) -> tuple[float, float]:
    """Move a class's counters ``vt`` (tenant -> weighted service) and its ``floor``
    (the most service a counter reached) down by one amount; return the new floor and the value a
    counter must reach before the next rebase.

    The amount is at most the least of the floor and the counters of the ``active``
    (backlogged) tenants: no counter of theirs, nor any tenant lifted later, goes
    below that, so every counter stays >= 0 and a tenant never seen (counted 0 when
    it arrives) is still lifted to the floor. It is that least value rounded down to a
    multiple of the ulp of the largest counter, so each subtraction is exact.

    An idle tenant's counter at or below that least value is dropped: whenever it
    next waits it is lifted to the floor or the least backlogged counter, which are
    never below it, so its value no longer matters (and idle tenants' counters do not
    pile up).

    The next rebase is due at ``threshold``, or at twice the largest counter left
    when that is more (counters far apart, the least one held back: a rebase then
    comes after the counters doubled, at amortised O(1) per request served)."""
    low = floor
    for tenant, v in vt.items():
        if tenant in active and v < low:
            low = v
    high = max(floor, max(vt.values(), default=floor))
    if not math.isfinite(high) or low <= 0.0:
        return floor, max(threshold, 2.0 * high)
    unit = math.ulp(high)
    # low / unit < 2**53: the product is exact, a multiple of every counter's ulp
    shift = math.floor(low / unit) * unit
    for tenant in list(vt):
        v = vt[tenant]
        if v <= low and tenant not in active:
            del vt[tenant]
        else:
            vt[tenant] = v - shift
    return floor - shift, max(threshold, 2.0 * (high - shift))
