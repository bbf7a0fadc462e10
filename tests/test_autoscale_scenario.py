"""``trioserve bench --scenario autoscale`` run whole under the autojumping clock: the
``sleep`` device's batches take trio time (a stand-in for its worker thread), so its
20 s of stepped load are exact and take a few seconds to run."""

from __future__ import annotations

import pytest
import trio
from trioserve.scenarios import SCENARIOS
from trioserve.scenarios._autoscale import (
    DOWNSCALE_S,
    INTERVAL_S,
    NEED_HIGH,
    UPSCALE_S,
    autoscale,
    batch_seconds,
)
from trioserve.scenarios._sched import format_result


@pytest.fixture
def trio_time_device(monkeypatch):
    """The sleep model answers at once, and a batch run in a replica's thread takes
    ``batch_seconds`` of trio time instead, holding the replica's limiter as the
    thread would. Other thread calls (loading the model) run inline."""
    import trioserve._builtin

    def load(self, device, *, torch_threads=1):
        return lambda items: [{"y": it["x"]} for it in items]

    async def run_sync(fn, *args, limiter=None, abandon_on_cancel=False):
        if getattr(fn, "__name__", "") != "_run_in_thread":
            return fn(*args)
        (items,) = args
        async with limiter:
            await trio.sleep(batch_seconds(len(items)))
            return fn(items)

    monkeypatch.setattr(trioserve._builtin.SleepBackend, "load", load)
    monkeypatch.setattr(trio.to_thread, "run_sync", run_sync)


async def test_the_replicas_follow_the_load_up_and_back_down(autojump_clock, trio_time_device):
    res = await autoscale(20.0)
    assert res["checks"] == dict.fromkeys(res["checks"], True)
    assert len(res["checks"]) == 4
    assert list(res["phases"]) == ["low", "high", "low again"]
    low, high, last = res["phases"].values()
    assert (low["from_s"], high["from_s"], last["from_s"], last["to_s"]) == (0, 5, 12, 20)
    assert (low["replicas_max"], high["replicas_max"], last["replicas_min"]) == (1, 4, 1)
    assert all(not ph["errors"] for ph in res["phases"].values())
    assert res["sent"] == res["ok"] == res["answered"] == sum(
        ph["sent"] for ph in res["phases"].values()
    )
    # up: the load asks for more from the look after the step; the count moves one
    # upscale delay later (a look is every interval), and the new replicas take work
    # at once
    assert UPSCALE_S <= res["up_reached_s"] <= UPSCALE_S + 3 * INTERVAL_S
    assert res["up_drained_s"] < high["to_s"] - high["from_s"]
    # down: in two steps, each after the downscale delay: the first wait's first
    # looks still see the high phase's last batches (they ask for 3), and a step
    # down goes to the most its wait asked for
    # (the first wait may begin at the high phase's tail, a run of looks between its
    # peaks; the second begins at the first step)
    assert DOWNSCALE_S <= res["down_floor_s"] <= 2 * DOWNSCALE_S + 3 * INTERVAL_S
    assert res["decisions"] == {"up": 1, "down": 2}
    by_second = res["replicas_by_second"]
    assert (by_second[:6], by_second[7:12], by_second[-2:]) == ([1] * 6, [4] * 5, [1] * 2)
    assert res["replicas_timeline"][0].endswith(":1")
    assert res["high_p99_after_scaling_ms"] <= res["high_p99_bound_ms"]
    assert res["need_high"] == NEED_HIGH == 3
    assert res["autoscaling"]["look_back_s"] == UPSCALE_S  # the default
    assert all(len(s) == 5 for s in res["samples"])
    # the samples go to the JSON only: the printed report names every other figure
    text = format_result({"scenario": "autoscale", **res})
    assert "samples" not in text
    assert "[PASS] scaled up to >= 3 replicas in the high phase" in text
    assert "autoscale" in SCENARIOS


async def test_the_checks_catch_an_autoscaler_that_does_not_keep_up(
    autojump_clock, trio_time_device, monkeypatch
):
    """An upscale delay longer than the high phase leaves it on one replica: the
    scale-up and latency checks fail; the queue sheds what it cannot hold (503), and
    still every request sent is answered."""
    import trioserve.scenarios._autoscale as scenario

    monkeypatch.setattr(scenario, "UPSCALE_S", 60.0)
    res = await autoscale(20.0)
    assert res["phases"]["high"]["replicas_max"] == 1
    assert not res["checks"]["scaled up to >= 3 replicas in the high phase"]
    assert not res["checks"]["high-phase p99 once scaled <= 3 x low p99 + a full batch"]
    assert not res["checks"]["every request answered with a result (none lost, none failed)"]
    assert res["answered"] == res["sent"]
    assert set(res["errors"]) == {"Overloaded"}
