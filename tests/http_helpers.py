"""Helpers for the gateway tests: small configs, a model held by a gate, and a real
server on a free loopback port."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import trio
import trioserve
from trioserve import CallableBackend, ModelConfig, TensorSpec
from trioserve.transport import Gateway, InferRequest, ModelSignature, open_gateway
from trioserve.transport._v2 import dumps

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


def f32(*values: float) -> np.ndarray:
    return np.asarray(values, np.float32)


# ---------------------------------------------------------------- raw WebSocket clients
async def _raw_client(gw, head: bytes | None = None):
    """A bare TCP stream and a wsproto client that has completed the handshake."""
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection, Request

    sock = await trio.open_tcp_stream(*gw.addresses[0])
    ws = WSConnection(ConnectionType.CLIENT)
    await sock.send_all(ws.send(Request(host="localhost", target="/v2/stream")))
    accepted = False
    while not accepted:
        ws.receive_data(await sock.receive_some(65536))
        accepted = any(isinstance(e, AcceptConnection) for e in ws.events())
    return sock, ws


async def _events_until(sock, ws, kind, limit: int = 100):
    seen = []
    for _ in range(limit):
        data = await sock.receive_some(65536)
        ws.receive_data(data or None)
        for event in ws.events():
            seen.append(event)
            if isinstance(event, kind):
                return seen
        if not data:
            break
    raise AssertionError(f"no {kind.__name__} in {seen}")


_HANDSHAKE = (b"GET /v2/stream HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
              b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
              b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")


def _client_frame(payload: bytes, opcode: int = 0x1, *, masked: bool = True) -> bytes:
    """One final client frame (payload under 126 bytes), masked unless told."""
    assert len(payload) < 126
    mask = b"\x01\x02\x03\x04"
    if not masked:
        return bytes([0x80 | opcode, len(payload)]) + payload
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + body


async def _raw_handshake(gw, extra: bytes = b""):
    """A raw socket that sent the handshake (and ``extra`` in the same write) and a
    wsproto client fed the server's 101; returns (sock, ws, bytes after the 101)."""
    from wsproto import ConnectionType
    from wsproto.connection import Connection

    sock = await trio.open_tcp_stream(*gw.addresses[0])
    await sock.send_all(_HANDSHAKE + extra)
    data = b""
    while b"\r\n\r\n" not in data:
        data += await sock.receive_some(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101 ")
    ws = Connection(ConnectionType.CLIENT)
    ws.receive_data(rest)
    return sock, ws


def _infer_text(rid, x=(1.0,), model: str = "echo") -> str:
    """One request's message (ASCII: its length is its size in bytes)."""
    return json.dumps(
        {"id": rid, "model": model,
         "inputs": [{"name": "x", "shape": [len(x)], "datatype": "FP32", "data": list(x)}]}
    )


def _infer_frame(rid, x=(1.0,), model: str = "echo") -> bytes:
    """A raw client's frame for one request."""
    from wsproto.events import TextMessage

    return _raw_ws().send(TextMessage(data=_infer_text(rid, x, model)))


def _raw_ws():
    from wsproto import ConnectionType
    from wsproto.connection import Connection

    return Connection(ConnectionType.CLIENT)


def _frame_header(length: int, opcode: int = 0x1, *, fin: bool = True) -> bytes:
    """A masked client frame's header (and mask) announcing ``length`` bytes."""
    import struct

    first = bytes([(0x80 if fin else 0) | opcode])
    if length < 126:
        size = bytes([0x80 | length])
    elif length < 1 << 16:
        size = bytes([0x80 | 126]) + struct.pack("!H", length)
    else:
        size = bytes([0x80 | 127]) + struct.pack("!Q", length)
    return first + size + b"\x01\x02\x03\x04"


async def _read_to_eof(sock) -> bytes:
    data = b""
    while chunk := await sock.receive_some(1 << 20):
        data += chunk
    return data


def _masked(payload: bytes) -> bytes:
    """``payload`` masked with the key of :func:`_frame_header`."""
    mask = b"\x01\x02\x03\x04"
    return bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


# ---------------------------------------------------------------- v2 wire format, sans IO
class _Served:
    def __init__(self, backend, **cfg):
        self.backend = backend
        self.config = trioserve.ModelConfig(name=cfg.pop("name", "m"), backend=backend, **cfg)


def signature(inputs, outputs=None, *, open_inputs=False, **cfg) -> ModelSignature:
    backend = trioserve.CallableBackend(
        lambda items: items, inputs=inputs, outputs=outputs or inputs, open_inputs=open_inputs
    )
    return ModelSignature.of(_Served(backend, **cfg))


VEC = signature([TensorSpec(name="x", datatype="FP32", shape=(4,))],
                [TensorSpec(name="y", datatype="FP32", shape=(2,))], versions=("1", "3"))
OPEN = signature([TensorSpec(name="x", datatype="FP32", shape=(-1,))], open_inputs=True)


def parse(doc, sig=VEC, **kw) -> InferRequest:
    return InferRequest.from_v2_json(dumps(doc), sig, **kw)
