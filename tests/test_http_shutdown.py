"""Graceful shutdown: stop accepting, answer what is in flight within the grace period,
fail (503) what is left after it, lose nothing; and the CLI drains on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import h11
import numpy as np
import pytest
import trio
import trioserve
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


async def test_a_stream_handshake_completed_during_a_drain_is_refused_503(autojump_clock):
    """A handshake whose head was still arriving when the drain began was accepted,
    and the new stream read and ran messages for the whole grace period, while every
    other stream had stopped reading: the drain waited for it. It is now refused as
    the drain refuses new work, 503 with Retry-After, and the drain ends at once."""
    from http_helpers import _HANDSHAKE, echo_model

    async with serving(config(echo_model())) as gw:
        sock = await trio.open_tcp_stream(*gw.addresses[0])
        await sock.send_all(_HANDSHAKE[:-2])  # the head but its last line break
        await settle()
        async with trio.open_nursery() as nursery:
            drained = trio.Event()

            async def drain() -> None:
                await gw.drain(10.0)
                drained.set()

            nursery.start_soon(drain)
            await settle()
            started = trio.current_time()
            await sock.send_all(_HANDSHAKE[-2:])
            data = b""
            while chunk := await sock.receive_some(65536):
                data += chunk
            await drained.wait()
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ")
        assert b"\r\nretry-after: 1\r\n" in head.lower()
        assert b"shutting down" in body
        assert trio.current_time() - started < 1.0  # not the grace period
        await sock.aclose()


async def test_a_stream_whose_handshake_ends_during_a_drain_closes_at_once(
    autojump_clock, monkeypatch
):
    """The same race a step later: the drain begins while the 101 is being written.
    The stream reads nothing then, and closes (1001) at once."""
    from http_helpers import _infer_frame, _raw_handshake, echo_model
    from trioserve.transport import _stream
    from wsproto.events import CloseConnection, TextMessage

    handshake, go_on = _stream._handshake, trio.Event()

    async def slow_handshake(*args: Any) -> Any:
        session = await handshake(*args)
        await go_on.wait()
        return session

    monkeypatch.setattr(_stream, "_handshake", slow_handshake)
    async with serving(config(echo_model())) as gw:
        sock, ws = await _raw_handshake(gw, _infer_frame("early"))
        await settle()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gw.drain, 10.0)
            await settle()
            started = trio.current_time()
            go_on.set()
            data = b""
            while chunk := await sock.receive_some(65536):
                data += chunk
        ws.receive_data(data)
        events = list(ws.events())
        assert not any(isinstance(e, TextMessage) for e in events)  # "early" not run
        assert [e.code for e in events if isinstance(e, CloseConnection)] == [1001]
        assert trio.current_time() - started < 2.0  # not the grace period
        await sock.aclose()


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
graceful_timeout_s = {grace}
"""


