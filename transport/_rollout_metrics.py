"""The rollout's series of ``GET /metrics``: for each model with a rollout
(``[models.NAME.rollout]``) only, so that other models' output is what it was."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from trioserve.actors import ROLLOUT_EVENTS, SHADOW_RESULTS


def rollout_metrics(runtime: Any) -> Iterator[Metric]:
    """``trioserve_rollout_share{model,version}``, ``trioserve_rollout_events_total
    {model,event}``, ``trioserve_shadow_results_total{model,version,result}`` and,
    with a state file, ``trioserve_rollout_state_writes_total{result}``; nothing at
    all when no model has a rollout."""
    rolled = [
        (name, f.controller) for name, f in sorted(runtime._families.items())
        if f.controller is not None
    ]
    if not rolled:
        return
    share = GaugeMetricFamily(
        "trioserve_rollout_share",
        "The share of a model's unversioned requests each version of its rollout "
        "takes now (stable and canary).",
        labels=["model", "version"],
    )
    events = CounterMetricFamily(
        "trioserve_rollout_events",
        "The rollout's changes: a canary's step begun, promoted, rolled back (by a "
        "check or the operator), paused and resumed (by the operator).",
        labels=["model", "event"],
    )
    shadow = CounterMetricFamily(
        "trioserve_shadow_results",
        "The shadow's copies of stable's requests: outputs matching stable's, "
        "mismatching, failed, or dropped (its queue full).",
        labels=["model", "version", "result"],
    )
    shadows = False
    for name, c in rolled:
        r = c.rollout
        if r.canary is None:
            share.add_metric([name, r.stable], 1.0)
        else:
            share.add_metric([name, r.stable], 1.0 - r.share)
            share.add_metric([name, r.canary], r.share)
        for kind in ROLLOUT_EVENTS:
            events.add_metric([name, kind], c.events[kind])
        if c.shadow is not None:
            shadows = True
            for result in SHADOW_RESULTS:
                shadow.add_metric([name, c.shadow, result], c.shadow_results[result])
    yield from (share, events)
    if shadows:
        yield shadow
    store = runtime._rollout_state
    if store is not None:
        writes = CounterMetricFamily(
            "trioserve_rollout_state_writes",
            "Writes of the rollouts' state file (runtime.rollout_state_file): done, "
            "or failed (logged; the next decision writes it whole again).",
            labels=["result"],
        )
        writes.add_metric(["ok"], store.writes)
        writes.add_metric(["error"], store.write_errors)
        yield writes
