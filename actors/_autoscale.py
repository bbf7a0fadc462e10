"""The autoscaler's decision, sans-IO: how many replicas a model's load asks for, and
when to move there.

Every ``interval`` seconds the controller (``actors/_scaling.py``) tells
:meth:`Autoscaler.decide` the model's load (cost units queued plus in service) and
how many replicas serve now. The look averages the loads sampled over the last
``look_back`` seconds (Ray Serve's ``look_back_period_s``; 0: the last sample
only), and that mean asks for ceil(mean / ``target``) replicas, clamped to
[``minimum``, ``maximum``] (``desired``). The count moves up only once
``desired`` stayed above the current count for ``upscale_delay`` seconds, to what
the last look asks for; it moves down only once ``desired`` stayed below it for
``downscale_delay`` seconds, to the most any look of that wait asked for (as
Kubernetes' horizontal autoscaler's stabilization window does: a load sampled
between its peaks asks for fewer replicas than it needs, and going down to the
last look's count dropped a replica the next peak wanted back). A look that asks
for no change, or for a change the other way, starts the wait again. So a load
that swings faster than the delays moves nothing, and one that holds moves the
count once.
"""

from __future__ import annotations

import collections
import math

import attrs

UP = "up"
DOWN = "down"


@attrs.frozen(kw_only=True)
class ScaleDecision:
    """A change of the replica count: ``direction`` (``up`` or ``down``) from
    ``before`` to ``after`` replicas, decided at ``at`` for a ``load`` of cost
    units (the mean over the look-back window)."""

    direction: str
    before: int
    after: int
    at: float
    load: float


@attrs.frozen(kw_only=True)
class AutoscalerStatistics:
    """Where the autoscaler stands: its bounds, the count the last look asked for
    (``desired``; None before the first look), and its last change (None: none)."""

    min_replicas: int
    max_replicas: int
    target: float
    desired: int | None
    last_decision: ScaleDecision | None
    decisions: dict[str, int]


class Autoscaler:
    """Replicas for a load, with hysteresis (see the module's docstring).

    ``decide(now, load=..., current=...)`` returns the replica count to have now:
    ``current`` unless a change is due. It looks at most once per ``interval``
    (earlier calls return ``current`` and change nothing); ``next_look()`` says when
    it looks next. Each look's load joins the window of the last ``look_back``
    seconds, whose mean decides.
    """

    def __init__(
        self,
        *,
        minimum: int,
        maximum: int,
        target: float,
        upscale_delay: float = 5.0,
        downscale_delay: float = 60.0,
        interval: float = 1.0,
        look_back: float = 0.0,
        now: float = 0.0,
    ) -> None:
        if not 1 <= minimum <= maximum:
            raise ValueError(f"need 1 <= minimum <= maximum, got {minimum}, {maximum}")
        if not target > 0 or not interval > 0 or upscale_delay < 0 or downscale_delay < 0:
            raise ValueError("target and interval must be > 0, the delays >= 0")
        if not look_back >= 0:
            raise ValueError(f"look_back must be >= 0, got {look_back}")
        self.minimum = minimum
        self.maximum = maximum
        self.target = target
        self.upscale_delay = upscale_delay
        self.downscale_delay = downscale_delay
        self.interval = interval
        self.look_back = look_back
        self._next_look = now
        #: (time, load) of the looks less than ``look_back`` before the last one,
        #: oldest first: at most look_back / interval + 1 (a look per interval)
        self._window: collections.deque[tuple[float, float]] = collections.deque()
        #: since when the looks ask for more replicas than serve (None: the last did not)
        self._above_since: float | None = None
        self._below_since: float | None = None
        #: the most replicas a look asked for since ``_below_since``
        self._below_peak = 0
        self.desired: int | None = None
        self.last_decision: ScaleDecision | None = None
        self.decisions = {UP: 0, DOWN: 0}

    def next_look(self) -> float:
        """When :meth:`decide` looks at the load next."""
        return self._next_look

    def wanted(self, load: float) -> int:
        """The replicas ``load`` asks for: ceil(load / target) within the bounds."""
        n = math.ceil(load / self.target) if load > 0 else 0
        return min(self.maximum, max(self.minimum, n))

    def _average(self, now: float, load: float) -> float:
        """Add the ``load`` sampled at ``now`` to the window and return the mean of
        the loads sampled less than ``look_back`` seconds ago (this one included)."""
        window = self._window
        # (``now - t``, the form the delays are checked in: a look that is a whole
        # delay after a sample never sees it in a window no longer than the delay)
        while window and now - window[0][0] >= self.look_back:
            window.popleft()
        window.append((now, load))
        loads = [sample for _, sample in window]
        # within the samples' range, which rounding could leave: a steady load's
        # mean is that load exactly, and asks for what it asks for
        return min(max(sum(loads) / len(loads), min(loads)), max(loads))

    def decide(self, now: float, *, load: float, current: int) -> int:
        """The replica count to have at ``now``, for ``load`` cost units queued plus
        in service (averaged over the look-back window) and ``current`` replicas
        serving. Not a checkpoint."""
        if now < self._next_look:
            return current
        self._next_look = now + self.interval
        load = self._average(now, load)
        desired = self.desired = self.wanted(load)
        if desired > current:
            self._below_since = None
            if self._above_since is None:
                self._above_since = now
            if now - self._above_since < self.upscale_delay:
                return current
            return self._move(UP, current, desired, now, load)
        if desired < current:
            self._above_since = None
            if self._below_since is None:
                self._below_since = now
                self._below_peak = desired
            else:
                self._below_peak = max(self._below_peak, desired)
            if now - self._below_since < self.downscale_delay:
                return current
            return self._move(DOWN, current, self._below_peak, now, load)
        self._above_since = self._below_since = None
        return current

    def _move(self, direction: str, current: int, desired: int, now: float, load: float) -> int:
        self._above_since = self._below_since = None
        self.decisions[direction] += 1
        self.last_decision = ScaleDecision(
            direction=direction, before=current, after=desired, at=now, load=load
        )
        return desired

    def failed(self) -> None:
        """The last change could not be made (a replica failed to load): the next
        one waits its full delay again, rather than being tried at the next look."""
        self._above_since = self._below_since = None

    def statistics(self) -> AutoscalerStatistics:
        return AutoscalerStatistics(
            min_replicas=self.minimum,
            max_replicas=self.maximum,
            target=self.target,
            desired=self.desired,
            last_decision=self.last_decision,
            decisions=dict(self.decisions),
        )
