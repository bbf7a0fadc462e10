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
        rec, why = keeper.recorded()
        if why is not None:
            log.info("model %r: rollout: the decision recorded in %s is not used: %s; "
                     "it starts afresh", family.model, store.path, why)
        elif rec is not None:
            rollout.restore(RolloutState(rec["state"]), step=rec["step"],
                            reason=rec.get("reason"), now=trio.current_time())
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
    )
    if r.canary is None:
        canary = ""
    elif rollout.restored is None:
        canary = f", canary {r.canary!r} at {r.steps[0]:g}"
    else:
        canary = f", canary {r.canary!r} {rollout.state.value.replace('_', ' ')}" + (
            f" at {rollout.share:g}" if rollout.state is RolloutState.PAUSED else ""
        ) + f" as recorded in {store.path}"
    log.info(
        "model %r: rollout: stable %r%s%s", family.model, r.stable, canary,
        f", shadow {shadow!r}" if shadow is not None else "",
    )
    if r.canary is not None and r.max_error_rate >= 1.0:
        # Accepted (a user may mean "never on errors"), but it switches off more
        # than it says: no error share exceeds 1, nor one late share another by 1.
        log.warning(
            "model %r: rollout.max_error_rate = 1: neither errors nor late requests "
            "will ever roll the canary %r back; only its latency can",
            family.model, r.canary,
        )
    await nursery.start(supervise, family.controller, policy)