class Cli:
    """``trioserve serve`` in a subprocess on a free port, its output collected."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.output = b""
        self.url = ""

    @property
    def text(self) -> str:
        return self.output.decode()

    async def read_until(self, marker: bytes) -> None:
        """Read the output until it holds ``marker``."""
        with trio.fail_after(60):
            while marker not in self.output:
                chunk = await self.proc.stdout.receive_some()
                assert chunk, self.text
                self.output += chunk

    async def wait(self, limit: float) -> int:
        """The exit status, within ``limit`` seconds; the rest of the output read."""
        with trio.fail_after(limit):
            rc = await self.proc.wait()
            while chunk := await self.proc.stdout.receive_some():
                self.output += chunk
        return rc

    async def wait_in_flight(self, n: int) -> None:
        """Watch /metrics (the server is another process) until it holds ``n`` requests."""
        async with open_http(self.url) as http:
            with trio.fail_after(10):
                while True:
                    metrics = (await http.get("/metrics")).body
                    if b"trioserve_requests_in_flight %d.0" % n in metrics:
                        return
                    await trio.sleep(0.01)


@asynccontextmanager
async def cli(
    tmp_path: Path, grace: float, execution: str = "thread", **popen: Any
) -> AsyncIterator[Cli]:
    cfg = tmp_path / "trioserve.toml"
    cfg.write_text(
        CONFIG_TOML.format(grace=grace).replace('"thread"', f'"{execution}"')
    )
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "trioserve.cli", "serve", "--config", str(cfg), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        **popen,
    )
    server = Cli(proc)
    try:
        await server.read_until(b"try it")
        # the banner: "trioserve X: serving a, b on http://host:port"
        server.url = re.search(r": serving .* on (http://\S+)", server.text)[1]
        yield server
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def infer_sleep(url: str, ms: float, answers: list[Any]) -> None:
    """One request for the sleep model (x[0]: it sleeps that many ms); its status, or
    the error of a connection closed without an answer, goes to ``answers``."""
    try:
        async with open_http(url) as http:
            res = await http.infer("sleep", {"x": np.array([[ms]], np.float32)})
            answers.append(res.status)
    except (OSError, trio.BrokenResourceError, h11.RemoteProtocolError) as exc:
        answers.append(type(exc).__name__)


async def test_the_cli_drains_in_flight_requests_on_sigterm_and_exits_0(tmp_path: Path):
    async with cli(tmp_path, grace=10.0) as server:
        assert "curl -s " + server.url + "/v2/models/sleep/infer" in server.text
        answer: list[Any] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(infer_sleep, server.url, 1500.0, answer)
            await server.wait_in_flight(1)
            server.proc.send_signal(signal.SIGTERM)
        rc = await server.wait(30)
    text = server.text
    assert answer == [200]
    assert rc == 0, text
    assert "SIGTERM: draining" in text
    assert text.rstrip().endswith("trioserve: stopped")


async def test_sigterm_to_the_whole_process_group_drains_worker_processes_too(
    tmp_path: Path,
):
    """systemd's stop, Ctrl-C or `timeout` signal every process of the group: the zygote
    and the workers died of it at once, in the middle of the drain, and the request in
    flight was run again on a new worker (or failed)."""
    async with cli(tmp_path, grace=10.0, execution="process", start_new_session=True) as server:
        answer: list[Any] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(infer_sleep, server.url, 1500.0, answer)
            await server.wait_in_flight(1)
            os.killpg(server.proc.pid, signal.SIGTERM)
        rc = await server.wait(30)
    text = server.text
    assert answer == [200]
    assert rc == 0, text
    assert "SIGTERM: draining" in text
    assert "died" not in text
    assert text.rstrip().endswith("trioserve: stopped")


async def test_the_cli_counts_one_grace_for_the_drain_and_a_model_thread(tmp_path: Path):
    """A model call in a worker thread that outlasts the grace: its request gets 503
    when the grace ends, and the process exits then, not a second grace later (the
    runtime's wait for the thread counts from the same signal)."""
    grace = 3.0
    async with cli(tmp_path, grace=grace) as server:
        answer: list[Any] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(infer_sleep, server.url, 20_000.0, answer)
            await server.wait_in_flight(1)
            server.proc.send_signal(signal.SIGTERM)
            t0 = trio.current_time()
        rc = await server.wait(30)
        took = trio.current_time() - t0
    assert answer == [503]
    assert rc == 0, server.text
    # Twice the grace before; the margin is for a loaded machine.
    assert grace <= took < 1.5 * grace, server.text
    assert server.text.rstrip().endswith("trioserve: stopped")


async def test_a_second_signal_stops_the_cli_at_once(tmp_path: Path):
    """Even while a model call in a worker thread runs on, within a long grace: the
    second signal ends the drain and the runtime's wait for the thread."""
    async with cli(tmp_path, grace=60.0) as server:
        answer: list[Any] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(infer_sleep, server.url, 20_000.0, answer)
            await server.wait_in_flight(1)
            server.proc.send_signal(signal.SIGINT)
            await server.read_until(b"SIGINT: draining")
            server.proc.send_signal(signal.SIGINT)
            rc = await server.wait(10)  # the model call alone has 20 s to go
    text = server.text
    assert rc == 0, text
    assert "SIGINT again: stopping now" in text
    assert text.rstrip().endswith("trioserve: stopped")
    assert [type(a) for a in answer] == [str]  # closed without an answer


async def _answer_of(sock: socket.socket) -> bytes:
    """What the server sent on ``sock`` until it closed (b"" if reset or closed
    without a byte)."""
    data = b""
    while True:
        try:
            await trio.lowlevel.wait_readable(sock)
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


_ECHO_BODY = b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}'
_ECHO_REQUEST = (
    b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_ECHO_BODY), _ECHO_BODY)
)


