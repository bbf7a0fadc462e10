"""Edges of the fault handling (docs/faults.md): a part of a failed batch that waits
for another replica than the one it raised on, a replica whose device is lost
(thread, inline, a slow lane's), the queue retired when every replica of it is lost,
and what callers, credits, statistics and readiness say meanwhile."""

from __future__ import annotations

import math
import threading

import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import GATE_LIMIT_S, ILLEGAL_ACCESS, X, Y, config, item, key
from trioserve import DeadlineExceeded, ModelConfig, Request
from trioserve.actors import BatchLimits, FairQueue, SchedulerActor
from trioserve.actors._scheduler import ELSEWHERE_RECHECK

HOLD = 100.0  # the input that keeps its replica busy until the test releases it


class _Replica:
    """A puller as the scheduler sees one: ready or not."""

    def __init__(self, ready: bool = True) -> None:
        self.ready = ready


def _request(*, deadline: float = math.inf, answer_expiry: bool = False) -> Request:
    return Request(
        model="m", item=None, cost=1, tenant="t", priority="default",
        arrival=0.0, deadline=deadline, answer_expiry=answer_expiry,
    )


async def _raised_alone_on(scheduler: SchedulerActor, replica: _Replica, requests) -> None:
    """Each of ``requests`` is queued, pulled by ``replica``, raises alone there and
    is handed back for another replica (as ``BatcherActor._model_failed`` does)."""
    for request in requests:
        scheduler.submit_nowait(request)
        (pulled,) = await scheduler.pull(replica)
        assert pulled is request
        scheduler.completed([request], failed=True)
        request.reply.suspect = True
        request.reply.raised_on = (replica, 0)
        scheduler.retry([[request]])


async def test_a_retry_waiting_for_another_replica_is_answered_at_its_deadline(
    autojump_clock,
):
    """A request that raised alone on replica A waits for another ready one, B, which
    is busy (a long batch). Its deadline passes meanwhile: A, looking again every
    ELSEWHERE_RECHECK, answers it DeadlineExceeded then, and drops one whose caller
    left. Before, A passed both by without a look at them, and the caller waited
    past its deadline for as long as B was busy."""
    queue = FairQueue(BatchLimits(max_size=4), bound=16, model="m", adaptive=False)
    scheduler = SchedulerActor("m", queue)
    a, b = _Replica(), _Replica()  # b: ready, and never pulls
    scheduler.batchers = [a, b]
    scheduler.replicas = 2
    late = _request(deadline=1.0, answer_expiry=True)
    left = _request()
    await _raised_alone_on(scheduler, a, [late, left])
    left.reply.withdraw()  # its caller leaves
    assert scheduler.queue_depth() == 2

    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler.pull, a)
        with trio.fail_after(10), pytest.raises(DeadlineExceeded, match="being retried") as info:
            await late.reply.wait()
        assert trio.current_time() <= 1.0 + ELSEWHERE_RECHECK
        assert not info.value.in_queue  # it ran (and raised) once
        await trio.testing.wait_all_tasks_blocked()
        assert scheduler.queue_depth() == 0
        nursery.cancel_scope.cancel("the test is over")


class BusyOrBroken(trioserve.ModelBackend):
    """Thread replicas: a batch holding HOLD blocks its replica until ``gate`` is set
    (``busy``: that replica's device); a replica on a device in ``broken`` raises on
    anything else; otherwise ``y = x``."""

    inputs = (X,)
    outputs = (Y,)
    default_execution = "thread"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()  # set when a batch holding HOLD began
        self.busy: str | None = None
        self.broken: set[str] = set()

    def load(self, device, *, torch_threads=1):
        def run(items):
            if any(key(it) == HOLD for it in items):
                self.busy = device
                self.started.set()
                if not self.gate.wait(GATE_LIMIT_S):
                    raise RuntimeError("gate never opened")
            elif device in self.broken:
                raise RuntimeError(ILLEGAL_ACCESS)
            return [{"y": it["x"].copy()} for it in items]

        return run


async def test_parts_left_to_a_busy_replica_are_answered_at_their_deadline(mock_clock):
    """Through the runtime: replica B runs a long batch; a batch of two sound
    requests raises on the broken replica A, and each part, raising alone there
    too, waits for B. At their deadline (the model's timeout, 1 s) the caller gets
    DeadlineExceeded, while B is still busy; before, it waited until B was free.
    (The clock stands still: thread replicas.)"""
    backend = BusyOrBroken()
    cfg = config(ModelConfig(name="m", backend=backend, devices=("cpu:0", "cpu:1"),
                             max_batch_size=4, max_wait_ms=0, timeout_ms=1000))
    async with trioserve.open_runtime(cfg) as rt:
        scheduler = rt.models["m"].scheduler
        handed_back = trio.Event()
        retry = scheduler.retry

        def counting_retry(batches):
            retry(batches)
            if scheduler.retried == 4:  # the batch in two parts, then each part marked
                handed_back.set()

        scheduler.retry = counting_retry
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(rt.infer, "m", item(HOLD))
                await trio.to_thread.run_sync(backend.started.wait, GATE_LIMIT_S)
                [broken] = [b.device for b in rt.models["m"].batchers
                            if b.device != backend.busy]
                backend.broken.add(broken)
                got: list[BaseException] = []

                async def call() -> None:
                    with pytest.raises(DeadlineExceeded) as info:
                        await rt.infer_batch("m", [item(1.0), item(2.0)])
                    got.append(info.value)

                nursery.start_soon(call)
                await handed_back.wait()
                await trio.testing.wait_all_tasks_blocked()
                assert all(r[0].reply.raised_on is not None for r in scheduler._retries)
                mock_clock.jump(1.0)  # their deadline
                await trio.testing.wait_all_tasks_blocked()
                assert got  # answered while B is still busy
                assert not backend.gate.is_set()
                assert scheduler.queue_depth() == 0
                backend.gate.set()
        finally:
            backend.gate.set()
