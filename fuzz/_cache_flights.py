"""The cache suite's view of the flights and its checks of them against a reference
of docs/cache.md's rules ("a flight and its callers' deadlines").

:func:`observed_flights` wraps the cache actor's ``SingleFlight`` table (whatever
class the product, or a planted bug, put there): every call (which caller, whether it
joined a flight in flight, the deadline it brought) and every run of a flight's
computation (a *round*: its driver, when it began and ended, what it raised) is
recorded as a :class:`FlightRecord`. :func:`check_flights` then holds them to the
rules:

- a flight's first round is driven by the caller that started it, and no caller
  drives twice (so none pays twice);
- a round that raised an error belonging to a deadline (DeadlineExceeded: its
  driver's; an Overloaded refusal: the deadline it names) is followed at once by a
  round driven by a waiter whose own deadline is later, the earliest of them, when
  there is one, and by none otherwise; any other outcome ends the flight;
- but when its driver was answered DeadlineExceeded while its batch ran (a model
  off the event loop: the round's ``LateOutcome`` was told to expect an outcome)
  and a waiter with a later deadline waits, no round follows until that batch's
  outcome for the driver's item comes: a value ends the flight (no second model
  call), and so does the model's error for the item (a ModelError: it raised on it
  alone, it is poison...), which answers every waiter left; a failure with no
  answer of the item's is followed at that instant by a round for the earliest
  waiter whose deadline is later than it, as above;
- each caller is answered by the first round that answers it (the one it drove, one
  with no deadline in its error, or one whose error's deadline is not before its
  own), at that round's end, with its outcome; one waiting for the late outcome of
  a batch gets its value (or the model's error for the item) as the batch ends, or
  its own DeadlineExceeded at its own deadline if that comes first (never a late
  answer after it);
- ``computations`` counts the flights, ``reruns`` their rounds after the first,
  ``late_answers`` the batches whose late value or error answered a flight's waiters, and
  each tenant was charged once per round (and for what it asked outside flights):
  a late answer is charged to nobody.

Instants are exact (ticks of 2**-10 s): a caller joining, or leaving, at the very
instant a round ends may be seen by that round or not, and both are allowed.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import attrs
import outcome
import trio
from trioserve import DeadlineExceeded, ModelError, Overloaded

from ._cache_scenario import TICK, deadline_ticks
from ._stats import note

if TYPE_CHECKING:
    from ._cache import CacheRun

#: The number of the ask whose task this is (set by each caller of the scenario).
ASK: contextvars.ContextVar[int] = contextvars.ContextVar("fuzz_cache_ask", default=-1)


@attrs.define(eq=False)
class Round:
    """One run of a flight's computation, for caller ``driver``; ``late``: its
    request was answered while its batch ran (the replica expects an outcome for it),
    ``late_end`` when that batch's outcome for it came (None: none yet),
    ``late_ok`` whether it was a value, and ``late_error`` the model's error for the
    item when that was it (None: it was not)."""

    driver: int
    at: float
    end: float | None = None
    error: BaseException | None = None
    ok: bool = False
    late: bool = False
    late_end: float | None = None
    late_ok: bool = False
    late_error: BaseException | None = None
    #: the batches (``fuzz._cache_model.Dispatched``) its request was taken in, in order,
    #: and the one holding it when the replica answered it while it ran, or, once
    #: a batch that failed carried its item into a retry, the last one that took
    #: the request carrying it (``carriers``: those requests' replies)
    batches: list[Any] = attrs.Factory(list)
    late_batch: Any = None
    carriers: list[Any] = attrs.Factory(list)
    #: the batches its item was carried out of, into a retry (one per carrier)
    carried_from: list[Any] = attrs.Factory(list)


class SeenLate:
    """A round's ``LateOutcome`` (``late=``), as the computation and the replica use it,
    reporting :meth:`expect` (and the batch holding the round's request then) and the
    first :meth:`settle` to its :class:`Round` (``round``)."""

    def __init__(self, inner: Any, rnd: Round) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "round", rnd)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)

    def expect(self, *args: Any, **kw: Any) -> None:
        rnd = self.round
        rnd.late = True
        if rnd.late_batch is None and rnd.batches:
            rnd.late_batch = rnd.batches[-1]
        self._inner.expect(*args, **kw)

    def settle(self, result: Any) -> None:
        rnd = self.round
        if rnd.late_end is None:
            rnd.late_end = trio.current_time()
            rnd.late_ok = isinstance(result, outcome.Value)
            if isinstance(result, outcome.Error) and isinstance(result.error, ModelError):
                rnd.late_error = result.error
        self._inner.settle(result)

    def carry(self, reply: Any) -> bool:
        carried = self._inner.carry(reply)
        if carried:
            self.round.carriers.append(reply)
            self.round.carried_from.append(self.round.late_batch)
        return carried


def carrying(reply: Any) -> SeenLate | None:
    """The round's hook whose item the request of ``reply`` carries into a retry
    (``Reply.late``, ``LateOutcome.carry``: its answer goes to that hook through a
    ``ReplyRelay``), or None."""
    owner = getattr(getattr(reply.group, "_to", None), "__self__", None)
    return owner if isinstance(owner, SeenLate) else None


@attrs.define(eq=False)
class FlightRecord:
    """One flight: who started it, who joined (in order), and its rounds."""

    key: Any
    starter: int
    joined: list[int] = attrs.Factory(list)
    rounds: list[Round] = attrs.Factory(list)


class _ObservedFlights:
    """A SingleFlight table reporting to ``run``."""

    def __init__(self, inner: Any, run: CacheRun) -> None:
        self._inner = inner
        self._run = run
        self._current: dict[Hashable, FlightRecord] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._inner

    def __len__(self) -> int:
        return len(self._inner)

    def statistics(self) -> Any:
        return self._inner.statistics()

    async def call(
        self, key: Hashable, fn: Any, *args: Any, deadline: float = math.inf, **kw: Any
    ) -> Any:
        run, i = self._run, ASK.get()
        record: FlightRecord | None
        if key in self._inner:
            record = self._current.get(key)
            if record is None:  # a table keyed otherwise (a planted bug's): not followed
                run.flights_unobserved = True
            else:
                record.joined.append(i)
        else:
            record = self._current[key] = FlightRecord(key=key, starter=i)
            run.flight_records.append(record)
        run.flight_calls[i] = (record, deadline)

        async def driven(*a: Any, **kw: Any) -> Any:
            rnd = Round(driver=i, at=trio.current_time())
            if record is not None:
                record.rounds.append(rnd)
            if kw.get("late") is not None:
                kw["late"] = SeenLate(kw["late"], rnd)
            try:
                value = await fn(*a, **kw)
            except BaseException as exc:
                rnd.end, rnd.error = trio.current_time(), exc
                raise
            rnd.end, rnd.ok = trio.current_time(), True
            return value

        return await self._inner.call(key, driven, *args, deadline=deadline, **kw)


def observed_flights(base: type, run: CacheRun) -> property:
    """A ``_flights`` property for a subclass of the cache actor class ``base``: what
    ``base`` stores there (through its own property, if a planted bug has one) is
    read back wrapped in :class:`_ObservedFlights`."""
    inner = getattr(base, "_flights", None)

    def get(self: Any) -> Any:
        flights = inner.fget(self) if isinstance(inner, property) else self.__dict__.get(
            "_fuzz_flights"
        )
        if flights is None:
            return None
        seen = self.__dict__.get("_fuzz_observed")
        if seen is None or seen._inner is not flights:
            seen = self.__dict__["_fuzz_observed"] = _ObservedFlights(flights, run)
        return seen

    def put(self: Any, flights: Any) -> None:
        if isinstance(inner, property):
            inner.fset(self, flights)
        else:
            self.__dict__["_fuzz_flights"] = flights

    return property(get, put)


# ---------------------------------------------------------------- the checks
def _bound(exc: BaseException | None, deadline: float, end: float) -> float | None:
    """The deadline an error of a round driven with ``deadline`` and ended at
    ``end`` belongs to (docs/cache.md): DeadlineExceeded, the driver's; an Overloaded
    refusal, the one it names; either no earlier than ``end`` (a waiter whose own
    deadline has passed is answered with it too); None: the computation's own (it
    answers every waiter)."""
    if isinstance(exc, DeadlineExceeded):
        return max(deadline, end)
    if isinstance(exc, Overloaded) and exc.deadline is not None:
        return max(exc.deadline, end)
    return None


def deadline_of(run: CacheRun, i: int) -> float:
    """Caller ``i``'s own deadline in trio time (inf: none): its arrival plus its
    model's or class's timeout."""
    ticks = deadline_ticks(run.scenario, run.scenario.asks[i])
    return math.inf if ticks is None else run.started[i][0] + ticks * TICK


def check_flights(run: CacheRun) -> tuple[str, str] | None:
    """The first broken rule of the flights (invariant, what happened), or None."""
    if run.flights_unobserved:
        return None
    reruns = 0
    late = [0, 0]  # the late answers expected: at least, at most
    for record in run.flight_records:
        broken = _check_record(run, record, late)
        if broken is not None:
            return broken
        reruns += max(0, len(record.rounds) - 1)
    note("cache", "flight reruns", reruns)
    note("cache", "late answers", late[0])
    stats = run.flights
    if stats and not late[0] <= stats.get("late_answers", 0) <= late[1]:
        expected = f"{late[0]}" if late[0] == late[1] else f"{late[0]} to {late[1]}"
        return (
            "statistics",
            f"the cache actor counts {stats['late_answers']} late answers; {expected} "
            "batches answered the waiters of a flight whose driver's deadline passed "
            "while they ran",
        )
    if stats and (
        stats.get("reruns") != reruns or stats.get("computations") != len(run.flight_records)
    ):
        return (
            "statistics",
            f"the cache actor counts {stats.get('computations')} computations and "
            f"{stats.get('reruns')} reruns; {len(run.flight_records)} flights ran "
            f"{len(run.flight_records) + reruns} rounds ({reruns} after a flight's first)",
        )
    return _check_charges(run)


def _waiting(run: CacheRun, i: int, t: float) -> bool | None:
    """Whether caller ``i`` (of a flight) waits at ``t``: True, False, or None when it
    came or left at that very instant (either may be seen)."""
    start = run.started[i][0]
    out = run.outcomes.get(i)
    if start > t:
        return False
    left = out is not None and out.kind == "cancelled"
    if start == t or (left and out.at == t):  # type: ignore[union-attr]
        return None
    return not (left and out.at < t)  # type: ignore[union-attr]


def _check_record(
    run: CacheRun, record: FlightRecord, late: list[int]
) -> tuple[str, str] | None:
    from ._cache_checks import describe

    rounds = record.rounds
    who = f"the flight of {describe(record.starter, run.scenario.asks[record.starter])}"
    if not rounds:
        return None  # every waiter left before it began
    if rounds[0].driver != record.starter:
        return ("outcome", f"{who} began with a round driven by ask #{rounds[0].driver}")
    waiters = [record.starter, *record.joined]
    for i in waiters:
        d = deadline_of(run, i)
        given = run.flight_calls[i][1]
        if given != d:
            return (
                "deadline",
                f"{who}: ask #{i} came with deadline {run.at(given)} to the flight, its own "
                f"(arrival + timeout) is {run.at(d)}",
            )
    drivers: set[int] = set()
    for n, rnd in enumerate(rounds):
        broken = _check_late_source(run, who, n, rnd)
        if broken is not None:
            return broken
        if rnd.driver in drivers:
            return (
                "credits",
                f"{who}: ask #{rnd.driver} drove a second round (round {n}): it paid twice",
            )
        drivers.add(rnd.driver)
        nxt = rounds[n + 1] if n + 1 < len(rounds) else None
        if rnd.end is None:  # cancelled: every waiter left, or the runtime closed
            if nxt is not None:
                return ("outcome", f"{who}: round {n} never ended, yet round {n + 1} began")
            continue
        bound = None if rnd.ok else _bound(rnd.error, deadline_of(run, rnd.driver), rnd.end)
        what = "its answer" if rnd.ok else f"{type(rnd.error).__name__}"
        if bound is None:
            if nxt is not None:
                return (
                    "outcome",
                    f"{who}: round {n} (ask #{rnd.driver}) ended at {run.at(rnd.end)} with "
                    f"{what}, which answers every waiter, yet round {n + 1} ran for ask "
                    f"#{nxt.driver}",
                )
            continue
        later = _later(run, waiters, drivers, bound, rnd.end)
        sure = [i for i, w in later if w]
        # The driver was answered while its batch ran, and waiters with a later
        # deadline wait for that batch's outcome (a tie seen either way: as decided
        # by whether a round ran at once)
        if rnd.late and later and (sure or nxt is None or nxt.at != rnd.end):
            note("cache", "flights waiting for a late answer")
            lend = rnd.late_end
            answered = rnd.late_ok or rnd.late_error is not None
            if lend is not None and answered:
                # (a waiter still there at the batch's end is answered by it)
                at_end = _later(run, waiters, drivers, lend, lend, tie=True)
                late[0] += any(w for j, w in at_end if deadline_of(run, j) > lend)
                late[1] += bool(at_end)
            if lend is None or answered:
                if nxt is not None:
                    return (
                        "outcome",
                        f"{who}: round {n} (ask #{rnd.driver}) ended at {run.at(rnd.end)} "
                        f"with {what} while its batch ran, and its batch "
                        + (
                            "never answered" if lend is None
                            else f"answered at {run.at(lend)} (its value or the item's "
                            "ModelError), which answers every waiter left"
                        )
                        + f", yet round {n + 1} ran for ask #{nxt.driver} at "
                        f"{run.at(nxt.at)}: a second model call",
                    )
                continue
            # the batch failed: the flight runs again at its end, as after a round
            what = f"{what}, and its batch failed at {run.at(lend)}"
            bound = lend
            later = _later(run, waiters, drivers, lend, lend)
            sure = [i for i, w in later if w]
            end = lend
        else:
            end = rnd.end
        broken = _next_round(run, who, n, rnd, what, end, bound, later, sure, nxt)
        if broken is not None:
            return broken
    for i in waiters:
        broken = _check_waiter(run, record, i, who)
        if broken is not None:
            return broken
    return None


def _check_late_source(run: CacheRun, who: str, n: int, rnd: Round) -> tuple[str, str] | None:
    """Round ``n``'s late outcome, when its driver was answered while its batch ran,
    comes as that batch leaves its replica: the model's value for the item if it
    answered the batch, none if it did not (the model raised; the batch was cut off,
    its worker died, it was handed back as it was), or the model's error for the
    item (it raised on it alone, it is poison), which is no value either. A batch
    that failed and was retried in parts may carry the item into a part (docs/cache.md): the outcome
    then comes as the last batch that took the request carrying it leaves, the same
    way, unless nobody waited for it any more (that request withdrawn before its
    batch left, or never taken before the runtime closed). The suite's own record of
    the batches says which and when, not the product's hook: a hook never settled
    would leave the waiters for it waiting in vain (until their own deadline, or for
    ever without one)."""
    if not rnd.late:
        return None
    b = rnd.late_batch
    if b is None:
        return (
            "outcome",
            f"{who}: round {n} (ask #{rnd.driver}) was answered while its batch ran, but "
            "no replica had taken its request",
        )
    if b.end is None or b.end >= run.closed_at:
        return None  # it ran on as the runtime closed: every caller was back
    held = [j for j, r in enumerate(b.replies) if any(r is c for c in rnd.carriers)]
    if rnd.carriers:
        note("cache", "late outcomes carried into a retry")
    alive = bool(held) and bool(b.alive) and any(b.alive[j] for j in held)
    if held and not alive and b.alive and rnd.late_end is None:
        return None  # withdrawn before its batch left: nobody waited
    if (rnd.carriers and not held) or (alive and b.how != "ok" and rnd.late_end != b.end):
        # carried out of ``b`` into a retry no replica took: withdrawn (nobody
        # waited), or failed as the runtime closed
        if rnd.late_end is None or (rnd.late_end >= run.closed_at and not rnd.late_ok):
            return None
    ok = b.how == "ok"
    if rnd.late_end == b.end and rnd.late_ok == ok:
        if not ok:
            note("cache", "late outcomes of a batch that failed")
        return None
    came = (
        "never came" if rnd.late_end is None
        else f"came at {run.at(rnd.late_end)} ({'a value' if rnd.late_ok else 'none'})"
    )
    return (
        "outcome",
        f"{who}: round {n} (ask #{rnd.driver}) was answered "
        f"{type(rnd.error).__name__} while its batch ran; that batch (taken at "
        f"{run.at(b.at)}) left its replica at {run.at(b.end)} ({b.how}), so the outcome "
        f"for the driver's item was {'its value' if ok else 'none'} then, but it {came}: "
        "those waiting for it wait in vain",
    )


def _later(
    run: CacheRun, waiters: list[int], drivers: set[int], bound: float, t: float,
    *, tie: bool = False,
) -> list[tuple[int, bool | None]]:
    """The waiters that drove no round whose own deadline is after ``bound`` (or at
    it, ``tie``) and who may wait at ``t``: each with whether it surely does."""
    return [
        (i, w) for i in waiters
        if i not in drivers
        and (deadline_of(run, i) > bound or (tie and deadline_of(run, i) == bound))
        and (w := _waiting(run, i, t)) is not False
    ]


def _next_round(
    run: CacheRun, who: str, n: int, rnd: Round, what: str, end: float, bound: float,
    later: list[tuple[int, bool | None]], sure: list[int], nxt: Round | None,
) -> tuple[str, str] | None:
    """The round after round ``n``, whose error (``what``) of the deadline ``bound``
    was final at ``end``: at once, for the earliest of the waiters with a later
    deadline, or none when none waits."""
    if nxt is None:
        if sure:
            return (
                "deadline",
                f"{who}: round {n} (ask #{rnd.driver}) ended at {run.at(end)} with "
                f"{what} of the deadline {run.at(bound)}, and no round ran for ask "
                f"#{sure[0]}, waiting with its own deadline "
                f"{run.at(deadline_of(run, sure[0]))}",
            )
        return None
    d_next = deadline_of(run, nxt.driver)
    earliest = min((deadline_of(run, i) for i in sure), default=math.inf)
    if nxt.at != end or nxt.driver not in {i for i, _ in later} or d_next > earliest:
        return (
            "deadline",
            f"{who}: round {n} (ask #{rnd.driver}) ended at {run.at(end)} with "
            f"{what} of the deadline {run.at(bound)}; round {n + 1} began at "
            f"{run.at(nxt.at)} for ask #{nxt.driver} (deadline {run.at(d_next)}), "
            f"expected at once for the waiter with the earliest deadline after "
            f"{run.at(bound)} ("
            + (
                "waiting: " + ", ".join(
                    f"#{i} {run.at(deadline_of(run, i))}" for i, _ in later
                ) if later else "none waits with a later one"
            )
            + ")",
        )
    return None


def _answers(run: CacheRun, rnd: Round, i: int) -> bool:
    if rnd.end is None or rnd.ok or rnd.driver == i:
        return True
    bound = _bound(rnd.error, deadline_of(run, rnd.driver), rnd.end)
    return bound is None or deadline_of(run, i) <= bound


def _check_waiter(
    run: CacheRun, record: FlightRecord, i: int, who: str
) -> tuple[str, str] | None:
    """Caller ``i`` got the outcome of the first round that answers it, at its end."""
    out = run.outcomes.get(i)
    if out is None or out.kind == "cancelled":
        return None  # lost, or left: the outcome checks judge it
    start = run.started[i][0]
    d = deadline_of(run, i)
    allowed = []
    #: what it may get from a batch whose driver's deadline passed while it ran:
    #: (a result or DeadlineExceeded, when)
    late: list[tuple[str, float]] = []
    for rnd in record.rounds:
        lend = rnd.late_end
        if (
            rnd.late and rnd.end is not None and not rnd.ok and rnd.driver != i
            and not _answers(run, rnd, i) and (lend is None or lend >= start)
        ):
            # it waits for that batch, until its own deadline
            if lend is None or d <= lend:
                late.append(("DeadlineExceeded", d))
            if lend is not None and rnd.late_ok and d >= lend:
                late.append(("result", lend))
            if lend is not None and rnd.late_error is not None and d >= lend:
                late.append((type(rnd.late_error).__name__, lend))
            if lend is None or rnd.late_ok or rnd.late_error is not None or d <= lend:
                break
            continue  # the batch failed: a later round answers it
        if (rnd.end is not None and rnd.end < start) or not _answers(run, rnd, i):
            continue
        allowed.append(rnd)
        if rnd.driver == i or rnd.end is None or rnd.end > start:
            break
        # it came at this round's very end: this one answers it, or a later one
    got_kind = "result" if out.kind == "result" else type(out.value).__name__
    if (got_kind, out.at) in late:
        if got_kind == "result":
            note("cache", "waiters answered by a late answer")
        return None
    for rnd in allowed:
        if rnd.end != out.at:
            continue
        if rnd.ok and out.kind == "result":
            return None
        if rnd.end is None or (
            rnd.error is not None and out.kind == "error"
            and type(out.value) is type(rnd.error)
        ):
            return None
    expect = "; ".join(
        f"round of ask #{r.driver} ended at "
        f"{'never' if r.end is None else run.at(r.end)} with "
        f"{'its answer' if r.ok else type(r.error).__name__}"
        for r in allowed
    ) or "no round"
    expect += "".join(
        f"; {'a late result' if k == 'result' else k} at {run.at(t)}" for k, t in late
    )
    got = "a result" if out.kind == "result" else type(out.value).__name__
    return (
        "outcome",
        f"{who}: ask #{i} (deadline {run.at(deadline_of(run, i))}) got {got} at "
        f"{run.at(out.at)}; the round that answers it: {expect}",
    )


def _check_charges(run: CacheRun) -> tuple[str, str] | None:
    """Each tenant was charged once per round it drove, per item computed for its
    batch calls, and per item of its calls of a model the cache actor does not
    handle: nothing else (``credits_used`` + ``credits_refunded``, one unit an
    item)."""
    sc = run.scenario
    expected = [0] * sc.tenants
    for record in run.flight_records:
        for rnd in record.rounds:
            expected[sc.asks[rnd.driver].tenant] += 1
    for i, n in run.batch_charges.items():
        expected[sc.asks[i].tenant] += n
    for i, ask in enumerate(sc.asks):
        rule = sc.models[ask.model]
        if not (rule.cache or rule.coalesce) and i in run.started:
            expected[ask.tenant] += len(ask.keys)
    for t in range(sc.tenants):
        name = f"t{t}"
        charged = run.charged.get(name, 0)
        if charged != expected[t]:
            return (
                "credits",
                f"tenant {name} was charged {charged} units (credits used and refunded); "
                f"its callers' runs were {expected[t]}: one a round it drove, one an item "
                "it submitted outside a flight",
            )
    return None