async def test_a_request_that_arrived_before_the_drain_is_answered_not_reset():
    """A request already in its connection's socket when the drain began, not yet read
    (its task between requests, or not yet scheduled), was taken for an idle
    connection: the drain closed the socket with the request unread, and the client,
    whose request was sent before the signal, got a reset and no answer. It is now
    read and answered (Connection: close), as a request in flight is."""
    from http_helpers import echo_model

    async with serving(config(echo_model())) as gw:
        sock = socket.create_connection(gw.addresses[0])
        sock.setblocking(False)
        with sock:
            await settle()  # accepted; its task waits for a request
            assert gw.statistics().connections == 1
            sock.sendall(_ECHO_REQUEST)  # no checkpoint: the server has not read it
            async with trio.open_nursery() as nursery:
                nursery.start_soon(gw.drain, 10.0)
                data = await _answer_of(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), data
    assert b"\r\nconnection: close" in head.lower()
    assert b'"outputs"' in body


async def test_a_request_waiting_in_the_listen_backlog_at_the_drain_is_answered():
    """A connection the kernel had completed but the server not yet accepted when the
    drain closed its listeners was reset by the close, its request (sent before the
    signal) unanswered. The listeners now take what is waiting in their backlog as
    they close, and such a connection is served as an accepted one is: its request
    answered, or, with none sent, closed with a FIN rather than a reset."""
    from http_helpers import echo_model

    async with serving(config(echo_model())) as gw:
        with socket.create_connection(gw.addresses[0]) as sent, \
                socket.create_connection(gw.addresses[0]) as silent:
            sent.setblocking(False)
            silent.setblocking(False)
            sent.sendall(_ECHO_REQUEST)
            # no checkpoint since the connects: both wait in the backlog
            assert gw.statistics().connections == 0
            async with trio.open_nursery() as nursery:
                nursery.start_soon(gw.drain, 10.0)
                data = await _answer_of(sent)
                try:
                    await trio.lowlevel.wait_readable(silent)
                    quiet = silent.recv(10)
                except ConnectionResetError:
                    quiet = None
    assert data.startswith(b"HTTP/1.1 200 "), data
    assert quiet == b""  # closed, not reset


