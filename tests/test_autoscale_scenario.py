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
    MAX_BATCH,
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
    assert (low["from_s"], high["from_s"], last["from_s"], last["to_s"]) == (0, 5, 13, 20)
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
    # down: after the downscale delay (its wait may start at the high phase's tail)
    assert DOWNSCALE_S - 1.0 <= res["down_floor_s"] <= DOWNSCALE_S + 3 * INTERVAL_S
    assert res["decisions"] == {"up": 1, "down": 1}
    by_second = res["replicas_by_second"]
    assert (by_second[:6], by_second[7:13], by_second[-3:]) == ([1] * 6, [4] * 6, [1] * 3)
    assert res["replicas_timeline"][0].endswith(":1")
    assert res["high_p99_after_scaling_ms"] <= res["high_p99_bound_ms"]
    assert res["need_high"] == NEED_HIGH == 3
    assert all(len(s) == 5 for s in res["samples"])
    # the samples go to the JSON only: the printed report names every other figure
    text = format_result({"scenario": "autoscale", **res})
    assert "samples" not in text
    assert "[PASS] scaled up to >= 3 replicas in the high phase" in text
    assert "autoscale" in SCENARIOS


async def test_the_checks_catch_a_count_that_swings(autojump_clock, trio_time_device):
    """At the default target (two full batches a replica) four replicas at the high
    rate hold 20-70 items, which asks for one to three: the count drops below what
    the high phase needs, a backlog builds, and it goes up again. The latency check
    fails."""
    res = await autoscale(20.0, target=None)
    assert res["autoscaling"]["target_per_replica"] == 2 * MAX_BATCH
    high = res["phases"]["high"]
    assert high["replicas_max"] == 4
    assert res["decisions"]["up"] >= 2
    assert res["decisions"]["down"] >= 2
    high_from, high_to = high["from_s"], high["to_s"]
    seen = [n for t, n, *_ in res["samples"] if high_from <= t < high_to]
    top = seen.index(4)
    assert min(seen[top:]) < NEED_HIGH
    assert 4 in seen[top + seen[top:].index(min(seen[top:])):]
    assert not res["checks"]["high-phase p99 once scaled <= 3 x low p99 + a full batch"]
    assert res["checks"]["every request answered with a result (none lost, none failed)"]
