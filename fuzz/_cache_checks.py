"""The cache suite's checks of a played scenario (:func:`check_cache`): each caller's
outcome and every answer's origin, isolation, freshness and errors."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np
from trioserve import ModelError, Overloaded

from ._cache_scenario import HORIZON_S, TICK, Ask, ModelRule
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
    for out in run.outcomes.values():
        kind = type(out.value).__name__ if out.kind == "error" else out.kind
        note("cache", f"outcome: {kind}")
    if run.violations:
        raise InvariantViolation(*run.violations[0])
    for i, ask in enumerate(sc.asks):
        _check_ask(run, i, ask)


def _describe(i: int, ask: Ask) -> str:
    how = "infer_batch" if ask.batch or len(ask.keys) > 1 else "infer"
    return (
        f"ask #{i} (tick {ask.at}, tenant t{ask.tenant}, class c{ask.cls}, {how} of m"
        f"{ask.model} keys {list(ask.keys)})"
    )


_RUN_OF_ERROR = re.compile(r"planted model error on key (\d+) \(run (\d+)\)")


def _check_ask(run: CacheRun, i: int, ask: Ask) -> None:
    sc = run.scenario
    who = _describe(i, ask)
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
    if isinstance(exc, Overloaded) and _sheddable(ask, rule):
        return
    m = _RUN_OF_ERROR.search(str(exc)) if isinstance(exc, ModelError) else None
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


def _sheddable(ask: Ask, rule: ModelRule) -> bool:
    """Whether the runtime may shed the call (Overloaded: it could not be served
    before its deadline). Only a caller whose deadline it sees, and not through a
    flight: a flight runs in the cache actor's nursery, without its callers' deadlines
    (the queue holds far more than a scenario asks)."""
    flight = (rule.cache or rule.coalesce) and len(ask.keys) == 1  # infer_batch of one too
    return ask.cancel is not None and ask.cancel_how == "deadline" and not flight


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
