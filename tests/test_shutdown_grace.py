"""Shutdown with a model call cut off in a worker thread: the runtime's exit waits
for the call (a thread cannot be stopped) only within its grace, a grace begun before
leaving the block or moved to the past bounds that wait, and the command ends at once
with os._exit when a call outlived the runtime."""

from __future__ import annotations

import math
import threading

import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import config, item, straggler_model


class Held:
    """A model for a worker thread that blocks until released; ``entered`` is set
    once a call is running."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, items):
        self.entered.set()
        if not self.release.wait(30):
            raise RuntimeError("never released")
        return [{"y": it["x"]} for it in items]


async def test_shutdown_waits_for_a_model_call_it_cut_off_in_a_thread():
    """A thread cannot be stopped: the runtime's exit waits (within its grace) for a
    call it gave up to return, so the process never exits under a running model
    (torch would abort it in the interpreter's finalisation)."""
    from trioserve.actors import model_threads_running

    held = Held()
    cfg = config(straggler_model(held, batch_timeout_cap_ms=60_000), graceful_timeout_s=30)
    closed = trio.Event()

    async def serve_one_and_leave():
        async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as callers:
            callers.start_soon(rt.infer, "m", item(1))
            await trio.to_thread.run_sync(held.entered.wait)
            callers.cancel_scope.cancel()  # the caller leaves; the call runs on
        closed.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_one_and_leave)
        await trio.to_thread.run_sync(held.entered.wait)
        await trio.testing.wait_all_tasks_blocked()
        assert not closed.is_set()  # the runtime's exit waits for the thread
        assert model_threads_running() == 1
        held.release.set()
        await closed.wait()
    assert model_threads_running() == 0


async def test_shutdown_waits_for_a_cut_off_model_call_only_for_its_grace(autojump_clock):
    from trioserve.actors import model_threads_running

    held = Held()
    cfg = config(straggler_model(held, batch_timeout_cap_ms=60_000), graceful_timeout_s=5)
    try:
        async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as callers:
            callers.start_soon(rt.infer, "m", item(1))
            await trio.to_thread.run_sync(held.entered.wait)
            callers.cancel_scope.cancel()
            t0 = trio.current_time()
        assert trio.current_time() - t0 == pytest.approx(5.0)
        assert model_threads_running() == 1  # still running: the exit did not wait on
    finally:
        held.release.set()
    await rt.models["m"].batchers[0].join_thread()  # gone before the next test
    assert model_threads_running() == 0


async def test_a_grace_begun_before_leaving_the_block_is_the_close_s_too(autojump_clock):
    """A server that begins its shutdown before leaving ``open_runtime`` (the gateway
    drains its connections first, on a signal) sets ``grace_deadline`` then: the
    close waits for a cut-off model call until that deadline, not a whole
    ``graceful_timeout_s`` more."""
    from trioserve.actors import model_threads_running

    held = Held()
    cfg = config(straggler_model(held, batch_timeout_cap_ms=60_000), graceful_timeout_s=5)
    try:
        async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as callers:
            callers.start_soon(rt.infer, "m", item(1))
            await trio.to_thread.run_sync(held.entered.wait)
            t0 = trio.current_time()
            rt.grace_deadline = t0 + 5
            await trio.sleep(3)  # the drain of connections spends part of it
            callers.cancel_scope.cancel()
        assert trio.current_time() - t0 == pytest.approx(5.0)
        assert rt.grace_deadline == t0 + 5
        assert model_threads_running() == 1
    finally:
        held.release.set()
    await rt.models["m"].batchers[0].join_thread()
    assert model_threads_running() == 0


async def test_moving_the_grace_deadline_to_the_past_ends_the_close_at_once(autojump_clock):
    """The close's wait for a model thread is shielded (an outer cancellation does
    not skip it); a second signal ends it by moving the grace deadline."""
    from trioserve.actors import model_threads_running

    held = Held()
    cfg = config(straggler_model(held, batch_timeout_cap_ms=60_000), graceful_timeout_s=30)

    async def stop_in(seconds: float, rt: trioserve.Runtime) -> None:
        await trio.sleep(seconds)
        rt.grace_deadline = -math.inf

    try:
        async with trio.open_nursery() as outside:
            async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as callers:
                callers.start_soon(rt.infer, "m", item(1))
                await trio.to_thread.run_sync(held.entered.wait)
                callers.cancel_scope.cancel()
                t0 = trio.current_time()
                outside.start_soon(stop_in, 2.0, rt)
            assert trio.current_time() - t0 == pytest.approx(2.0)
            assert model_threads_running() == 1
    finally:
        held.release.set()
    await rt.models["m"].batchers[0].join_thread()
    assert model_threads_running() == 0


def test_the_command_ends_at_once_when_a_model_call_outlived_the_runtime(monkeypatch):
    """``trioserve``'s entry point: a model thread still running after the runtime
    closed ends the process with ``os._exit`` (the interpreter's finalisation would
    abort it), with main's status; otherwise it exits normally."""
    import trioserve.actors
    from trioserve import cli

    class Exited(BaseException):
        pass

    def fake_exit(code: int) -> None:
        raise Exited(code)

    def crash() -> int:
        raise RuntimeError("escalated")

    running = [1]
    monkeypatch.setattr(trioserve.actors, "model_threads_running", lambda: running[0])
    monkeypatch.setattr(cli, "main", lambda: 3)
    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    with pytest.raises(Exited) as ended:
        cli.entry()
    assert ended.value.args == (3,)
    monkeypatch.setattr(cli, "main", crash)  # an error out of main: status 1, at once
    with pytest.raises(Exited) as ended:
        cli.entry()
    assert ended.value.args == (1,)
    running[0] = 0
    with pytest.raises(RuntimeError, match="escalated"):
        cli.entry()
    monkeypatch.setattr(cli, "main", lambda: 3)
    with pytest.raises(SystemExit) as info:
        cli.entry()
    assert info.value.code == 3


def test_the_command_does_not_wait_for_threads_a_model_left_running(monkeypatch, capsys):
    """A thread a model started and never stopped (a backend factory's watcher, an
    inline model's helper: not a daemon) kept ``trioserve serve`` alive for ever
    after "stopped", the interpreter waiting to join it. The command now ends with
    main's status and says which threads it did not wait for."""
    from trioserve import cli

    class Exited(BaseException):
        pass

    def fake_exit(code: int) -> None:
        raise Exited(code)

    stop = threading.Event()
    leaked = threading.Thread(target=stop.wait, args=(60,), name="weights-watcher")
    monkeypatch.setattr(cli, "main", lambda: (leaked.start(), 0)[1])
    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    try:
        with pytest.raises(Exited) as ended:
            cli.entry()
    finally:
        stop.set()
        leaked.join()
    assert ended.value.args == (0,)
    assert "not waiting for 1 thread the models left running: weights-watcher" in (
        capsys.readouterr().err
    )
