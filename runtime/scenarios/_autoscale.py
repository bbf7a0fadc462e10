"""``trioserve bench --scenario autoscale``: the autoscaler following a stepped load.

One autoscaled model (min 1, max 4 replicas) on the ``sleep`` device in worker
threads: ``DEVICE_BATCH_MS`` per batch plus ``DEVICE_ITEM_MS`` per item, batches of
at most ``MAX_BATCH``, so one replica serves at most ``CAPACITY`` items/s whatever
the cores (the device time is a sleep, not CPU). Open-loop Poisson arrivals, one
request each, at a rate stepped in three phases:

- *low*: 30% of one replica's capacity (one replica is enough);
- *high*: 2.7 replicas' worth (three are needed);
- *low* again: back to 30% of one.

The phases take 25%, 35% and 40% of ``--duration`` (20 s by default: 5, 7, 8 s), and
the autoscaler's delays scale with it (at 20 s: ``upscale_delay_s`` 1,
``downscale_delay_s`` 3, ``interval_s`` 0.25; ``look_back_s`` the default, the
upscale delay: each look sees the mean load of the last four). At the end the arrivals stop and
every request sent is awaited, so a request lost would show as unanswered.

``rt.statistics()`` is sampled at the autoscaler's interval: the replicas serving,
what the autoscaler wants (``desired``) and the queue depth, with the load it sees
(``SchedulerActor.load``). A sample costs the loop ~0.4 ms here (the latency
summaries). The
report gives per phase the requests, errors, items/s, p50/p99 latency and the
replicas seen; the replica count over time; the time from the step up until the
replicas serving reached what the load asks for (``NEED_HIGH``), until the backlog
built meanwhile was drained, and from the step down until back at one replica.

The load per replica it aims at is the default (``target_queued_per_replica``: one
full batch, 16 items). Seen from the queue, a replica below saturation holds about
one batch in service and a few items waiting: at the high phase's rate four replicas
hold 25-70 items, looks that ask for two to five replicas. The step down goes to the
most the looks of its wait asked for, so the count holds at four through the high
phase; after the step down it goes 4 -> 3 (the wait's first looks still saw the
high phase's last batches) -> 1 (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import numpy as np
import trio

from .._config import AutoscalingConfig, Config, ModelConfig, TenantConfig
from .._front import Runtime
from .._runtime import open_runtime
from ._sched import Record, _one, _run_for, p, run_async

MODEL = "device"
DEVICE_BATCH_MS = 10.0
DEVICE_ITEM_MS = 1.0
MAX_BATCH = 16
#: items/s one replica serves at full batches: 16 / 26 ms = 615
CAPACITY = MAX_BATCH / ((DEVICE_BATCH_MS + DEVICE_ITEM_MS * MAX_BATCH) / 1e3)


def batch_seconds(items: int) -> float:
    """How long the device takes for a batch of ``items``."""
    return (DEVICE_BATCH_MS + DEVICE_ITEM_MS * items) / 1e3


#: the longest a batch takes on the device (a full one)
FULL_BATCH_S = batch_seconds(MAX_BATCH)
LOW = 0.3  # of one replica's capacity
HIGH = 2.7
NEED_HIGH = math.ceil(HIGH)
MIN_REPLICAS, MAX_REPLICAS = 1, 4
TARGET: float | None = None  # the default: one full batch
#: (name, share of the duration, rate in replicas' worth)
PHASES = (("low", 0.25, LOW), ("high", 0.35, HIGH), ("low again", 0.40, LOW))
DEFAULT_DURATION = 20.0
#: the autoscaler's delays and interval at the default duration (they scale with it)
UPSCALE_S, DOWNSCALE_S, INTERVAL_S = 1.0, 3.0, 0.25
#: how long the requests still unanswered when the arrivals stop may take
DRAIN_S = 30.0


def config(
    scale: float = 1.0, *, execution: str = "thread", target: float | None = TARGET
) -> Config:
    """The scenario's runtime: the one autoscaled ``sleep`` model, its delays times
    ``scale``."""
    model = ModelConfig(
        name=MODEL, backend="sleep", execution=execution, replicas=MIN_REPLICAS,
        options={"delay_per_batch_ms": DEVICE_BATCH_MS, "delay_per_item_ms": DEVICE_ITEM_MS},
        max_batch_size=MAX_BATCH, max_wait_ms=2.0,
        autoscaling=AutoscalingConfig(
            min_replicas=MIN_REPLICAS, max_replicas=MAX_REPLICAS,
            target_queued_per_replica=target, upscale_delay_s=UPSCALE_S * scale,
            downscale_delay_s=DOWNSCALE_S * scale, interval_s=INTERVAL_S * scale,
        ),
    )
    return Config(models=(model,), tenants=(TenantConfig(name="t", default=True),))


async def _arrivals(
    rt: Runtime, nursery: trio.Nursery, bounds: list[tuple[float, float, float]],
    rec: Record, *, seed: int,
) -> None:
    """Poisson arrivals at each phase's rate ((start, end, items/s) in ``bounds``)
    until the last phase ends; each request in its own task in ``nursery``."""
    rng = np.random.default_rng(seed)
    item = {"x": np.zeros(4, np.float32)}
    at = bounds[0][0]
    for start, end, rate in bounds:
        at = max(at, start)
        while True:
            at += rng.exponential(1.0 / rate)
            if at >= end:
                break
            await trio.sleep_until(at)
            nursery.start_soon(_one, rt, MODEL, item, "t", None, rec)


def _first(samples: list[list[float]], since: float, cond: Any) -> float | None:
    """The first sample time at or after ``since`` when ``cond(sample)`` held."""
    return next((s[0] for s in samples if s[0] >= since and cond(s)), None)


async def autoscale(
    duration: float, *, execution: str = "thread", target: float | None = TARGET
) -> dict[str, Any]:
    """Run the scenario for ``duration`` seconds of load and return its report
    (``target``: the load per replica aimed at; None, the default one full batch)."""
    scale = duration / DEFAULT_DURATION
    cfg = config(scale, execution=execution, target=target)
    auto = cfg.models[0].autoscaling
    assert auto is not None
    every = auto.interval_s
    rec = Record()
    # [t, replicas serving, desired, queue depth, load in cost units]
    samples: list[list[float]] = []
    async with open_runtime(cfg) as rt:
        served = rt.models[MODEL]

        async def sample(t0: float) -> None:
            while True:
                s = rt.statistics()[MODEL]
                a = s["autoscaler"]
                samples.append([
                    trio.current_time() - t0, a["replicas"],
                    a["desired"] if a["desired"] is not None else a["replicas"],
                    s["queue_depth"], served.scheduler.load(),
                ])
                await trio.sleep(every)

        t0 = trio.current_time()
        bounds, at = [], t0
        for _, share, rate in PHASES:
            bounds.append((at, at + share * duration, rate * CAPACITY))
            at += share * duration
        async with trio.open_nursery() as outer:
            outer.start_soon(sample, t0)
            outer.start_soon(_run_for, duration, "autoscale: low, high, low")
            async with trio.open_nursery() as requests:
                await _arrivals(rt, requests, bounds, rec, seed=11)
                # every request sent is awaited: one lost would hold this past DRAIN_S
                requests.cancel_scope.deadline = trio.current_time() + DRAIN_S
            drained = not requests.cancel_scope.cancelled_caught
            t_end = trio.current_time() - t0
            outer.cancel_scope.cancel("the load is over")
        stats = rt.statistics()[MODEL]
    return report(
        rec, samples, t0, bounds, duration=duration, t_end=t_end, drained=drained,
        upscale_s=auto.upscale_delay_s, downscale_s=auto.downscale_delay_s,
        interval_s=auto.interval_s, look_back_s=served.scaler.scaler.look_back,
        decisions=stats["autoscaler"]["decisions"],
        target=stats["autoscaler"]["target_queued_per_replica"],
    )


def report(
    rec: Record, samples: list[list[float]], t0: float,
    bounds: list[tuple[float, float, float]], *, duration: float, t_end: float,
    drained: bool, upscale_s: float, downscale_s: float, interval_s: float,
    look_back_s: float, decisions: dict[str, int], target: float,
) -> dict[str, Any]:
    """The figures and checks of one run (times relative to the load's start)."""
    phases: dict[str, Any] = {}
    for (name, _, share), (start, end, rate) in zip(PHASES, bounds, strict=True):
        a, b = start - t0, end - t0
        lat = np.array([(e - s) * 1e3 for s, e in rec.ok if start <= s < end])
        seen = [s[1] for s in samples if a <= s[0] < b]
        phases[name] = {
            "from_s": a, "to_s": b, "offered_per_s": rate, "replicas_worth": share,
            "sent": len(lat) + sum(rec.errors(start, end).values()),
            "errors": rec.errors(start, end),
            "items_per_s": len(rec.in_window(start, end)) / (b - a),
            "p50_ms": p(lat, 50), "p99_ms": p(lat, 99), "max_ms": p(lat, 100),
            "replicas_min": min(seen, default=0), "replicas_max": max(seen, default=0),
        }
    low, high, last = (phases[name] for name, _, _ in PHASES)
    up_at, down_at = high["from_s"], last["from_s"]
    reached = _first(samples, up_at, lambda s: s[1] >= NEED_HIGH)
    # the backlog built before the new replicas served: drained once at most one
    # full batch per replica waits
    settled = None if reached is None else _first(
        samples, reached, lambda s: s[3] <= s[1] * MAX_BATCH
    )
    floor = _first(samples, down_at, lambda s: s[1] == MIN_REPLICAS)
    after = np.array([
        (e - s) * 1e3 for s, e in rec.ok
        if settled is not None and t0 + settled <= s < t0 + high["to_s"]
    ])
    p99_after = p(after, 99)
    # Once the replicas match the load, a request waits for at most the batch in
    # service and its own; the low phase's p99 holds what this machine adds (the
    # loop, thread wake-ups, the sampling), x3 for the larger batches at ~70% busy.
    bound = 3 * low["p99_ms"] + FULL_BATCH_S * 1e3
    errors: dict[str, int] = {}
    for k, v in rec.errors().items():
        errors[k] = errors.get(k, 0) + v
    answered = len(rec.ok) + sum(errors.values())
    changes = [samples[0][:2]] if samples else []
    for s in samples[1:]:
        if s[1] != changes[-1][1]:
            changes.append(s[:2])
    return {
        "duration_s": duration,
        "device": f"{DEVICE_BATCH_MS:g} ms a batch + {DEVICE_ITEM_MS:g} ms an item, "
                  f"batches of {MAX_BATCH}: {CAPACITY:,.0f} items/s a replica",
        "autoscaling": {
            "min": MIN_REPLICAS, "max": MAX_REPLICAS, "target_per_replica": target,
            "upscale_delay_s": upscale_s, "downscale_delay_s": downscale_s,
            "interval_s": interval_s, "look_back_s": look_back_s,
        },
        "phases": phases,
        "replicas_timeline": [f"{t:.2f}s:{int(n)}" for t, n in changes],
        "replicas_by_second": [
            int(next((s[1] for s in reversed(samples) if s[0] <= i), samples[0][1]))
            for i in range(math.ceil(t_end))
        ] if samples else [],
        "decisions": decisions,
        "sent": rec.sent, "answered": answered, "ok": len(rec.ok), "errors": errors,
        "need_high": NEED_HIGH,
        "up_reached_s": None if reached is None else reached - up_at,
        "up_drained_s": None if settled is None else settled - up_at,
        "down_floor_s": None if floor is None else floor - down_at,
        "high_p99_after_scaling_ms": p99_after,
        "high_p99_bound_ms": bound,
        "samples": samples,
        "checks": {
            "every request answered with a result (none lost, none failed)":
                drained and rec.sent == len(rec.ok) and not errors,
            f"scaled up to >= {NEED_HIGH} replicas in the high phase":
                high["replicas_max"] >= NEED_HIGH,
            f"back to {MIN_REPLICAS} replica in the last phase (its downscale delay passed)":
                floor is not None and samples[-1][1] == MIN_REPLICAS,
            "high-phase p99 once scaled <= 3 x low p99 + a full batch":
                len(after) > 0 and p99_after <= bound,
        },
    }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    return await autoscale(args.duration or DEFAULT_DURATION)


def run(name: str, args: argparse.Namespace) -> int:
    return run_async(_main, name, args)
