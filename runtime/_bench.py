"""``trioserve bench``: closed-loop load in process (or over HTTP), with the model's
offline throughput beside it so served ÷ offline says how close serving comes to
the physical limit."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import trio

from ._builtin import imported, resolve_backend
from ._config import (
    BUILTIN_BACKENDS,
    MAX_QUEUE_BOUND,
    Config,
    ConfigError,
    ModelConfig,
)
from ._config_file import in_file, load_config
from ._runtime import open_runtime


def sample_input(model: str, backend: Any) -> Any:
    """One representative item for a model."""
    if getattr(backend, "inputs", None) and backend.inputs[0].datatype == "BYTES":
        return {backend.inputs[0].name: "the quick brown fox jumps over the lazy dog " * 4}
    rng = np.random.default_rng(0)
    item = {}
    for spec in backend.inputs:
        shape = tuple(d if d > 0 else 8 for d in spec.shape)
        item[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        if model == "sleep" or backend.__class__.__name__ == "SleepBackend":
            item[spec.name] = np.zeros(shape, spec.dtype)
    return item


#: Built-in backends that do no work of their own: a bare loop over one measures only
#: the loop (hundreds of millions of items/s), so served ÷ offline would say nothing.
NO_OFFLINE = frozenset({"echo"})


def no_offline_note(cfg: ModelConfig) -> str | None:
    """Why the bench of ``cfg`` has no offline figure (None: it has one)."""
    if isinstance(cfg.backend, str) and cfg.backend in NO_OFFLINE:
        return f"none: model {cfg.name!r} does no work to compare with"
    return None


def offline_throughput(cfg: ModelConfig, *, seconds: float = 3.0) -> dict[str, Any]:
    """Items/s of a bare runner loop at ``max_batch_size`` (best of 3 runs)."""
    backend = resolve_backend(cfg)
    runner = backend.load(cfg.replica_devices[0], torch_threads=cfg.torch_threads)
    item, _ = backend.prepare(cfg.name, sample_input(cfg.name, backend))
    batch = [item] * cfg.max_batch_size
    runner(batch)  # warm up
    best = 0.0
    for _ in range(3):
        n = 0
        t0 = time.perf_counter()
        while (el := time.perf_counter() - t0) < seconds / 3:
            runner(batch)
            n += len(batch)
        best = max(best, n / el)
    return {"batch_size": cfg.max_batch_size, "items_per_s": best}


@attrs.frozen(kw_only=True)
class BenchSpec:
    model: str = "mlp"
    concurrency: int = 256
    duration: float = 10.0
    warmup: float = 2.0
    replicas: int | None = None
    max_batch_size: int | None = None
    max_wait_ms: float | None = None
    torch_threads: int | None = None
    execution: str | None = None
    offline: bool = True
    config: str | None = None  # the config file's path; None: the built-in configuration


class NoOpenTenant(ConfigError):
    """The configuration has no tenant that takes requests without an API key, which
    the in-process bench's callers need: a usage error of the bench, not a wrong file."""


class UnknownBenchModel(ConfigError):
    """``--model`` names no model of the configuration, no built-in backend and no
    import string that imports: a usage error of the bench, not a wrong file. The
    message begins "cannot bench model", as ``bench --url``'s does."""


def _bench_config(base: Config, spec: BenchSpec) -> Config:
    """The configuration the bench runs: ``base`` with the chosen model alone (the
    others are not loaded: they would take memory and start-up time, and no load goes
    to them), the bench's overrides applied to that model's settings, and ``base``'s
    tenants, classes, runtime limits and cache as they are. The callers call as the
    default tenant (NoOpenTenant when there is none). Only the built-in configuration's
    queue bound is raised to twice the callers, so that they are not shed."""
    if not any(t.default for t in base.tenants):
        where = f"--config {spec.config}" if spec.config else "the configuration"
        raise NoOpenTenant(
            f"{where} has no open tenant: the in-process bench calls without an API key, "
            "as the tenant with 'default = true'; mark one of its tenants "
            f"({', '.join(t.name for t in base.tenants)}) so, or bench a server with "
            "--url and --api-key"
        )
    try:
        m = base.model(spec.model)
    except KeyError:
        where = f"--config {spec.config}" if spec.config else "the built-in configuration"
        served = ", ".join(mc.name for mc in base.models) or "no model"
        unknown = (
            f"cannot bench model {spec.model!r}: {where} does not serve it (serving: {served})"
        )
        try:
            m = ModelConfig(name=spec.model, backend=spec.model)
        except ConfigError:
            raise UnknownBenchModel(
                f"{unknown}, and it is not a built-in backend "
                f"({', '.join(BUILTIN_BACKENDS)}) or an import string 'module:attr'"
            ) from None
        if m.backend not in BUILTIN_BACKENDS:
            try:  # imported only: the runtime makes the backend, as for a file's model
                imported(spec.model)
            except ConfigError as exc:
                raise UnknownBenchModel(f"{unknown}, and as an import string: {exc}") from None
    changes = {
        k: v
        for k, v in {
            "replicas": spec.replicas,
            "max_batch_size": spec.max_batch_size,
            "max_wait_ms": spec.max_wait_ms,
            "torch_threads": spec.torch_threads,
            "execution": spec.execution,
        }.items()
        if v is not None
    }
    m = attrs.evolve(m, **changes)
    limits = base.runtime
    if spec.config is None:
        # room for every caller's request (within the bound's own cap)
        limits = attrs.evolve(limits, queue_bound=min(
            MAX_QUEUE_BOUND, max(limits.queue_bound, spec.concurrency * 2)
        ))
    return attrs.evolve(base, models=(m,), runtime=limits)


