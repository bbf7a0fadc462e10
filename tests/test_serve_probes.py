"""Probes as Kubernetes needs them: answered while the models load (live 200, ready
503, the rest 503), the gateway taking the listeners over without losing a request,
and the drain delay (``server.drain_delay_s``): not ready, still serving, then the
drain."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import trio
import trioserve
from http_helpers import GATE_LIMIT_S, X, Y, config, echo_model, settle
from trioserve import CallableBackend, ModelConfig
from trioserve.transport import _main, open_gateway, open_http, open_stream
from trioserve.transport._client import HttpResponse

ONE = {"x": np.ones((1, 1), np.float32)}


class HeldLoad(CallableBackend):
    """An echo model whose load (in a worker thread) waits until ``release`` is set;
    ``loading`` is set when it begins."""

    def __init__(self) -> None:
        super().__init__(
            lambda items: [{"y": it["x"]} for it in items],
            inputs=[X], outputs=[Y], execution="thread",
        )
        self.loading = threading.Event()
        self.release = threading.Event()

    def load(self, device: str, *, torch_threads: int = 1) -> Any:
        self.loading.set()
        self.release.wait(GATE_LIMIT_S)
        return super().load(device, torch_threads=torch_threads)


@attrs.define
class Served:
    """``serve`` (the command's) running in a task: its URL once bound, its loading
    answers, and its gateway once that serves (``up``)."""

    url: str = ""
    address: tuple[str, int] = ("", 0)
    loading: Any = None
    gateway: Any = None
    up: trio.Event = attrs.Factory(trio.Event)


@asynccontextmanager
async def serve_in_task(
    cfg: trioserve.Config, monkeypatch: pytest.MonkeyPatch, results: list[int] | None = None
) -> AsyncIterator[Served]:
    """``_main.serve(cfg)`` in a task; yields once its listeners are bound. Leaving
    the block cancels it, unless it returned (its status then in ``results``)."""
    served = Served()
    bound = trio.Event()
    real_listen, real_gateway, real_loading = (
        _main.open_listeners, _main.open_gateway, _main.LoadingAnswers
    )

    async def open_listeners(*args: Any, **kw: Any) -> Any:
        listeners = await real_listen(*args, **kw)
        host, port = listeners[0].socket.getsockname()[:2]
        served.url = f"http://{host}:{port}"
        served.address = (host, port)
        bound.set()
        return listeners

    def loading_answers(*args: Any) -> Any:
        served.loading = real_loading(*args)
        return served.loading

    @asynccontextmanager
    async def open_gateway(*args: Any, **kw: Any) -> AsyncIterator[Any]:
        async with real_gateway(*args, **kw) as gw:
            served.gateway = gw
            served.up.set()
            yield gw

    monkeypatch.setattr(_main, "open_listeners", open_listeners)
    monkeypatch.setattr(_main, "LoadingAnswers", loading_answers)
    monkeypatch.setattr(_main, "open_gateway", open_gateway)
    # the process's GC is the test session's: left as it is
    monkeypatch.setattr(_main, "settle_memory", lambda: None)

    async def run() -> None:
        status = await _main.serve(cfg)
        if results is not None:
            results.append(status)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await bound.wait()
        yield served
        if results is None:
            nursery.cancel_scope.cancel("the test is over")


async def call(url: str, method: str, target: str, body: bytes = b"") -> HttpResponse:
    """One request on a connection of its own."""
    async with open_http(url) as http:
        return await http.request(method, target, body)


async def infer(url: str) -> HttpResponse:
    async with open_http(url) as http:
        return await http.infer("m", ONE)


def held_config(backend: HeldLoad, **server: Any) -> trioserve.Config:
    return config(
        ModelConfig(name="m", backend=backend, max_wait_ms=0.0),
        server={"port": 0, **server},
    )


# ---------------------------------------------------------------- while the models load
async def test_while_the_models_load_live_is_200_ready_503_and_the_rest_503(monkeypatch):
    """A probe connected and waited until every model had loaded: a liveness probe
    (1 s timeout) failed during a load of minutes, and the pod was killed."""
    backend = HeldLoad()
    try:
        async with serve_in_task(held_config(backend), monkeypatch) as served:
            await trio.to_thread.run_sync(backend.loading.wait, GATE_LIMIT_S)
            url = served.url
            with trio.fail_after(GATE_LIMIT_S / 3):  # the load goes on for ever
                live = await call(url, "GET", "/v2/health/live")
                head = await call(url, "HEAD", "/v2/health/live")
                ready = await call(url, "GET", "/v2/health/ready")
                model_ready = await call(url, "GET", "/v2/models/m/ready")
                inferred = await infer(url)
                metrics = await call(url, "GET", "/metrics")
            assert (live.status, live.json()) == (200, {"live": True})
            assert (head.status, head.body) == (200, b"")
            assert head.headers["content-length"] == str(len(b'{"live":true}'))
            assert ready.status == 503
            assert ready.json() == {"error": "not ready: the server is loading models"}
            for res in (model_ready, inferred, metrics):
                assert res.status == 503
                assert res.json() == {"error": "the server is loading models; retry later"}
            for res in (live, head, ready, model_ready, inferred, metrics):
                assert res.headers["connection"] == "close"  # the next one reconnects
                assert res.headers["content-type"] == "application/json"
            for res in (ready, model_ready, inferred, metrics):
                assert res.headers["retry-after"] == "1"
            assert served.gateway is None
            assert served.loading.accepted == 6

            backend.release.set()
            await served.up.wait()
            ready = await call(url, "GET", "/v2/health/ready")
            inferred = await infer(url)
            assert (ready.status, ready.json()) == (200, {"ready": True})
            assert inferred.status == 200
            assert inferred.outputs()["y"].tolist() == [[1.0]]
            assert served.loading.accepted == 6  # the gateway answered those
    finally:
        backend.release.set()


async def test_a_malformed_request_while_loading_gets_400(monkeypatch):
    backend = HeldLoad()
    try:
        async with serve_in_task(held_config(backend), monkeypatch) as served:
            await trio.to_thread.run_sync(backend.loading.wait, GATE_LIMIT_S)
            sock = await trio.open_tcp_stream(*served.address)
            await sock.send_all(b"GET /v2/health/live HTTP/1.1\r\nno colon\r\n\r\n")
            data = b""
            with trio.fail_after(GATE_LIMIT_S / 3):
                while chunk := await sock.receive_some(65536):
                    data += chunk
            await sock.aclose()
    finally:
        backend.release.set()
    assert data.startswith(b"HTTP/1.1 400 ")
    assert b'{"error":"bad HTTP request: ' in data


async def test_the_gateway_takes_the_listeners_over_without_losing_a_request(monkeypatch):
    """Clients that send requests as fast as they are answered through the load and
    the hand-over: each gets an answer, 503 (loading) until the gateway serves, then
    200; no connection is refused, reset or closed without one."""
    backend = HeldLoad()
    clients = 8
    answers: list[Any] = []
    loading_seen = trio.Event()

    async def client(url: str) -> None:
        while True:
            try:
                res = await infer(url)  # a new connection each time: nothing retried
            except Exception as exc:
                answers.append(repr(exc))
                return
            answers.append(res.status)
            if len(answers) >= 4 * clients:
                loading_seen.set()
            if res.status == 200:
                return

    try:
        async with serve_in_task(held_config(backend), monkeypatch) as served:
            await trio.to_thread.run_sync(backend.loading.wait, GATE_LIMIT_S)
            with trio.fail_after(GATE_LIMIT_S):
                async with trio.open_nursery() as nursery:
                    for _ in range(clients):
                        nursery.start_soon(client, served.url)
                    await loading_seen.wait()
                    released = len(answers)
                    backend.release.set()
    finally:
        backend.release.set()
    assert set(answers) == {503, 200}, [a for a in answers if a not in (200, 503)]
    assert answers.count(200) == clients
    assert 503 in answers[released:]  # they kept coming through the hand-over


async def test_a_connection_accepted_while_loading_is_answered_after_the_hand_over(
    monkeypatch,
):
    """Its request, completed after the gateway took the listeners over, is answered
    by the loading answers that accepted it, not dropped."""
    backend = HeldLoad()
    try:
        async with serve_in_task(held_config(backend), monkeypatch) as served:
            await trio.to_thread.run_sync(backend.loading.wait, GATE_LIMIT_S)
            sock = await trio.open_tcp_stream(*served.address)
            await sock.send_all(b"GET /v2/health/ready HTTP/1.1\r\nhost: x\r\n")
            await settle()
            assert served.loading.accepted == 1
            backend.release.set()
            await served.up.wait()
            await sock.send_all(b"\r\n")
            data = b""
            with trio.fail_after(GATE_LIMIT_S / 3):
                while chunk := await sock.receive_some(65536):
                    data += chunk
            await sock.aclose()
            assert (await call(served.url, "GET", "/v2/health/ready")).status == 200
    finally:
        backend.release.set()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ")
    assert b"\r\nconnection: close" in head.lower()
    assert body == b'{"error":"not ready: the server is loading models"}'


# ---------------------------------------------------------------- the drain delay
async def test_leaving_open_gateway_answers_not_ready_for_the_drain_delay(mock_clock):
    """For ``server.drain_delay_s`` the gateway says it is not ready, and serves as
    usual (a kept connection and a new one alike); then it drains."""
    cfg = config(echo_model(), server={"drain_delay_s": 5.0})
    leave, left = trio.Event(), trio.Event()

    async def run(rt: trioserve.Runtime, task_status: Any) -> None:
        async with open_gateway(rt, host="127.0.0.1", port=0) as gw:
            task_status.started(gw)
            await leave.wait()
        left.set()

    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        gw = await nursery.start(run, rt)
        async with open_http(gw.url) as kept:
            assert (await kept.get("/v2/health/ready")).status == 200
            leave.set()
            await settle()
            assert gw.leaving
            assert not gw.statistics().draining
            for _ in range(2):
                ready = await kept.get("/v2/health/ready")
                assert ready.status == 503
                assert ready.json() == {"error": "not ready: the server is shutting down"}
                assert (await kept.get("/v2/models/echo/ready")).status == 503
                assert (await kept.get("/v2/health/live")).status == 200
                res = await kept.infer("echo", ONE)
                assert res.status == 200
                assert res.headers["connection"] == "close"  # the client reconnects
                assert (await infer_echo(gw.url)).status == 200  # new connections too
                mock_clock.jump(2.4)
                await settle()
            assert not left.is_set()
            assert not gw.statistics().draining
            mock_clock.jump(0.2)
            await left.wait()
        assert gw.statistics().draining
        with pytest.raises(OSError, match="all attempts to connect"):
            await trio.open_tcp_stream(*gw.addresses[0])


def _infer_request(connection: bytes = b"") -> bytes:
    body = b'{"inputs":[{"name":"x","shape":[1,1],"datatype":"FP32","data":[1.0]}]}'
    return (
        b"POST /v2/models/echo/infer HTTP/1.1\r\nhost: t\r\n%scontent-length: %d\r\n\r\n%s"
        % (connection, len(body), body)
    )


async def _read_answer(stream: trio.SocketStream) -> tuple[bytes, bytes]:
    """One answer's head (lower-cased) and body, read whole off ``stream``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        assert chunk, f"the connection closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        assert chunk
        body += chunk
    assert len(body) == length  # nothing after the answer
    return head.lower(), body


async def test_during_the_drain_delay_http_answers_close_their_connection(mock_clock):
    """As Envoy does while it drains: during the delay every HTTP/1.1 answer (the data
    plane's and the control plane's) says ``Connection: close`` and the server closes
    the connection after it, so a kept-alive client moves to another server rather than
    race the drain's close of its idle connection. A stream opened before goes on."""
    cfg = config(echo_model(), server={"drain_delay_s": 5.0})
    leave = trio.Event()

    async def run(rt: trioserve.Runtime, task_status: Any) -> None:
        async with open_gateway(rt, host="127.0.0.1", port=0) as gw:
            task_status.started(gw)
            await leave.wait()

    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        gw = await nursery.start(run, rt)
        host, port = gw.addresses[0][:2]
        async with open_stream(gw.url) as ws:
            data_plane = await trio.open_tcp_stream(host, port)
            control_plane = await trio.open_tcp_stream(host, port)
            async with data_plane, control_plane:
                # before the delay: kept alive
                await data_plane.send_all(_infer_request())
                head, _ = await _read_answer(data_plane)
                assert head.startswith(b"http/1.1 200 ")
                assert b"connection:" not in head
                await control_plane.send_all(b"GET /v2/health/live HTTP/1.1\r\nhost: t\r\n\r\n")
                head, _ = await _read_answer(control_plane)
                assert b"connection:" not in head

                leave.set()
                await settle()
                assert gw.leaving
                assert not gw.statistics().draining
                # the same connections, during the delay: answered, then closed
                await data_plane.send_all(_infer_request())
                head, body = await _read_answer(data_plane)
                assert head.startswith(b"http/1.1 200 ")
                assert b"\r\nconnection: close" in head
                assert b'"outputs"' in body
                assert await data_plane.receive_some(65536) == b""  # closed by the server
                await control_plane.send_all(b"GET /v2/health/live HTTP/1.1\r\nhost: t\r\n\r\n")
                head, body = await _read_answer(control_plane)
                assert head.startswith(b"http/1.1 200 ")
                assert b"\r\nconnection: close" in head
                assert body == b'{"live":true}'
                assert await control_plane.receive_some(65536) == b""

            # a new connection, during the delay: served, and closed after its answer
            async with await trio.open_tcp_stream(host, port) as fresh:
                await fresh.send_all(_infer_request())
                head, _ = await _read_answer(fresh)
                assert head.startswith(b"http/1.1 200 ")
                assert b"\r\nconnection: close" in head
                assert await fresh.receive_some(65536) == b""

            # the stream is left as it is: it keeps answering
            for i in range(3):
                await ws.send(f"r{i}", "echo", ONE)
                reply = await ws.receive()
                assert reply.id == f"r{i}"
                assert reply.error is None
            assert gw.statistics().draining is False
        nursery.cancel_scope.cancel("the test is over")


async def infer_echo(url: str) -> HttpResponse:
    async with open_http(url) as http:
        return await http.infer("echo", ONE)


def _echo_config(delay: float, grace: float = 10.0) -> trioserve.Config:
    cfg = config(echo_model(), server={"port": 0, "drain_delay_s": delay})
    return attrs.evolve(
        cfg, runtime=attrs.evolve(cfg.runtime, graceful_timeout_s=grace)
    )


async def test_sigterm_is_not_ready_for_the_drain_delay_then_drains(
    mock_clock, monkeypatch, capsys
):
    """The signal path under the mock clock: the line says the delay; for its length
    readiness is 503 and the rest served; then the drain, and status 0. The grace
    counts from the delay's end."""
    results: list[int] = []
    async with serve_in_task(_echo_config(5.0), monkeypatch, results) as served:
        await served.up.wait()
        gw = served.gateway
        os.kill(os.getpid(), signal.SIGTERM)  # serve's receiver has it
        await settle()
        assert "SIGTERM: not ready for 5 s (server.drain_delay_s), then draining " \
            "(up to 10 s; signal again to stop now)" in capsys.readouterr().out
        assert (await call(served.url, "GET", "/v2/health/ready")).status == 503
        assert (await call(served.url, "GET", "/v2/health/live")).status == 200
        assert (await infer_echo(served.url)).status == 200
        assert gw.runtime.grace_deadline == trio.current_time() + 5.0 + 10.0
        mock_clock.jump(4.9)
        await settle()
        assert not results
        assert not gw.statistics().draining
        mock_clock.jump(0.2)
    assert results == [0]
    assert capsys.readouterr().out.rstrip().endswith("trioserve: stopped")


async def test_a_second_signal_during_the_drain_delay_stops_at_once(
    mock_clock, monkeypatch, capsys
):
    """As at any point of the shutdown: no wait for the rest of the delay, nor a drain."""
    results: list[int] = []
    async with serve_in_task(_echo_config(60.0), monkeypatch, results) as served:
        await served.up.wait()
        os.kill(os.getpid(), signal.SIGTERM)
        await settle()
        assert served.gateway.leaving
        os.kill(os.getpid(), signal.SIGINT)
    assert results == [0]
    out = capsys.readouterr().out
    assert "SIGINT again: stopping now" in out
    assert out.rstrip().endswith("trioserve: stopped")
    assert trio.current_time() == 0.0  # the clock never moved: nothing waited for it


DELAY_TOML = """
[models.echo]
backend = "echo"

[server]
port = 0
drain_delay_s = {delay}

[runtime]
graceful_timeout_s = 10
"""


async def test_the_command_serves_through_the_drain_delay_then_exits_0(tmp_path: Path):
    """The real command and signal: during the delay, a new connection is served and
    readiness is 503; then it drains and exits 0, the delay's length after the signal."""
    delay = 1.5
    cfg = tmp_path / "serve.toml"
    cfg.write_text(DELAY_TOML.format(delay=delay))
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "trioserve.cli", "serve", "--config", str(cfg)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    output = b""

    async def read_until(marker: bytes) -> None:
        nonlocal output
        while marker not in output:
            chunk = await proc.stdout.receive_some()
            assert chunk, output.decode()
            output += chunk

    try:
        with trio.fail_after(60):
            await read_until(b"try it")
            url = re.search(r": serving .* on (http://\S+)", output.decode())[1]
            proc.send_signal(signal.SIGTERM)
            signalled = trio.current_time()
            await read_until(b"then draining")
            ready = await call(url, "GET", "/v2/health/ready")
            inferred = await infer_echo(url)
            answered = trio.current_time()
            rc = await proc.wait()
            took = trio.current_time() - signalled
            while chunk := await proc.stdout.receive_some():
                output += chunk
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = output.decode()
    assert answered - signalled < delay, text  # within the delay, or the test says nothing
    assert ready.status == 503
    assert inferred.status == 200
    assert rc == 0, text
    assert f"SIGTERM: not ready for {delay:g} s (server.drain_delay_s), then draining" in text
    assert text.rstrip().endswith("trioserve: stopped")
    assert delay <= took < delay + 5.0, text  # the margin is for a loaded machine