class _LateListener(trio.abc.Listener[trio.SocketStream]):
    """A listener that accepts one connection, then leaves the next ones in its
    backlog, and whose accept loop sees the drain's cancel only when ``late`` is set:
    the connections' tasks run first (trio may schedule them in either order)."""

    def __init__(self, sock: trio.socket.SocketType, late: trio.Event) -> None:
        self.inner = trio.SocketListener(sock)
        self.socket = sock
        self.late = late
        self.accepted = False

    async def accept(self) -> trio.SocketStream:
        if not self.accepted:
            self.accepted = True
            return await self.inner.accept()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                await self.late.wait()
            raise

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_connection_closing_before_the_listeners_do_leaves_the_backlog_served():
    """The last open connection closing during the drain, before the listeners had
    taken their backlogs, said that every connection had closed: the drain's grace
    ended at once, and a request waiting in the backlog, taken after, was answered
    503 at once instead of within the grace. The drain's end now waits for the
    listeners too."""
    from trioserve.transport import open_gateway

    gate = Gate()
    late = trio.Event()
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    body = b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}'
    request = (
        b"POST /v2/models/held/infer HTTP/1.1\r\nHost: t\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    async with trioserve.open_runtime(config(held_model(gate, max_batch_size=1))) as rt, \
            open_gateway(rt, listeners=[_LateListener(sock, late)]) as gw:
        with socket.create_connection(gw.addresses[0]):
            await settle()  # accepted; its task waits for a request
            assert gw.statistics().connections == 1
            with socket.create_connection(gw.addresses[0]) as sent:
                sent.setblocking(False)
                sent.sendall(request)  # no checkpoint: it waits in the backlog
                left_open: list[int] = []

                async def drain() -> None:
                    await gw.drain(10.0)
                    left_open.append(gw.statistics().connections)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(drain)
                    await settle()  # the idle connection has closed
                    assert gw.statistics().connections == 0
                    late.set()  # now the listener closes, taking its backlog
                    try:
                        held = await trio.to_thread.run_sync(gate.holding.wait, 10.0)
                        waited = held and not left_open  # in flight: the drain waits
                    finally:
                        gate.release()
                    data = await _answer_of(sent)
    assert data.startswith(b"HTTP/1.1 200 "), data
    assert waited
    assert left_open == [0]


class _AbortsFirst:
    """The drain's descriptor of a listening socket, whose first accept finds a
    connection reset while it waited in the backlog (ECONNABORTED), as the kernel
    reports one."""

    made = 0

    def __init__(self, fileno: int) -> None:
        self.sock = socket.socket(fileno=fileno)
        self.aborted = False
        _AbortsFirst.made += 1

    def __enter__(self) -> _AbortsFirst:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def setblocking(self, flag: bool) -> None:
        self.sock.setblocking(flag)

    def accept(self) -> tuple[socket.socket, Any]:
        if not self.aborted:
            self.aborted = True
            raise ConnectionAbortedError(103, "Software caused connection abort")
        return self.sock.accept()


async def test_a_connection_reset_in_the_backlog_does_not_end_the_drains_take(monkeypatch):
    """One connection of the backlog reset while it waited (the take's accept fails
    with ECONNABORTED) does not end the take: the next ones are still served. The
    take used to stop at any error, and the close reset the rest."""
    from types import SimpleNamespace

    from http_helpers import echo_model
    from trioserve.transport import _accept

    monkeypatch.setattr(_accept, "socket", SimpleNamespace(socket=_AbortsFirst))
    async with serving(config(echo_model())) as gw:
        # The accept loop, woken with the drain, may accept the first before it sees
        # the cancel; the second is the take's, after the reset one.
        with socket.create_connection(gw.addresses[0]) as first, \
                socket.create_connection(gw.addresses[0]) as sent:
            first.setblocking(False)
            sent.setblocking(False)
            sent.sendall(_ECHO_REQUEST)
            assert gw.statistics().connections == 0  # in the backlog
            async with trio.open_nursery() as nursery:
                nursery.start_soon(gw.drain, 10.0)
                data = await _answer_of(sent)
    assert _AbortsFirst.made == 1  # the take ran
    assert data.startswith(b"HTTP/1.1 200 "), data


async def test_the_drains_take_short_of_descriptors_leaves_the_drain_as_before(monkeypatch):
    """Out of descriptors for the take's own (EMFILE from dup): the backlog is left
    to the close, as before the take, and the drain ends as it does without one."""
    from types import SimpleNamespace

    from http_helpers import echo_model
    from trioserve.transport import _accept

    def no_dup(fd: int) -> int:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(_accept, "os", SimpleNamespace(dup=no_dup, strerror=os.strerror))
    async with serving(config(echo_model())) as gw:
        with socket.create_connection(gw.addresses[0]) as sent:
            sent.setblocking(False)
            sent.sendall(_ECHO_REQUEST)
            with trio.fail_after(5):
                await gw.drain(10.0)
            assert gw.statistics().connections == 0



def test_an_accept_failure_for_want_of_resources_is_logged_and_another_raised(caplog):
    # Both accept loops (the gateway's, and the one answering while models load)
    # retry the first kind after ACCEPT_RETRY_S and stop on the second.
    import errno

    from trioserve.transport._accept import accept_failed

    with caplog.at_level("ERROR", logger="trioserve"):
        accept_failed(OSError(errno.EMFILE, "Too many open files"))
    assert "accept failed: EMFILE (Too many open files); retrying in 0.1 s" in caplog.text
    with pytest.raises(OSError, match="Bad file descriptor"):
        accept_failed(OSError(errno.EBADF, "Bad file descriptor"))
