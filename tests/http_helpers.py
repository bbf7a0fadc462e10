"""Helpers for the gateway tests: small configs, a model held by a gate, and a real
server on a free loopback port."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import trio
import trioserve
from trioserve import CallableBackend, ModelConfig, TensorSpec
from trioserve.transport import Gateway, open_gateway

X = TensorSpec(name="x", datatype="FP32", shape=(-1,))
Y = TensorSpec(name="y", datatype="FP32", shape=(-1,))
#: A safety net for gated model threads, far above any test's run time.
GATE_LIMIT_S = 30.0


class Gate:
    """A model (run in a worker thread) echoing ``x`` as ``y``; a batch holding an
    item with x[0] > 0 waits until :meth:`release`. ``entered`` counts held batches."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._lock = threading.Lock()
        self.entered = 0
        #: set when a first batch is held (wait for it with trio.to_thread.run_sync)
        self.holding = threading.Event()

    def __call__(self, items: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        if any(it["x"].size and float(it["x"][0]) > 0 for it in items):
            with self._lock:
                self.entered += 1
            self.holding.set()
            self._open.wait(GATE_LIMIT_S)
        return [{"y": it["x"]} for it in items]

    def release(self) -> None:
        self._open.set()


def held_model(gate: Gate, name: str = "held", **cfg: Any) -> ModelConfig:
    backend = CallableBackend(gate, inputs=[X], outputs=[Y], execution="thread")
    cfg.setdefault("max_wait_ms", 0.0)
    return ModelConfig(name=name, backend=backend, **cfg)


def echo_model(**cfg: Any) -> ModelConfig:
    return ModelConfig(name="echo", backend="echo", max_wait_ms=0.0, **cfg)


def mlp_model(**cfg: Any) -> ModelConfig:
    return ModelConfig(name="mlp", backend="mlp", execution="inline", max_wait_ms=1.0, **cfg)


def config(
    *models: ModelConfig,
    tenants: tuple[trioserve.TenantConfig, ...] | None = None,
    server: dict[str, Any] | None = None,
    **runtime: Any,
) -> trioserve.Config:
    """A config serving ``models`` (default tenant: one open tenant ``t``). Streams
    are not pinged unless ``server`` says so: under an autojump clock a test that
    waits on a thread would see 40 s pass, and a stream that answers no ping closed."""
    return trioserve.Config(
        models=models,
        tenants=tenants or (trioserve.TenantConfig(name="t", default=True),),
        runtime=trioserve.RuntimeLimits(**runtime),
        server=trioserve.ServerConfig(**{"stream_ping_interval_s": 0, **(server or {})}),
    )


@asynccontextmanager
async def serving(cfg: trioserve.Config) -> AsyncIterator[Gateway]:
    """A runtime and its gateway on a free loopback port; yields the gateway."""
    async with trioserve.open_runtime(cfg) as rt, open_gateway(rt, host="127.0.0.1", port=0) as gw:
        yield gw


async def settle() -> None:
    """Wait until every task is blocked (socket data already sent gets read first)."""
    await trio.testing.wait_all_tasks_blocked()


def v2_input(x: Any, name: str = "x", datatype: str = "FP32") -> dict[str, Any]:
    arr = np.asarray(x)
    return {"name": name, "shape": list(arr.shape), "datatype": datatype,
            "data": arr.reshape(-1).tolist()}
