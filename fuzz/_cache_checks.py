"""The cache suite's checks of a played scenario (:func:`check_cache`): each caller's
outcome and every answer's origin, isolation, freshness and errors."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import numpy as np
from trioserve import DeadlineExceeded, ModelError, Overloaded

from ._cache_flights import SeenLate, carrying, check_flights, deadline_of
from ._cache_scenario import HORIZON_S, TICK, Ask, ModelRule, deadline_ticks
from ._checker import InvariantViolation
from ._stats import note

if TYPE_CHECKING:
    from ._cache import CacheRun

#: The fields of an answer ``y``.
MODEL, KEY, GEN, TENANT, RUN = range(5)


def check_cache(run: CacheRun) -> None:
    sc = run.scenario
    if not run.caches:
        raise RuntimeError(
            "fuzz: open_runtime did not build its cache from trioserve.actors.Cache; "
            "update fuzz/_cache.py:product_installed"
        )
    s = run.caches[0].statistics()
    note("cache", "hits", s.hits)
    note("cache", "misses", s.misses)
    note("cache", "evictions", s.evictions)
    note("cache", "expirations", s.expirations)
    note("cache", "invalidations", s.invalidations)
    note("cache", "joined flights", run.flights.get("coalesced", 0))
    note("cache", "model runs", len(run.runs))
    for i, out in run.outcomes.items():
        kind = type(out.value).__name__ if out.kind == "error" else out.kind
        note("cache", f"outcome: {kind}")
        if isinstance(out.value, DeadlineExceeded) and i in run.flight_calls:
            note("cache", "flight callers answered DeadlineExceeded")
    if run.violations:
        raise InvariantViolation(*run.violations[0])
    for i, ask in enumerate(sc.asks):
        _check_ask(run, i, ask)
    for i, ask in enumerate(sc.asks):
        _check_deadline(run, i, ask)
    broken = check_flights(run)
    if broken is not None:
        raise InvariantViolation(*broken)


def describe(i: int, ask: Ask) -> str:
    how = "infer_batch" if ask.batch or len(ask.keys) > 1 else "infer"
    return (
        f"ask #{i} (tick {ask.at}, tenant t{ask.tenant}, class c{ask.cls}, {how} of m"
        f"{ask.model} keys {list(ask.keys)})"
    )


_RUN_OF_ERROR = re.compile(r"planted model error on key (\d+) \(run (\d+)\)")
_POISON = re.compile(
    r"poison request, not retried: its batch failed: (.*) each of the (\d+) times it ran alone"
)
#: what a poison request's error says of its last failure, by how its batch left
_POISON_WHY = {"killed": "ran past its batch deadline", "died": "died"}


def _item_of(reply: Any) -> int:
    """Which run of an item the request of ``reply`` is: a flight round's request
    and the requests carrying its item into retries after it was answered while
    its batch ran (docs/cache.md) are one; any other request is its own."""
    hook = reply.late if isinstance(reply.late, SeenLate) else carrying(reply)
    return id(hook.round) if hook is not None else id(reply)


def _carried_out(b: Any, j: int) -> bool:
    """Whether the request ``j`` of batch ``b``, answered while ``b`` ran, or a
    request carrying its item, had that item carried out of ``b`` into a retry for
    the waiters of its flight (``to_retry``: it ran there as a request still
    waiting does, alone when nothing else in ``b`` waited)."""
    reply = b.replies[j]
    hook = reply.late if isinstance(reply.late, SeenLate) else carrying(reply)
    return hook is not None and any(x is b for x in hook.round.carried_from)


def _check_poison(run: CacheRun, i: int, ask: Ask, poison: re.Match[str], at: float) -> None:
    """Caller ``i`` was answered at ``at`` that its request is poison: a request of
    its model, one of its keys, its tenant and class, failed alone (the only one of
    its batch still waiting) ``POISON_ATTEMPTS`` times, its batch cut off or its
    worker dead each time, the last one at ``at`` (by then, for a batch call, which
    returns once every item is answered), which the error names; outside a flight,
    all since the call began (a caller that joined a flight gets the error of the
    request its flight ran)."""
    from ._cache import POISON_ATTEMPTS

    cls = f"c{ask.cls}"
    start = run.started[i][0]
    flight = i in run.flight_calls
    # (a batch call returns once all its items are answered)
    several = ask.batch or len(ask.keys) > 1
    fails: dict[int, list[Any]] = {}
    for b in run.dispatched:
        if b.model != ask.model or b.how not in _POISON_WHY or b.end is None or b.end > at:
            continue
        alive = [j for j, a in enumerate(b.alive) if a or _carried_out(b, j)]
        if len(alive) != 1:
            continue
        j = alive[0]
        k, t, c, _ = b.items[j]
        if k in ask.keys and t == ask.tenant and c == cls:
            fails.setdefault(_item_of(b.replies[j]), []).append(b)
    for tried in fails.values():
        last = tried[-1]
        if (
            len(tried) == POISON_ATTEMPTS == int(poison.group(2))
            and (last.end == at or (several and last.end < at))
            and _POISON_WHY[last.how] in poison.group(1)
            and (flight or tried[0].at >= start)
        ):
            note("cache", "callers answered as poison requests")
            return
    seen = "; ".join(
        f"a request failed alone {len(tried)} time(s), last at {run.at(tried[-1].end)} "
        f"({tried[-1].how})" for tried in fails.values()
    ) or "no request of its keys failed alone"
    raise InvariantViolation(
        "outcome",
        f"{describe(i, ask)} was answered at {run.at(at)} that its request is poison "
        f"({poison.group(0)!r}), but {seen}: a request is poison when it failed alone "
        f"{POISON_ATTEMPTS} times (its batch cut off, or its worker dead), the last then",
    )


def _check_ask(run: CacheRun, i: int, ask: Ask) -> None:
    sc = run.scenario
    who = describe(i, ask)
    out = run.outcomes.get(i)
    if out is None:
        raise InvariantViolation(
            "lost", f"{who} never got an answer ({HORIZON_S:g} s of trio time after the last event)"
        )
    start, gen0 = run.started[i]
    cancel_at = None if ask.cancel is None else start + ask.cancel * TICK
    if cancel_at is not None and out.at > cancel_at:
        raise InvariantViolation(
            "outcome", f"{who} returned at {run.at(out.at)}, after its cancel time "
            f"{run.at(cancel_at)}"
        )
    if out.kind == "cancelled":
        if cancel_at is None or out.at != cancel_at:
            raise InvariantViolation(
                "outcome", f"{who} was cancelled at {run.at(out.at)} but nobody cancelled it then"
            )
        return
    rule = sc.models[ask.model]
    if out.kind == "result":
        values = list(out.value)
        if len(values) != len(ask.keys):
            raise InvariantViolation(
                "misrouted", f"{who} got {len(values)} answers for {len(ask.keys)} keys"
            )
        for j, (value, k) in enumerate(zip(values, ask.keys, strict=True)):
            _check_answer(run, who, ask, j, k, np.asarray(value["y"]), start, gen0, rule)
        return
    exc = out.value
    if isinstance(exc, Overloaded) and _sheddable(run, i, ask, rule, exc):
        return
    if isinstance(exc, DeadlineExceeded) and deadline_of(run, i) < math.inf:
        return  # when: _check_deadline
    m = _RUN_OF_ERROR.search(str(exc)) if isinstance(exc, ModelError) else None
    poison = _POISON.search(str(exc)) if isinstance(exc, ModelError) else None
    if poison is not None:
        _check_poison(run, i, ask, poison, out.at)
        return
    if m is None:
        left = [
            j for j, a in enumerate(sc.asks)
            if j != i and a.cancel is not None and a.model == ask.model
            and run.outcomes.get(j) is not None and run.outcomes[j].kind == "cancelled"
            and set(a.keys) & set(ask.keys)
        ]
        hint = (
            f" (callers of the same keys that left: {', '.join(f'#{j}' for j in left)}: "
            "a caller that left must not cancel what others wait for)" if left else ""
        )
        raise InvariantViolation(
            "outcome",
            f"{who} raised {type(exc).__name__}: {exc} — not an outcome its situation "
            f"allows{hint}",
        )
    key, number = int(m.group(1)), int(m.group(2))
    r = run.runs[number] if number < len(run.runs) else None
    mine = r is not None and r.model == ask.model and any(
        k == key and t == ask.tenant for k, t, _ in r.items
    )
    if r is None or r.status != "error" or not mine or key not in ask.keys:
        raise InvariantViolation(
            "misrouted",
            f"{who} got the ModelError of run {number} on key {key}, which is not a failed "
            f"run of its own model, tenant and keys",
        )
    if r.end < start:
        raise InvariantViolation(
            "cached-error",
            f"{who} got the ModelError of run {number} (key {key}), which raised at "
            f"{run.at(r.end)}, before the call started at {run.at(start)}: an error was "
            "kept and served again",
        )


def _sheddable(run: CacheRun, i: int, ask: Ask, rule: ModelRule, exc: Overloaded) -> bool:
    """Whether the runtime may shed the call (Overloaded: it could not be served
    before its deadline). Only against a deadline it sees, and not before the
    caller's own: outside a flight its cancel scope's deadline or its timeout,
    through a flight its timeout only (a flight runs in the cache actor's nursery,
    without its callers' cancel scopes), and a refusal measured against the
    deadline of the caller a flight ran for answers only a caller whose own is not
    later (the queue holds far more than a scenario asks: a refusal of the load
    alone, with no deadline, never comes)."""
    flight = (rule.cache or rule.coalesce) and len(ask.keys) == 1  # infer_batch of one too
    own = deadline_of(run, i)
    if not flight and ask.cancel is not None and ask.cancel_how == "deadline":
        own = min(own, run.started[i][0] + ask.cancel * TICK)
    if exc.deadline is None:
        return False
    return own <= exc.deadline < math.inf


def _check_deadline(run: CacheRun, i: int, ask: Ask) -> None:
    """A caller with a timeout is never answered DeadlineExceeded before its own
    deadline (arrival + timeout: not another caller's, whose flight it joined), and
    is answered by its deadline, unless a batch holding its request (or the request
    of the flight it waits on, whose deadline is not later) was running then: an
    inline batch is not interrupted, and it is answered when that batch ends. A
    model that runs off the event loop (``running``) answers it by its deadline
    wherever its request is: queued, running, or waiting for the late answer of the
    batch of its flight's driver."""
    out = run.outcomes.get(i)
    due = deadline_of(run, i)
    if out is None or due == math.inf:
        return
    who = describe(i, ask)
    if isinstance(out.value, DeadlineExceeded) and out.at < due:
        raise InvariantViolation(
            "deadline",
            f"{who} got DeadlineExceeded at {run.at(out.at)}, before its own deadline "
            f"{run.at(due)} (its timeout of {deadline_ticks(run.scenario, ask)} ticks): "
            "another caller's deadline",
        )
    if out.at <= due:
        return
    got = "cancelled" if out.kind == "cancelled" else (
        "a result" if out.kind == "result" else type(out.value).__name__
    )
    if run.scenario.models[ask.model].running:
        raise InvariantViolation(
            "deadline",
            f"{who} was answered ({got}) at {run.at(out.at)}, after its own deadline "
            f"{run.at(due)}, though m{ask.model} runs its batches off the event loop "
            "(its deadline is answered wherever its request is)",
        )
    cls = f"c{ask.cls}"
    for b in run.dispatched:
        end = math.inf if b.end is None else b.end
        if b.model != ask.model or b.at > due or end < out.at:
            continue
        if end != out.at and out.kind != "cancelled":
            continue
        if any(
            k in ask.keys and t == ask.tenant and c == cls and d <= due
            for k, t, c, d in b.items
        ):
            note("cache", "answered after the deadline, at the end of a batch running then")
            return
    raise InvariantViolation(
        "deadline",
        f"{who} was answered ({got}) at {run.at(out.at)}, after its own deadline "
        f"{run.at(due)}, and no batch holding its request, or its flight's with a "
        "deadline not later, was running at its deadline and ended then",
    )


def _check_answer(
    run: CacheRun, who: str, ask: Ask, j: int, k: int, y: np.ndarray, start: float,
    gen0: int, rule: ModelRule,
) -> None:
    if y.shape != (5,) or int(y[MODEL]) != ask.model or int(y[KEY]) != k:
        raise InvariantViolation(
            "misrouted",
            f"{who}: answer {j} is not its own (expected m{ask.model}'s answer for key {k}, "
            f"got {y.tolist()})",
        )
    number, gen, tenant = int(y[RUN]), int(y[GEN]), int(y[TENANT])
    r = run.runs[number] if 0 <= number < len(run.runs) else None
    if (
        r is None
        or r.status != "ok"
        or r.model != ask.model
        or r.gen != gen
        or not any(rk == k and rt == tenant for rk, rt, _ in r.items)
    ):
        raise InvariantViolation(
            "misrouted",
            f"{who}: answer {j} ({y.tolist()}) is not what run {number} of the model answered",
        )
    if tenant != ask.tenant and not (rule.cache and rule.shared):
        raise InvariantViolation(
            "isolation",
            f"{who}: answer {j} was computed for tenant t{tenant} (run {number} at "
            f"{run.at(r.at)}), but m{ask.model} is not shareable",
        )
    if gen < gen0:
        raise InvariantViolation(
            "freshness",
            f"{who}: answer {j} was computed by run {number} at {run.at(r.at)} with "
            f"generation {gen} of the weights, but the call started at {run.at(start)}, "
            f"after m{ask.model}'s invalidation to generation {gen0}",
        )