async def run_load(
    call: Callable[[], Any],
    *,
    concurrency: int,
    duration: float,
    warmup: float,
    on_progress: Callable[[float, int], None] | None = None,
    on_measure_start: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Closed loop: ``concurrency`` callers each awaiting ``call()`` back to back."""
    from trioserve.actors import Latency

    lat = Latency()
    state = {"measuring": False, "count": 0, "errors": 0}
    errors: dict[str, int] = {}

    async def caller() -> None:
        now = trio.current_time
        while True:
            t0 = now()
            try:
                await call()
            except trio.Cancelled:
                raise
            except Exception as exc:
                if state["measuring"]:
                    state["errors"] += 1
                    key = type(exc).__name__
                    errors[key] = errors.get(key, 0) + 1
                await trio.sleep(0.001)
                continue
            if state["measuring"]:
                lat.record(now() - t0)
                state["count"] += 1

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(caller)
        await trio.sleep(warmup)
        if on_measure_start:
            on_measure_start()
        state["measuring"] = True
        cpu0, thr0 = time.process_time(), time.thread_time()
        t0 = trio.current_time()
        end = t0 + duration
        while (now := trio.current_time()) < end:
            await trio.sleep(min(0.25, end - now))
            if on_progress:
                on_progress(trio.current_time() - t0, state["count"])
        elapsed = trio.current_time() - t0
        state["measuring"] = False  # what the cancellation below causes is not counted
        count = state["count"]
        n_errors, error_kinds = state["errors"], dict(errors)
        cpu1, thr1 = time.process_time(), time.thread_time()
        nursery.cancel_scope.cancel("bench finished")
    s = lat.summary()
    return {
        "requests": count,
        "errors": n_errors,
        "error_kinds": error_kinds,
        "seconds": elapsed,
        "requests_per_s": count / elapsed,
        "latency_ms": attrs.asdict(s),
        "loop_cpu_share": (thr1 - thr0) / elapsed,
        "process_cpu_share": (cpu1 - cpu0) / elapsed,
    }


def _progress(total: float, label: str):
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn(label),
        BarColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeRemainingColumn(),
        transient=True,
    )
    task = progress.add_task(label, total=total, rate="")

    def update(elapsed: float, count: int) -> None:
        progress.update(task, completed=elapsed, rate=f"{count / max(elapsed, 1e-9):,.0f} req/s")

    return progress, update


async def bench_in_process(spec: BenchSpec, base: Config, *, progress: bool) -> dict[str, Any]:
    config = _bench_config(base, spec)
    mcfg = config.models[0]
    note = no_offline_note(mcfg) if spec.offline else None
    offline = offline_throughput(mcfg) if spec.offline and note is None else None
    async with open_runtime(config) as rt:
        served = rt.models[mcfg.name]
        inputs = sample_input(mcfg.name, served.backend)
        infer = rt.infer
        name = mcfg.name

        async def call() -> Any:
            return await infer(name, inputs)

        bar, update = _progress(spec.duration, f"bench {name}") if progress else (None, None)
        busy0 = [0.0]

        def measure_start() -> None:
            served.metrics.reset()
            busy0[0] = sum(b.device_seconds for b in served.batchers)

        if bar is not None:
            bar.start()
        try:
            res = await run_load(
                call,
                concurrency=spec.concurrency,
                duration=spec.duration,
                warmup=spec.warmup,
                on_progress=update,
                on_measure_start=measure_start,
            )
        finally:
            if bar is not None:
                bar.stop()
        busy = sum(b.device_seconds for b in served.batchers) - busy0[0]
        res["device_utilisation"] = busy / res["seconds"] / len(served.batchers)
        res["fill_ratio"] = served.metrics.fill_ratio
        res["mean_batch"] = served.metrics.items / max(served.metrics.batches, 1)
        res["batch_exec_ms"] = attrs.asdict(served.metrics.batch_exec.summary())
        res["queue_wait_ms"] = attrs.asdict(served.metrics.queue_wait.summary())
    res.update(
        mode="in-process",
        config=spec.config,
        model=name,
        concurrency=spec.concurrency,
        replicas=len(mcfg.replica_devices),
        max_batch_size=mcfg.max_batch_size,
        torch_threads=mcfg.torch_threads,
        execution=mcfg.execution or served.backend.default_execution,
        offline=offline,
        cost_us_per_request=1e6 / res["requests_per_s"] if res["requests_per_s"] else None,
    )
    if offline:
        res["served_over_offline"] = res["requests_per_s"] / offline["items_per_s"]
    elif note:
        res["offline_note"] = note
    return res


def format_report(res: dict[str, Any]) -> str:
    lat = res["latency_ms"]
    kinds = f" {res['error_kinds']}" if res.get("error_kinds") else ""
    lines = [
        f"{res['mode']} bench: model={res['model']} concurrency={res['concurrency']} "
        + (f"replicas={res.get('replicas')} max_batch={res.get('max_batch_size')} "
           if "replicas" in res else "")
        + f"duration={res['seconds']:.1f}s",
        f"  requests/s     {res['requests_per_s']:,.0f}   ({res['requests']:,} ok, "
        f"{res['errors']:,} errors{kinds})",
        *([f"  config         {res['config'] or '(built-in)'}"] if "config" in res else []),
        f"  latency ms     p50 {lat['p50_ms']:.2f}  p90 {lat['p90_ms']:.2f}  "
        f"p99 {lat['p99_ms']:.2f}  max {lat['max_ms']:.2f}",
    ]
    if "fill_ratio" in res:
        lines.append(
            f"  batch fill     {res['fill_ratio']:.2f} (mean batch {res['mean_batch']:.1f})"
        )
    if res.get("cost_us_per_request"):
        lines.append(f"  per request    {res['cost_us_per_request']:.1f} µs of wall time")
    if "device_utilisation" in res:
        lines.append(f"  device busy    {res['device_utilisation']:.0%} per replica")
    # against a server (--url) the CPU measured is the bench client's own
    cpu = "cpu" if res.get("mode", "in-process") == "in-process" else "cpu (bench)"
    lines.append(
        f"  {cpu:<15}event loop {res['loop_cpu_share']:.0%} of a core, "
        f"process {res['process_cpu_share']:.0%}"
    )
    if res.get("offline"):
        off = res["offline"]
        where = f" ({off['where']})" if off.get("where") else ""
        lines.append(
            f"  offline        {off['items_per_s']:,.0f} items/s at batch {off['batch_size']}"
            f"{where}  → served/offline {res['served_over_offline']:.2f}"
        )
    elif res.get("offline_note"):
        lines.append(f"  offline        {res['offline_note']}")
    return "\n".join(lines)


def write_json(res: dict[str, Any], path: str | None) -> Path:
    out = Path(path) if path else Path("bench-results") / f"bench-{res['model']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str))
    return out


def main_in_process(spec: BenchSpec, config_path: str | None, json_path: str | None) -> int:
    try:
        base = load_config(config_path)
    except ConfigError as exc:  # (a wrong option given to bench names no file)
        raise in_file(exc, config_path) from None
    spec = attrs.evolve(spec, config=config_path)
    res = trio.run(lambda: bench_in_process(spec, base, progress=os.isatty(2)))
    print(format_report(res))
    print(f"  json           {write_json(res, json_path)}")
    return _answered_any(res)


def _answered_any(res: dict[str, Any]) -> int:
    """0 when some request was answered with a result; else 1, with a line on stderr
    saying so (figures of no answers are no measurement; ``bench --url`` says the
    same with the same status)."""
    if res["requests"]:
        return 0
    kinds = ", ".join(f"{k} {n:,}" for k, n in sorted(res.get("error_kinds", {}).items()))
    print(
        f"trioserve: no request was answered with a result in {res['seconds']:.1f} s"
        + (f" (errors: {kinds})" if kinds else ""),
        file=sys.stderr,
    )
    return 1
