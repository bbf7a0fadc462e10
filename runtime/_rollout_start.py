"""The assembly of a model's rollout: its controller (``RolloutController``,
actors/_rollout_actor.py) started in the root nursery, wired to the model's
versions (``Family``, runtime/_versioned.py) and, with a state file
(runtime/_rollout_state.py), to the decision recorded for it."""

from __future__ import annotations

import logging
from typing import Any

import trio

from ._actor import supervise
from ._config import ModelConfig
from ._rollout_state import Keeper
from ._versioned import Family

log = logging.getLogger("trioserve")


async def start_rollout(
    nursery: trio.Nursery, rt: Any, family: Family, m: ModelConfig, policy: Any
) -> None:
    """The controller of ``family``'s rollout (``m``: the model's config), supervised
    in ``nursery`` (the root nursery, or the copy's under explicit model control).
    Each start is afresh (canary at its first step, counts empty), or, with a state
    file, from the decision it records for this configuration."""
    from trioserve.actors import Rollout, RolloutController, RolloutRules, RolloutState

    r = m.rollout
    assert r is not None

    rules = RolloutRules(
        steps=r.steps, step_s=r.step_s, min_requests=r.min_requests,
        max_error_rate=r.max_error_rate, max_latency_ratio=r.max_latency_ratio,
    )
    shadow = r.shadow

    served = family.by_version[shadow] if shadow is not None else None

    async def run_shadow(inputs: Any, tenant: str) -> Any:
        # this family's shadow, whichever copy of the model serves now
        return await rt._run_shadow(family.model, served, inputs, tenant)

    rollout = Rollout(rules, stable=r.stable, canary=r.canary, now=trio.current_time())
    store = rt._rollout_state
    keeper = Keeper(store, m) if store is not None else None
    if keeper is not None:
        serving = rt._families.get(family.model)
        if serving is not None and serving is not family and serving.controller is not None:
            # a reload: the trial of the copy it replaces goes on from where it is
            serving.controller.keep_progress()
        rec, why = keeper.recorded()
        if why is not None:
            log.info("model %r: rollout: the decision recorded in %s is not used: %s; "
                     "it starts afresh", family.model, store.path, why)
        elif rec is not None:
            started = rec.get("started")
            if started is not None:
                # a trial the operator started: its own versions and rules
                rollout = Rollout(
                    RolloutRules(steps=tuple(rec["steps"]), **started["rules"]),
                    stable=rec["stable"], canary=rec["canary"], now=trio.current_time(),
                )
                rollout.origin, rollout.stable_from = "operator", started["stable_from"]
            rollout.restore(RolloutState(rec["state"]), step=rec["step"],
                            reason=rec.get("reason"), now=trio.current_time(),
                            elapsed=rec.get("elapsed_s", 0.0))
    family.controller = RolloutController(
        model=family.model,
        rollout=rollout,
        shadow=shadow,
        shadow_share=r.shadow_share,
        shadow_rtol=r.shadow_rtol,
        shadow_atol=r.shadow_atol,
        shadow_queue=r.shadow_queue,
        # enough copies in flight to fill the shadow's batches
        shadow_workers=served.config.max_batch_size if served is not None else 0,
        run_shadow=run_shadow,
        closing=lambda: rt._closed,
        keeper=keeper,
        config=r,
        versions=tuple(m.versions),
    )
    if rollout.canary is None:
        canary = ""
    elif rollout.restored is None:
        canary = f", canary {rollout.canary!r} at {rollout.rules.steps[0]:g}"
    else:
        canary = f", canary {rollout.canary!r} " + _as_restored(rollout) + (
            " (a trial started by the operator)" if rollout.origin == "operator" else ""
        ) + f" as recorded in {store.path}"
    log.info(
        "model %r: rollout: stable %r%s%s", family.model, rollout.stable, canary,
        f", shadow {shadow!r}" if shadow is not None else "",
    )
    if rollout.canary is not None and rollout.rules.max_error_rate >= 1.0:
        # Accepted (a user may mean "never on errors"), but it switches off more
        # than it says: no error share exceeds 1, nor one late share another by 1.
        log.warning(
            "model %r: rollout.max_error_rate = 1: neither errors nor late requests "
            "will ever roll the canary %r back; only its latency can",
            family.model, rollout.canary,
        )
    await nursery.start(supervise, family.controller, policy)


def _as_restored(rollout: Any) -> str:
    """How a rollout restored from its record starts, for the log."""
    from trioserve.actors import RolloutState

    state = rollout.state
    if state in (RolloutState.PROMOTED, RolloutState.ROLLED_BACK):
        return state.value.replace("_", " ")
    where = (f"at step {rollout.step + 1} of {len(rollout.rules.steps)} ({rollout.share:g}), "
             f"{rollout.step_elapsed(trio.current_time()):g} s of it served")
    return f"paused {where}" if state is RolloutState.PAUSED else f"on trial {where}"
