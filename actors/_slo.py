"""Service-level objectives: how fast a model's error budget burns.

A model with ``slo_ms`` promises that ``slo_target`` of its requests (0.99 by
default) are answered with a result within ``slo_ms``, end to end in the runtime. A
request is *good* when it is; *bad* when it is answered later, or fails for the
server's reasons (the model raised, its deadline passed, the runtime shed it or shut
down). A request the client got wrong (invalid input, an unknown model, a tenant over
its own quota) or withdrew within ``slo_ms`` is neither: it says nothing of the
service; one withdrawn later is bad (the server had missed the objective already).

The *burn rate* over a window is the share of bad requests in it over the share the
objective allows (1 - target): at 1 the budget lasts exactly the objective's period,
at 14.4 a 30-day budget is gone in two days. Two windows, 5 minutes and 1 hour, are
the usual pair for an alert that fires fast on a sharp burn and does not flap (the
SRE workbook's multiwindow burn-rate alert); a Prometheus server computes the same
from the ``good`` and ``bad`` counters over any window it likes.

Sans-IO: ``now`` (trio time, seconds) is an argument. Counts are kept in buckets of
``bucket_s`` over the longest window, so memory is fixed and a record is O(1).
"""

from __future__ import annotations

import math

#: The windows burn rates are given over, seconds, and their names on /metrics.
SLO_WINDOWS: tuple[tuple[str, float], ...] = (("5m", 300.0), ("1h", 3600.0))


class SloTracker:
    """Good and bad requests of one model against its objective, in time buckets."""

    __slots__ = ("_bad", "_good", "_head", "bad", "bucket_s", "good", "slo_s", "target")

    def __init__(
        self, slo_s: float, target: float, *, bucket_s: float = 10.0,
        horizon_s: float = max(w for _, w in SLO_WINDOWS),
    ) -> None:
        if not 0.0 < target < 1.0:
            raise ValueError(f"target must be above 0 and below 1, got {target}")
        self.slo_s = slo_s
        self.target = target
        self.bucket_s = bucket_s
        n = math.ceil(horizon_s / bucket_s)
        self._good = [0] * n
        self._bad = [0] * n
        #: the index (time // bucket_s) of the newest bucket; the ring holds the n last
        self._head: int | None = None
        #: every request counted since the start
        self.good = 0
        self.bad = 0

    def _advance(self, now: float) -> int:
        """The ring slot of ``now``'s bucket, emptying the buckets passed since."""
        idx = int(now // self.bucket_s)
        head = self._head
        n = len(self._good)
        if head is None or idx - head >= n:  # the whole ring has passed
            self._good[:] = [0] * n
            self._bad[:] = [0] * n
            self._head = idx
        elif idx > head:
            for i in range(head + 1, idx + 1):
                self._good[i % n] = 0
                self._bad[i % n] = 0
            self._head = idx
        return idx % n

    def answered(self, now: float, seconds: float) -> None:
        """A request answered with a result ``seconds`` after it arrived."""
        slot = self._advance(now)
        if seconds <= self.slo_s:
            self._good[slot] += 1
            self.good += 1
        else:
            self._bad[slot] += 1
            self.bad += 1

    def failed(self, now: float) -> None:
        """A request the server failed (see the module's docstring for which)."""
        self._bad[self._advance(now)] += 1
        self.bad += 1

    def counts(self, now: float, window_s: float) -> tuple[int, int]:
        """(good, bad) over the last ``window_s`` seconds (whole buckets: the current
        one and those before it), at most the horizon."""
        self._advance(now)
        n = len(self._good)
        k = min(n, max(1, math.ceil(window_s / self.bucket_s)))
        head = self._head
        assert head is not None
        good = bad = 0
        for i in range(head - k + 1, head + 1):
            good += self._good[i % n]
            bad += self._bad[i % n]
        return good, bad

    def burn_rate(self, now: float, window_s: float) -> float:
        """The share of bad requests over the last ``window_s`` over the share the
        objective allows; 0 with no request in the window."""
        good, bad = self.counts(now, window_s)
        total = good + bad
        if not total:
            return 0.0
        return (bad / total) / (1.0 - self.target)

    def statistics(self, now: float) -> dict[str, object]:
        """The objective, the counts since the start, and the burn rate per window."""
        return {
            "slo_ms": self.slo_s * 1e3,
            "target": self.target,
            "good": self.good,
            "bad": self.bad,
            "burn_rate": {name: self.burn_rate(now, w) for name, w in SLO_WINDOWS},
        }
