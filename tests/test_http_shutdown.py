"""Graceful shutdown: stop accepting, answer what is in flight within the grace period,
fail (503) what is left after it, lose nothing; and the CLI drains on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import trio
from http_helpers import Gate, config, held_model, serving, settle
from trio_websocket import ConnectionClosed
from trioserve.transport import open_http, open_stream

ONE = {"x": np.ones((1, 1), np.float32)}


async def test_drain_answers_requests_in_flight_and_stops_accepting():
    gate = Gate()
    async with serving(config(held_model(gate, max_batch_size=1))) as gw:
        answers = []

        async def held() -> None:
            async with open_http(gw.url) as http:
                res = await http.infer("held", ONE)
                answers.append((res.status, res.headers.get("connection")))

        async with trio.open_nursery() as nursery, open_http(gw.url) as idle, \
                open_stream(gw.url) as stream:
            assert (await idle.get("/v2/health/ready")).status == 200
            for _ in range(3):
                nursery.start_soon(held)
            await stream.send("s1", "held", {"x": np.ones(1, np.float32)})
            await settle()
            assert gw.statistics().connections == 5

            drained = trio.Event()

            async def drain() -> None:
                await gw.drain(10.0)
                drained.set()

            nursery.start_soon(drain)
            await settle()
            # The idle keep-alive connection is closed at once; the listener is closed.
            assert gw.statistics().connections == 4
            with pytest.raises(OSError, match="all attempts to connect"):
                await trio.open_tcp_stream(*gw.addresses[0])
            assert not drained.is_set()
            gate.release()
            reply = await stream.receive()
            with pytest.raises(ConnectionClosed) as closed:
                await stream.receive()
            await drained.wait()
    assert sorted(answers) == [(200, "close")] * 3
    assert reply.id == "s1"
    assert reply.error is None
    assert closed.value.reason is None or closed.value.reason.code in (1000, 1001)
    assert gw.statistics().connections == 0


async def test_requests_still_held_when_the_grace_period_ends_are_answered_503():
    gate = Gate()
    try:
        async with serving(config(held_model(gate, max_batch_size=1))) as gw:
            answers = []

            async def held() -> None:
                async with open_http(gw.url) as http:
                    res = await http.infer("held", ONE)
                    answers.append((res.status, res.json()))

            async with trio.open_nursery() as nursery, open_stream(gw.url) as stream:
                for _ in range(3):
                    nursery.start_soon(held)
                await stream.send("s1", "held", {"x": np.ones(1, np.float32)})
                await settle()
                await gw.drain(0.2)
                frame = await stream.receive()
            assert gw.statistics().connections == 0
    finally:
        gate.release()
    expected = {"error": "the server is shutting down; the request was not completed"}
    assert answers == [(503, expected)] * 3
    assert (frame.id, frame.status) == ("s1", 503)
    assert "shutting down" in frame.error


async def test_leaving_open_gateway_drains_within_the_configured_grace():
    gate = Gate()
    answered, graces = [], []
    async with trio.open_nursery() as nursery:
        async with serving(config(held_model(gate, max_batch_size=1),
                                  graceful_timeout_s=7.0)) as gw:

            async def held() -> None:
                async with open_http(gw.url) as http:
                    answered.append((await http.infer("held", ONE)).status)

            drain = gw.drain

            async def drain_then_release(grace: float) -> None:
                graces.append(grace)
                async with trio.open_nursery() as inner:
                    inner.start_soon(drain, grace)
                    await settle()  # the drain waits for the requests in flight
                    assert answered == []
                    gate.release()

            gw.drain = drain_then_release
            for _ in range(2):
                nursery.start_soon(held)
            await settle()
        # Leaving the block drained: both requests were answered, none lost.
    assert graces == [7.0]
    assert answered == [200, 200]


CONFIG_TOML = """
[models.sleep]
backend = "sleep"
execution = "thread"
max_batch_size = 4
max_wait_ms = 0.0

[runtime]
graceful_timeout_s = 10.0
"""


async def test_the_cli_drains_in_flight_requests_on_sigterm_and_exits_0(tmp_path: Path):
    cfg = tmp_path / "trioserve.toml"
    cfg.write_text(CONFIG_TOML)
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "trioserve.cli", "serve", "--config", str(cfg), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    output = b""
    try:
        with trio.fail_after(60):
            while b"try it" not in output:
                chunk = await proc.stdout.receive_some()
                assert chunk, output.decode()
                output += chunk
        url = output.decode().split(" on ", 1)[1].split()[0]
        assert "curl -s " + url + "/v2/models/sleep/infer" in output.decode()
        async with trio.open_nursery() as nursery:
            answer = []

            async def slow() -> None:
                async with open_http(url) as http:  # x[0]: the model sleeps 1500 ms
                    res = await http.infer("sleep", {"x": np.array([[1500.0]], np.float32)})
                    answer.append(res.status)

            nursery.start_soon(slow)
            async with open_http(url) as http:
                # The server is another process: watch its /metrics until it holds
                # the request.
                with trio.fail_after(10):
                    while True:
                        metrics = (await http.get("/metrics")).body
                        if b"trioserve_requests_in_flight 1.0" in metrics:
                            break
                        await trio.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            rc = await proc.wait()
            while chunk := await proc.stdout.receive_some():
                output += chunk
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = output.decode()
    assert answer == [200]
    assert rc == 0, text
    assert "SIGTERM: draining" in text
    assert text.rstrip().endswith("trioserve: stopped")
