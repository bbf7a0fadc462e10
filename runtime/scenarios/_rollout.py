"""``trioserve bench --scenario rollout``: a good canary promoted, a bad one rolled
back, and a shadow compared with stable.

One model, ``affine``, with versions of their own weights (a small numpy backend
computing ``y = x * scale + shift`` per version, run inline: CPU only, no torch).
``CALLERS`` callers each send one unversioned request, wait ``THINK_S``, and again,
for a third of ``--duration`` (18 s by default) per run, three runs:

- *good*: canary ``2`` (other weights, as good as stable) through ``STEPS``; it must
  be promoted, with no caller-visible error.
- *bad*: canary ``2`` that starts failing on one input in ten (``BAD_SHARE``) a
  quarter into the run; it must be rolled back within its step. The report gives how
  long after it started failing, and how many callers saw an error.
- *shadow*: stable ``1`` and a shadow ``3`` that differs from stable on one input in
  five; every caller must get stable's answer, and the shadow's copies are counted
  (match, mismatch, error, dropped).

At the end of each run every request sent is awaited, so one lost would show as
unanswered.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import trio

from .._config import Config, ModelConfig, TenantConfig
from .._errors import TrioserveError
from .._model import CallableBackend, TensorSpec
from .._runtime import open_runtime
from ._sched import run_async

MODEL = "affine"
CALLERS = 16
THINK_S = 0.01
DEFAULT_DURATION = 18.0
STEPS = (0.1, 0.5)
BAD_SHARE = 0.1  # the bad canary's share of inputs it fails on
MISMATCH_SHARE = 0.2  # the shadow's share of inputs it answers otherwise
X = TensorSpec(name="x", datatype="FP32", shape=(8,))
Y = TensorSpec(name="y", datatype="FP32", shape=(8,))


class Affine:
    """``y = x * scale + shift``; from ``failing`` on (a trio.Event set), a batch
    holding an input whose key (x[0] * 1000, mod 100) is below ``fail_share * 100``
    raises; ``differ_share``: such inputs are answered + 1."""

    def __init__(self, scale: float, shift: float = 0.0, *, fail_share: float = 0.0,
                 differ_share: float = 0.0) -> None:
        self.scale, self.shift = np.float32(scale), np.float32(shift)
        self.fail_share, self.differ_share = fail_share, differ_share
        self.failing = trio.Event()

    def __call__(self, items: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        if self.fail_share and self.failing.is_set() and any(
            _key(it) < self.fail_share * 100 for it in items
        ):
            raise ValueError("canary weights fail on this input")
        out = []
        for it in items:
            y = it["x"] * self.scale + self.shift
            if _key(it) < self.differ_share * 100:
                y = y + np.float32(1)
            out.append({"y": y})
        return out


def _key(item: dict[str, np.ndarray]) -> int:
    return round(float(item["x"][0]) * 1000) % 100


def backend(fn: Affine) -> CallableBackend:
    return CallableBackend(fn, inputs=[X], outputs=[Y], execution="inline")


def config(versions: dict[str, Any], rollout: dict[str, Any], stable: Affine) -> Config:
    return Config(
        models=(ModelConfig(
            name=MODEL, backend=backend(stable), versions=versions, rollout=rollout,
            max_batch_size=16, max_wait_ms=1.0,
        ),),
        tenants=(TenantConfig(name="bench", default=True),),
    )


async def _load(
    rt: Any, seconds: float, on_start: Any = None, expect: Affine | None = None
) -> dict[str, Any]:
    """``CALLERS`` closed-loop callers for ``seconds``; what they got (``wrong``:
    answers other than ``expect``'s, when given). ``on_start(t0)`` runs beside them."""
    got: dict[str, Any] = {"sent": 0, "ok": 0, "errors": 0, "wrong": 0, "first_error": None}
    t0 = trio.current_time()
    end = t0 + seconds

    async def caller(i: int) -> None:
        rng = np.random.default_rng(i)
        while trio.current_time() < end:
            x = rng.integers(0, 1000, 8).astype(np.float32) / 1000
            got["sent"] += 1
            try:
                out = await rt.infer(MODEL, {"x": x})
            except TrioserveError:
                got["errors"] += 1
                if got["first_error"] is None:
                    got["first_error"] = trio.current_time() - t0
            else:
                got["ok"] += 1
                if expect is not None and not np.array_equal(
                    out["y"], expect([{"x": x}])[0]["y"]
                ):
                    got["wrong"] += 1
            await trio.sleep(THINK_S)

    async with trio.open_nursery() as nursery:
        for i in range(CALLERS):
            nursery.start_soon(caller, i)
        if on_start is not None:
            nursery.start_soon(on_start, t0)
    return got


async def good_canary(seconds: float) -> dict[str, Any]:
    step_s = seconds / 6
    rollout = {"stable": "1", "canary": "2", "steps": list(STEPS), "step_s": step_s,
               "min_requests": 50}
    versions = {"1": {}, "2": {"backend": backend(Affine(1.0, 0.5))}}
    async with open_runtime(config(versions, rollout, Affine(1.0))) as rt:
        got = await _load(rt, seconds)
        stats = rt.statistics()[MODEL]["rollout"]
    return {**got, "state": stats["state"], "events": stats["events"],
            "step_s": step_s}


async def bad_canary(seconds: float) -> dict[str, Any]:
    step_s = seconds  # the whole run is one step: it must end by a rollback
    rollout = {"stable": "1", "canary": "2", "steps": list(STEPS), "step_s": step_s,
               "min_requests": 100, "max_error_rate": 0.02}
    bad = Affine(1.0, fail_share=BAD_SHARE)
    versions = {"1": {}, "2": {"backend": backend(bad)}}
    fail_after = seconds / 4
    marks: dict[str, float] = {}
    async with open_runtime(config(versions, rollout, Affine(1.0))) as rt:
        controller = rt._families[MODEL].controller

        async def break_it(t0: float) -> None:
            await trio.sleep_until(t0 + fail_after)
            bad.failing.set()
            marks["failing"] = trio.current_time()

        got = await _load(rt, seconds, on_start=break_it)
        stats = rt.statistics()[MODEL]["rollout"]
        rolled = [e for e in controller.rollout.events if e.kind == "rolled_back"]
    after = rolled[0].at - marks["failing"] if rolled and "failing" in marks else None
    canary = stats["counts"]["2"]
    return {**got, "state": stats["state"], "reason": stats["reason"],
            "rolled_back_after_failing_s": after, "step_s": step_s,
            # the errors max_error_rate allows of the canary's answers in the step
            "errors_allowed": rollout["max_error_rate"] * max(
                canary["ok"] + canary["errors"], rollout["min_requests"]
            )}


async def shadow(seconds: float) -> dict[str, Any]:
    rollout = {"stable": "1", "shadow": "3", "shadow_share": 1.0}
    # the shadow's weights: stable's, but other on MISMATCH_SHARE of inputs
    versions = {"1": {}, "3": {"backend": backend(Affine(1.0, differ_share=MISMATCH_SHARE))}}
    stable = Affine(1.0)
    async with open_runtime(config(versions, rollout, stable)) as rt:
        got = await _load(rt, seconds, expect=stable)
        controller = rt._families[MODEL].controller
        # every copy offered and not dropped is run before the figures are read
        with trio.move_on_after(10):
            await controller.wait_shadow_results(got["ok"] - controller.shadow_results["dropped"])
        stats = rt.statistics()[MODEL]["rollout"]["shadow"]
    return {**got, "shadow": stats}


async def rollout(duration: float) -> dict[str, Any]:
    third = duration / 3
    good = await good_canary(third)
    bad = await bad_canary(third)
    sh = await shadow(third)
    counted = sum(sh["shadow"][k] for k in ("match", "mismatch", "error", "dropped"))
    return {
        "duration_s": duration,
        "callers": CALLERS,
        "good_canary": good,
        "bad_canary": bad,
        "shadow": sh,
        "checks": {
            "good canary promoted through every step, no caller-visible error":
                good["state"] == "promoted"
                and good["events"]["step"] == len(STEPS) - 1 and good["errors"] == 0,
            "bad canary rolled back within its step":
                bad["state"] == "rolled_back"
                and bad["rolled_back_after_failing_s"] is not None
                and bad["rolled_back_after_failing_s"] < bad["step_s"],
            "bad canary's caller-visible errors: those max_error_rate allows, + 1, + a batch":
                0 < bad["errors"] <= bad["errors_allowed"] + 1 + 16,
            "every request answered (none lost)": all(
                r["ok"] + r["errors"] == r["sent"] for r in (good, bad, sh)
            ),
            "shadow: callers got stable's answers; every copy counted; mismatches seen":
                sh["errors"] == 0 and sh["wrong"] == 0 and counted == sh["ok"]
                and sh["shadow"]["mismatch"] > 0 and sh["shadow"]["match"] > 0,
        },
    }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    return await rollout(args.duration or DEFAULT_DURATION)


def run(name: str, args: argparse.Namespace) -> int:
    return run_async(_main, name, args)
