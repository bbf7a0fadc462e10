"""Sans-IO decisions for stragglers and failing replicas: the batch deadline learnt
from observed batch times, the split of a failed batch (bisection to find the poison
request), a per-replica circuit breaker, and which of a replica's model errors are
logged. ``now`` is always an argument."""

from __future__ import annotations

import math

import attrs
from trioserve import ReplyRelay, Request, RequestState

_DISPATCHED = RequestState.DISPATCHED


@attrs.frozen(kw_only=True)
class StragglerPolicy:
    """How long a batch may run: ``factor`` × the p99 of recent batch times, within
    [``floor``, ``cap``] seconds (``cap`` until ``min_samples`` batches were seen).
    A request that fails ``poison_attempts`` times when run alone is poison. A batch
    that failed is retried in ``retry_parts`` parts (each request alone when it held
    no more): a round that fails again costs a batch deadline, or a worker, so its
    innocent requests wait through fewer rounds than with halving (log base
    ``retry_parts`` of its size instead of log 2)."""

    factor: float = 4.0
    floor: float = 1.0
    cap: float = 60.0
    poison_attempts: int = 2
    min_samples: int = 16
    retry_parts: int = attrs.field(default=8, validator=attrs.validators.ge(2))


class BatchTimer:
    """Recent batch run times of one model (all replicas) and the deadline they give."""

    __slots__ = ("_deadline", "_i", "_samples", "_since", "policy")
    WINDOW = 256
    RECOMPUTE_EVERY = 32

    def __init__(self, policy: StragglerPolicy) -> None:
        self.policy = policy
        self._samples: list[float] = []
        self._i = 0
        self._since = 0
        self._deadline = policy.cap

    def record(self, seconds: float) -> None:
        s = self._samples
        if len(s) < self.WINDOW:
            s.append(seconds)
        else:
            s[self._i] = seconds
            self._i = (self._i + 1) % self.WINDOW
        self._since += 1
        n = len(s)
        if n >= self.policy.min_samples and (
            self._since >= self.RECOMPUTE_EVERY or n == self.policy.min_samples
        ):
            self._since = 0
            ordered = sorted(s)
            p99 = ordered[min(n - 1, math.ceil(0.99 * n) - 1)]
            pol = self.policy
            self._deadline = min(pol.cap, max(pol.floor, p99 * pol.factor))

    def deadline(self) -> float:
        """Seconds a batch may run before it is cut off."""
        return self._deadline


class RecentQuantile:
    """The ``q`` quantile of the last ``window`` values (None until ``min_samples``),
    recomputed every 32 values."""

    __slots__ = ("_i", "_samples", "_since", "min_samples", "q", "value", "window")

    def __init__(self, q: float, *, window: int = 256, min_samples: int = 16) -> None:
        self.q = q
        self.window = window
        self.min_samples = min_samples
        self._samples: list[float] = []
        self._i = 0
        self._since = 0
        self.value: float | None = None

    def record(self, x: float) -> None:
        s = self._samples
        if len(s) < self.window:
            s.append(x)
        else:
            s[self._i] = x
            self._i = (self._i + 1) % self.window
        self._since += 1
        n = len(s)
        if n >= self.min_samples and (self._since >= 32 or self.value is None):
            self._since = 0
            self.value = sorted(s)[min(n - 1, math.ceil(self.q * n) - 1)]


@attrs.define(eq=False)
class Hang:
    """A model call in a worker thread cut off at its batch deadline: the thread
    cannot be stopped and runs on, its replica degraded, until it ``returned``.
    Each request of the batch it ran keeps it (``Reply.hung``) while it is retried."""

    returned: bool = False


def hung(batch: list[Request]) -> bool:
    """Whether ``batch`` holds a request whose batch hung a worker thread that has not
    returned yet (see :class:`Hang`): run again, it may hang its replica too."""
    for r in batch:
        hangs = r.reply.hung
        if hangs is not None and not all(h.returned for h in hangs):
            return True
    return False


def may_hang(batch: list[Request]) -> bool:
    """Whether ``batch`` holds a request that was in a batch that hung a worker
    thread, returned or not, or whose input did (``Reply.hung``): until it runs to
    completion it may hang its replica too (a batch of two inputs that hang returns
    once both are found, not when the first is)."""
    for r in batch:
        if r.reply.hung is not None:
            return True
    return False


def mark_hung(batch: list[Request], hang: Hang) -> None:
    """The requests of ``batch`` were in a call cut off in a worker thread (``hang``)."""
    for r in batch:
        reply = r.reply
        reply.hung = (hang,) if reply.hung is None else (*reply.hung, hang)


