"""``trioserve bench --scenario rollout`` run whole under the autojumping clock: its
checks hold, and they catch a canary that is never rolled back."""

from __future__ import annotations

from trioserve.scenarios import SCENARIOS
from trioserve.scenarios._rollout import rollout
from trioserve.scenarios._sched import format_result


async def test_the_rollout_scenario_passes(autojump_clock):
    res = await rollout(6.0)
    assert res["checks"], res
    assert all(res["checks"].values()), format_result({"scenario": "rollout", **res})
    assert res["good_canary"]["events"] == {
        "step": 1, "promoted": 1, "rolled_back": 0, "paused": 0, "resumed": 0, "started": 0,
    }
    assert res["bad_canary"]["reason"].startswith("error rate: ")
    assert res["shadow"]["shadow"]["dropped"] == 0
    assert "rollout" in SCENARIOS


async def test_the_checks_catch_a_canary_that_is_never_rolled_back(
    autojump_clock, monkeypatch
):
    import trioserve.scenarios._rollout as scenario

    monkeypatch.setattr(scenario, "BAD_SHARE", 0.0)  # the "bad" canary never fails
    res = await rollout(6.0)
    checks = res["checks"]
    assert not checks["bad canary rolled back within its step"]
    assert checks["every request answered (none lost)"]
