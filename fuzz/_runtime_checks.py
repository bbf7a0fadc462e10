"""The runtime suite's checks of a played scenario (:func:`check`): what the callers
got, what each request's batches did, the lanes, push-outs and credits, after the
queues' observers and the reference of the replicas have had their say."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from trioserve import (
    ActorBroken,
    ActorClosed,
    DeadlineExceeded,
    Forbidden,
    InvalidInput,
    ModelError,
    Overloaded,
    RequestState,
)

from ._checker import InvariantViolation
from ._device import Execution, item_input, item_key, part_id
from ._product import submission
from ._scenario import HORIZON_S, MS, Call, Scenario
from ._stats import note

if TYPE_CHECKING:
    from ._runtime import Run

#: how a batch ended that its requests may run again after: the model raised (the
#: batch is split and retried), or its worker was cut off or died running it, or
#: was lost with it staged behind (handed back)
RETRIED = frozenset({"error", "killed", "died", "returned"})
#: a request that failed alone this many times on a worker (cut off, or its worker
#: died) is answered as poison (the model's ``poison_attempts``, by default)
POISON_ATTEMPTS = 2


def check(run: Run) -> None:
    sc = run.scenario
    if not run.lanes:
        raise RuntimeError(
            "fuzz: open_runtime did not build its queue from trioserve.actors.FairQueue; "
            "update fuzz/_runtime.py:product_installed"
        )
    observers = run.observers
    for obs in observers:
        for feature, n in obs.exercised.items():
            note("runtime", feature, n)
    for out in run.outcomes.values():
        kind = type(out.value).__name__ if out.kind == "error" else out.kind
        note("runtime", f"outcome: {kind}")
    # Each request's batches: a hedge copy is a request of its own.
    history: dict[tuple[int, int, bool], list[Execution]] = {}
    for ex in run.executions:
        for k in ex.keys:
            history.setdefault(k, []).append(ex)
        note("runtime", f"replica batches: {ex.status}")
    note("runtime", "parts retried", sum(len(h) > 1 for h in history.values()))
    if sc.running:
        note("runtime", "running: scenarios")
        for ex in run.executions:
            if ex.status == "ok":
                note("runtime", "running: late answers skipped", ex.answerable.count(False))
            elif ex.status == "killed" and not all(ex.answerable):
                note("runtime", "running: batches handed back with requests answered")
    note("runtime", "oversize: items run in parts", len({p[0] for p in history if p[1]}))
    if sc.shutdown_at_ms is not None:
        note("runtime", "early shutdowns")
    run.replicas.finish()
    for obs in observers:
        obs.raise_first()
    if run.violations:
        raise InvariantViolation(*run.violations[0])
    if run.replicas.violations:
        raise InvariantViolation(*run.replicas.violations[0])
    _check_lanes(run)
    for p, runs in history.items():
        for ex in runs[:-1]:
            if ex.status not in RETRIED:
                raise InvariantViolation(
                    "duplicated",
                    f"item {p[0]} (part at {p[1]}{', hedge copy' if p[2] else ''}) ran "
                    f"again at t={runs[-1].at:.6g} after its batch at t={ex.at:.6g} ended "
                    f"{ex.status!r}: only a batch whose model raised, or that its "
                    "worker's loss handed back, is retried",
                )
    for i, call in enumerate(sc.calls):
        _check_call(run, i, call, history)
    if sc.running:
        _check_refunds(run)
    _check_credits(run)


def _check_refunds(run: Run) -> None:
    """On workers: a request whose caller left after its dispatch is refunded (as
    never run, ``_refund_if_unrun``) exactly once if no batch holding it reached
    the device (handed back unsent, or staged behind a lost worker's batch, and
    never run after), never if one did (it ran to its end, its results read in time
    or from its dead worker's pipe, or its worker was cut off, died or was replaced
    while it ran)."""
    reached: dict[int, tuple[Any, list[Execution]]] = {}
    for ex in run.executions:
        for req in ex.reqs:
            reached.setdefault(id(req.reply), (req, []))[1].append(ex)
    for req, runs in reached.values():
        reply = req.reply
        ran = any(ex.reached for ex in runs)
        refunds = run.refunds.get(id(reply), (None, 0))[1]
        if ran:
            ok = not refunds
        else:
            ok = refunds == (1 if reply.state is RequestState.ABANDONED else 0)
        if not ok:
            p = part_id(req.item["x"])
            ended = [(f"{ex.at:.6g}", ex.status, ex.reached) for ex in runs]
            raise InvariantViolation(
                "outcome",
                f"item {p[0]} (part at {p[1]}) was refunded {refunds} time(s) as never run "
                f"(its reply {reply.state.value}); its batches (started, how they "
                f"ended, reached the device): {ended}: a request that ran is never "
                "refunded, one whose caller left that never ran is, once",
            )


def _check_lanes(run: Run) -> None:
    """Each lane's queue took only requests of its costs; a call refused, in either
    lane, pushed nobody out of either (its lanes decide before either queues)."""
    def call_of(req: Any) -> int:
        return run.items[part_id(req.item["x"])[0]][0]

    refused = {k: (lane, req) for lane, q in run.lanes.items() for k, (_, req) in q.refused.items()}
    queued_in: dict[int, set[str]] = {}
    for lane, q in run.lanes.items():
        for t in q.observer.tracked.values():
            req = t.request
            if run.lane_of_cost(req.cost) != lane:
                raise InvariantViolation(
                    "lane",
                    f"the {lane} lane's queue took {q.observer.describe(t)} of call "
                    f"#{call_of(req)}: slow_lane_cost is {run.scenario.slow_lane_cost}",
                )
            queued_in.setdefault(id(submission(req)), set()).add(lane)
        for t, by, at in q.pushed:
            note("runtime", "push-outs")
            k = id(submission(by))
            if k in refused:
                where, req = refused[k]
                raise InvariantViolation(
                    "push-out",
                    f"{q.observer.describe(t)} was pushed out of the {lane} lane's queue at "
                    f"t={at:.6g} (answered Overloaded) for an item (cost {by.cost}) of "
                    f"{_describe(call_of(by), run.scenario.calls[call_of(by)])}, which the "
                    f"{where} lane then refused (at its item of cost {req.cost}): it was "
                    "shed for nothing",
                )
    if run.scenario.slow_lane_cost is not None:
        note("runtime", "lanes: calls queued in both", sum(len(v) > 1 for v in queued_in.values()))
        costs = (
            {run.lane_of_cost(it.cost) for it in run.scenario.calls[call_of(req)].items}
            for _, req in refused.values()
        )
        note("runtime", "lanes: refused calls with items in both", sum(len(c) > 1 for c in costs))


def _describe(i: int, call: Call) -> str:
    return (
        f"call #{i} (at {call.at_ms} ms, tenant t{call.tenant}, class "
        f"{'default' if call.cls is None else f'c{call.cls}'}, {len(call.items)} item(s))"
    )


def _check_call(
    run: Run, i: int, call: Call, history: dict[tuple[int, int, bool], list[Execution]]
) -> None:
    sc = run.scenario
    who = _describe(i, call)
    out = run.outcomes.get(i)
    keys = [item_key(i, j) for j in range(len(call.items))]
    mine = {p: h for p, h in history.items() if p[0] in keys}
    if out is None:
        raise InvariantViolation(
            "lost",
            f"{who} never got an answer ({HORIZON_S:g} s of trio time after the last "
            f"arrival); its parts started on a replica: {sorted(mine)}",
        )
    arrival = run.t0 + call.at_ms * MS
    cancel_at = None if call.cancel_ms is None else arrival + call.cancel_ms * MS
    if cancel_at is not None and out.at > cancel_at + 1e-9:
        raise InvariantViolation(
            "outcome", f"{who} returned at t={out.at:.6g}, after its cancel time {cancel_at:.6g}"
        )
    timeout = _timeout_ms(sc, call)
    if sc.running and timeout is not None and out.at > arrival + timeout * MS + 1e-9:
        # Off the event loop, a timeout ends the wait wherever the request is: queued,
        # held for a retry, staged on a worker or running there.
        ran = sorted((p, [(f"{ex.at:.6g}", ex.status) for ex in h]) for p, h in mine.items())
        raise InvariantViolation(
            "deadline",
            f"{who} returned at t={out.at:.6g} ({out.kind}), after its deadline "
            f"{arrival + timeout * MS:.6g} (timeout {timeout:g} ms); its batches "
            f"(started, how they ended): {ran}",
        )
    if out.kind == "cancelled":
        if cancel_at is None or abs(out.at - cancel_at) > 1e-9:
            raise InvariantViolation(
                "outcome", f"{who} was cancelled at t={out.at:.6g} but nobody cancelled it then"
            )
        return
    if out.kind == "result":
        values = [out.value] if len(call.items) == 1 else list(out.value)
        if len(values) != len(call.items):
            raise InvariantViolation(
                "misrouted", f"{who} got {len(values)} results for {len(call.items)} items"
            )
        for j, (value, it) in enumerate(zip(values, call.items, strict=True)):
            want = item_input(keys[j], it.cost)
            got = np.asarray(value["y"])
            if got.shape != want.shape or not np.array_equal(got, want):
                whose = part_id(got) if got.size else None
                raise InvariantViolation(
                    "misrouted",
                    f"{who}: result {j} is not its own (expected the output of item "
                    f"{keys[j]}, got that of {whose[0] if whose else 'nothing'}"
                    f"{f' part at {whose[1]}' if whose and whose[1] else ''})",
                )
        for key in keys:
            # the item's parts, or its hedge copy, all answered by their last batch
            tries = [
                [runs for p, runs in mine.items() if p[0] == key and p[2] is copy]
                for copy in (False, True)
            ]
            if not any(t and all(r[-1].status == "ok" for r in t) for t in tries):
                ended = {
                    f"{'copy' if p[2] else 'part'} at {p[1]}": runs[-1].status
                    for p, runs in mine.items() if p[0] == key
                }
                raise InvariantViolation(
                    "outcome",
                    f"{who} got a result though no run of item {key} (nor of its hedge "
                    f"copy) ended with one: last batches {ended}",
                )
        return
    exc = out.value
    name = type(exc).__name__
    ok = False
    if isinstance(exc, ModelError):
        ok, why = _model_error_allowed(run, mine)
        if not ok:
            raise InvariantViolation("outcome", f"{who} raised {name}: {exc} — {why}")
    elif isinstance(exc, ActorBroken):
        ok = any(runs[-1].status == "crash" for runs in mine.values())
    elif isinstance(exc, DeadlineExceeded):
        if "while its batch was running" in str(exc):
            note("runtime", "running: DeadlineExceeded while the batch ran")
        ok = timeout is not None and out.at >= arrival + timeout * MS - 1e-9
    elif isinstance(exc, ActorClosed):
        ok = out.at >= run.shutdown_at
    elif isinstance(exc, Overloaded):  # QuotaExceeded too
        # Refused, or pushed out of the queue: never ran, unless the call was several
        # requests (items, or the parts of a split item) of which others ran.
        split = (
            sc.oversize == "split"
            and sc.max_batch_tokens is not None
            and any(it.cost > sc.max_batch_tokens for it in call.items)
        )
        ok = len(call.items) > 1 or split or not mine
    elif isinstance(exc, InvalidInput):
        ok = (
            sc.max_batch_tokens is not None
            and sc.oversize == "reject"
            and any(it.cost > sc.max_batch_tokens for it in call.items)
        ) or (
            # more items than the queue ever holds (for this tenant): refused before
            # any of them ran
            len(call.items) > _most_queued(sc, call.tenant) and not mine
        )
    elif isinstance(exc, Forbidden):
        allowed = sc.tenants[call.tenant].classes
        ok = call.cls is not None and bool(allowed) and call.cls not in allowed
    if not ok:
        raise InvariantViolation(
            "outcome", f"{who} raised {name}: {exc} — not an outcome its situation allows"
        )


def _model_error_allowed(
    run: Run, mine: dict[tuple[int, int, bool], list[Execution]]
) -> tuple[bool, str]:
    """A ModelError reaches a caller only from a request that raised alone (a
    failed batch of several is split and retried), and only for an input that
    raises (poison) or on a replica broken then: a sound input in a fresh batch of
    its own there, a part with no other ready replica of its lane to run it, or one
    that raised alone on two replicas. A part of a failed batch that raised alone on
    a replica while another was ready runs once elsewhere instead."""
    why = "no request of it raised alone (a failed batch of several is retried in parts)"
    for p, runs in mine.items():
        last = runs[-1]
        # (alone: the only request of its batch still waiting when its worker went)
        failed_alone = sum(
            ex.status in ("killed", "died") and sum(ex.answerable) == 1
            and ex.answerable[ex.keys.index(p)]
            for ex in runs
        )
        if last.status in ("killed", "died") and failed_alone >= POISON_ATTEMPTS:
            note("runtime", f"ModelError: poison items (their worker {last.status})")
            return True, ""
        if last.status != "error" or len(last.parts) != 1:
            continue
        poison = run.fault(p[0]) == "error"
        if last.marked:
            why = (
                f"item {p[0]} (part at {p[1]}) raised alone as a retry on replica "
                f"{last.replica} at t={last.at:.6g} while another replica was ready: it "
                "runs once elsewhere, not answered that replica's error"
            )
            continue
        if poison or last.broken:
            how = "fresh, alone"
            if last.retried[0]:
                how = "a part, raised alone elsewhere too" if any(
                    ex.marked for ex in runs
                ) else "a part, no other replica ready"
            note(
                "runtime",
                "ModelError: poison items" if poison else
                f"ModelError: sound items on a broken replica ({how})",
            )
            return True, ""
        why = f"item {p[0]} does not raise and replica {last.replica} was not broken"
    return False, why


def _most_queued(sc: Scenario, tenant: int) -> int:
    share = sc.tenants[tenant].queue_share
    if share >= 1.0:
        return sc.queue_bound
    return max(1, int(share * sc.queue_bound))


def _timeout_ms(sc: Scenario, call: Call) -> float | None:
    tenant = sc.tenants[call.tenant]
    cls = call.cls
    if cls is None:
        cls = min(tenant.classes) if tenant.classes else 0
    options = [t for t in (sc.timeout_ms, sc.classes[cls].timeout_ms) if t is not None]
    return min(options) if options else None


def _check_credits(run: Run) -> None:
    """A tenant with credits is admitted at most its burst, plus its rate over the run,
    plus one payment's worth of debt (a call pays for all its items at once, and a
    payment may leave the bucket negative)."""
    sc = run.scenario
    max_cost = max((sum(it.cost for it in c.items) for c in sc.calls), default=0)
    for i, t in enumerate(sc.tenants):
        if t.credit_rate is None:
            continue
        burst = t.credit_burst if t.credit_burst is not None else t.credit_rate
        used = run.credits_used.get(f"t{i}", 0)
        envelope = burst + t.credit_rate * (run.end - run.t0) + max_cost
        if used > envelope + 1e-6:
            raise InvariantViolation(
                "credits",
                f"tenant t{i} (rate {t.credit_rate:g}/s, burst {burst:g}) was admitted "
                f"{used:g} cost units in {run.end - run.t0:.6g}s, over its envelope "
                f"{envelope:.6g} (burst + rate x elapsed + one payment's debt)",
            )