def split(requests: list[Request], parts: int) -> list[list[Request]]:
    """``requests`` in ``parts`` consecutive parts of sizes differing by at most one
    (each alone when there are no more than ``parts``; none empty)."""
    k = min(parts, len(requests))
    if k == 0:
        return []
    size, extra = divmod(len(requests), k)
    out: list[list[Request]] = []
    start = 0
    for j in range(k):
        end = start + size + (j >= k - extra)  # the larger parts last
        out.append(requests[start:end])
        start = end
    return out


def to_retry(batch: list[Request]) -> list[Request]:
    """The requests of a failed ``batch`` to run again in its parts, in its order:
    those still waiting, and, in the place of one answered while the batch ran
    (its deadline passed) whose item others still wait for (``Reply.late``), a
    request carrying that item: its answer is theirs (``LateOutcome.carry``). It
    costs nobody credits (the answered one paid for the item), has no deadline of
    its own (each of those waiting keeps theirs) and is withdrawn when nobody waits
    any more; it keeps the answered one's record as a retry (``attempts``,
    ``suspect``, ``raised_on``, ``hung``), so that it is retried as that request
    would have been. The rest are left out."""
    out = []
    for r in batch:
        reply = r.reply
        if reply.state is _DISPATCHED:
            out.append(r)
            continue
        late = reply.late
        if late is None or not late.expected:
            continue
        relay = ReplyRelay(late.settle)
        if late.carry(relay.reply):
            relay.reply.attempts = reply.attempts
            relay.reply.suspect = reply.suspect
            relay.reply.ran = reply.ran
            relay.reply.raised_on = reply.raised_on
            relay.reply.hung = reply.hung
            out.append(attrs.evolve(
                r, reply=relay.reply, deadline=math.inf, answer_expiry=False
            ))
    return out


def split_failed(
    batch: list[Request], *, poison_attempts: int, parts: int = 2
) -> tuple[list[list[Request]], list[Request]]:
    """Split a batch that failed (timed out, crashed its worker, or raised) for retry.

    Returns (batches to retry, poison requests). Requests no longer dispatched (their
    caller left, or already answered) are dropped (pass :func:`to_retry`'s requests
    to carry an answered one's item for those waiting for it). A batch of several is split in
    ``parts`` (halved by default; see ``StragglerPolicy.retry_parts``), so that
    retries narrow down to the request at fault while the others succeed; a request
    that failed alone counts an attempt (``reply.attempts``) and is poison once it
    reaches ``poison_attempts``. Every request retried is marked ``reply.suspect``
    (see :func:`retried`), and ``reply.ran`` (it reached the model: never refunded).
    """
    alive = [r for r in batch if r.reply.state is _DISPATCHED]
    if not alive:
        return [], []
    for r in alive:
        r.reply.suspect = r.reply.ran = True
    if len(alive) > 1:
        return split(alive, parts), []
    req = alive[0]
    req.reply.attempts += 1
    if req.reply.attempts >= poison_attempts:
        return [], [req]
    return [[req]], []


def handed_back(batch: list[Request]) -> list[Request]:
    """:func:`to_retry` of a batch handed back as it was (it never reached the model,
    or ran into nothing of its own: staged behind a lost worker's batch, or on a
    worker replaced for other inputs' failures). A request of it whose caller left
    meanwhile, not itself a failed batch's retry, never ran: its caller is told
    (``Reply.unrun``) as it is left out (not one that reached a device before:
    ``Reply.ran``)."""
    for r in batch:
        if not r.reply.ran:
            r.reply.unrun()  # a no-op unless its caller left (abandoned)
    return to_retry(batch)


def retried(batch: list[Request]) -> bool:
    """Whether ``batch`` is a retry of a batch that failed (a part of a split batch,
    or a request run alone again): its failure is then its requests' doing, counted
    towards poison, and says nothing of its replica. A batch that fails on fresh work
    is the replica's failure (see :class:`Breaker`)."""
    return bool(batch) and all(r.reply.suspect for r in batch)


@attrs.define
class LogThrottle:
    """Which of a run of like events to log: the first at once, then at most one
    every ``interval`` seconds, each saying how many were not logged since the last.
    A model that raises on every request logs a line every ``interval``, not one a
    request, and a single failure is never hidden."""

    interval: float = 10.0
    _next: float = -math.inf
    _unlogged: int = 0

    def admit(self, now: float) -> int | None:
        """None: do not log this one (it is counted). Else log it: the events not
        logged since the last one logged."""
        if now < self._next:
            self._unlogged += 1
            return None
        unlogged, self._unlogged = self._unlogged, 0
        self._next = now + self.interval
        return unlogged


class Breaker:
    """A replica's circuit breaker: ``threshold`` failures in a row (straggler or
    crashed worker on fresh work; not the retries of a failed batch, see
    :func:`retried`) open it for ``cooldown`` seconds (doubling up to ``max_cooldown``
    while it keeps failing); then the replica pulls again (half-open: a worker
    process stages its usual three batches), a success closes it and a failure on
    fresh work opens it again.

    A model that raises counts too, but only on evidence that the replica, not its
    inputs, is at fault, within its current run of failures (from its first raise
    since its last success of any kind, retries included):

    - a request that raised alone here (a part of a failed batch) and was then
      answered with a result by another replica (:meth:`confirmed`);
    - a request alone on fresh work that raised here while another replica of the
      model completed a batch since the run began (:meth:`raised`; nothing else can
      be known of it: its caller gets the error at once).

    A batch of several that raises on fresh work begins the run but is no evidence
    by itself: one input may be bad (its parts tell). A model that raises on every
    replica (a bug, an input bad for everyone) never opens a breaker, and its
    callers keep getting its error at once."""

    __slots__ = (
        "_cooldown", "_since", "base", "failures", "max_cooldown", "open_until", "openings",
        "run", "threshold",
    )

    def __init__(
        self, *, threshold: int = 5, cooldown: float = 1.0, max_cooldown: float = 30.0
    ) -> None:
        self.threshold = threshold
        self.base = cooldown
        self.max_cooldown = max_cooldown
        self._cooldown = cooldown
        self.failures = 0
        self.open_until = -math.inf
        #: the model's successful batches (all replicas) when this replica's model
        #: first raised since its last success (None: it has not)
        self._since: int | None = None
        #: which run of failures this is: grows at each success (a mark taken in
        #: one run is stale in the next)
        self.run = 0
        #: times it opened since its last success
        self.openings = 0

    def failure(self, now: float) -> None:
        self.failures += 1
        if self.failures >= self.threshold:
            self.open_until = now + self._cooldown
            self._cooldown = min(self.max_cooldown, self._cooldown * 2)
            self.openings += 1

    def raised(self, now: float, successes: int, *, alone: bool = True) -> bool:
        """The model raised on fresh work on this replica, on a request ``alone`` or
        on a batch of several; ``successes``: the model's successful batches so
        far, on all its replicas (a count that never goes down). A request alone
        counts as a failure only when that count grew since this replica's first
        raise of its current run: the successes are then other replicas' (one of
        its own would have ended the run). A batch of several never counts here.
        While it is open the raise is no new evidence (as for :meth:`confirmed`):
        it is a batch staged before it opened (a worker process holds several),
        of the same failures; counted, it opened the breaker a second time, which
        doubled the cooldown and kept the worker's successor from its trial at
        once (:meth:`replaced`). Returns whether the breaker (re)opened."""
        if self._since is None:
            self._since = successes  # the run begins: no evidence yet
            return False
        if not alone or successes <= self._since or self.is_open(now):
            return False  # its inputs' doing, or nothing succeeded anywhere since
        self.failure(now)
        return self.failures >= self.threshold

    def confirmed(self, now: float, run: int) -> bool:
        """A request that raised alone on this replica during run ``run`` was
        answered with a result by another replica: the replica fails on sound
        input. Counts as a failure unless the replica succeeded since, or its worker
        was replaced (a later run), or the breaker is open already (evidence that
        comes in after it opened, from the parts of the same failures, is not new).
        Returns whether the breaker (re)opened."""
        if run != self.run or self.is_open(now):
            return False
        self.failure(now)
        return self.failures >= self.threshold

    def replaced(self, now: float) -> None:
        """The replica's worker was replaced because the breaker opened: what was
        marked so far is stale (a replaced worker's failures say nothing of its
        successor). At the breaker's first opening since its last success the
        successor runs the trial as soon as it is up: a fresh process is the remedy
        for what broke the old one (a sticky CUDA error), and while it waited out
        the cooldown, every caller whose request ran on the other replicas, broken
        by the same input, got an error. A trial that fails opens the breaker again,
        with the cooldown doubled, as before."""
        self.run += 1
        if self.openings == 1 and self.open_until > now:
            self.open_until = now

    def success(self) -> None:
        self.failures = 0
        self.openings = 0
        self._cooldown = self.base
        self.open_until = -math.inf
        self._since = None
        self.run += 1

    def is_open(self, now: float) -> bool:
        return now < self.open_until

    def half_open(self, now: float) -> bool:
        """Whether it opened since its last success and its cooldown has passed: the
        replica pulls again on probation, until a batch that succeeds closes it or a
        failure on fresh work opens it again."""
        return self.openings > 0 and not self.is_open(now)
