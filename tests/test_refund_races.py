"""A request that never ran is refunded exactly once, whatever the order in which its
caller leaves and the runtime finds it will not run: answered a "never ran" error
first, the caller cancelled first (in the same scheduling step), or dropped unrun
after its caller left. The unhedged path, a hedged caller's pair, and a batch call's
items. A request that ran keeps its charge."""

from __future__ import annotations

import functools
import types

import numpy as np
import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import Gate, NoZygote, _StandIn, callable_model, item
from trioserve import (
    ActorClosed,
    DeadlineExceeded,
    InvalidInput,
    Overloaded,
    Request,
    RequestState,
    TenantConfig,
    WorkerProcess,
)
from trioserve._hedging import _Hedging


@pytest.fixture
def gate():
    g = Gate()
    yield g
    g.release()


def _config(gate: Gate) -> trioserve.Config:
    """Tenant a with 10 credits (1/s) and a one-replica model that blocks on ``gate``."""
    return trioserve.Config(
        models=(callable_model(
            "m", gate, execution="thread", max_batch_size=1, max_wait_ms=0,
            timeout_ms=None, adaptive_limit=False,
        ),),
        tenants=(TenantConfig(name="a", default=True, credit_rate=1.0, credit_burst=10.0),),
    )


async def _handed_back(rt) -> Request:
    """Take the one request queued as a replica would, and hand it back as it was (it
    never reached the model: a batch staged behind a lost worker's): dispatched, held
    for a retry, never run."""
    scheduler = rt.models["m"].scheduler
    batch = await scheduler.pull()
    assert len(batch) == 1
    scheduler.completed(batch, failed=True)
    scheduler.retry([batch])
    (request,) = batch
    assert request.reply.state is RequestState.DISPATCHED
    assert not request.reply.suspect
    return request


def _credits(rt) -> tuple[int, int]:
    tenant = rt.tenant_statistics()["a"]
    return tenant["credits_used"], tenant["credits_refunded"]


@pytest.mark.parametrize("order", ["answered-then-cancelled", "cancelled-then-answered"])
@pytest.mark.parametrize("held", ["queued", "handed back"])
async def test_a_request_not_run_at_shutdown_is_refunded_whoever_comes_first(
    autojump_clock, gate, order, held
):
    """Its queue fails it as not run (``in_queue``) in the same step as its caller's
    scope is cancelled. Handed back (dispatched) and cancelled first, the caller
    abandoned it (it might still run) and the error that said it never ran was
    dropped with its credits: they were lost."""
    async with trioserve.open_runtime(_config(gate)) as rt, trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(rt.infer, "m", item(1)))
        await trio.testing.wait_all_tasks_blocked()  # item 1 holds the replica
        scope = trio.CancelScope()
        ended: list[BaseException] = []

        async def caller() -> None:
            with scope:
                try:
                    await rt.infer("m", item(2))
                except Exception as exc:  # the error it is answered with
                    ended.append(exc)

        nursery.start_soon(caller)
        await trio.testing.wait_all_tasks_blocked()
        scheduler = rt.models["m"].scheduler
        if held == "handed back":
            request = await _handed_back(rt)
        else:
            (request,) = list(scheduler.policy)
        # in one step: nothing else runs between the two
        if order == "answered-then-cancelled":
            scheduler.retire(ActorClosed("the model's devices are gone"))
            scope.cancel("the caller left")
        else:
            scope.cancel("the caller left")
            if held == "handed back":
                assert request.reply.state is RequestState.ABANDONED
                assert _credits(rt) == (2, 0)  # it may still run: charged for now
            scheduler.retire(ActorClosed("the model's devices are gone"))
        await trio.testing.wait_all_tasks_blocked()
        if order == "answered-then-cancelled":
            assert [type(e) for e in ended] == [ActorClosed]
            assert ended[0].in_queue
        else:
            assert ended == []
            assert scope.cancelled_caught
        assert _credits(rt) == (1, 1)
        gate.release()
    assert _credits(rt) == (1, 1)  # once, not twice
    assert gate.seen == [1.0]


@pytest.mark.parametrize("call", ["infer", "infer_batch"])
async def test_a_dispatched_request_dropped_unrun_after_its_caller_left_is_refunded(
    autojump_clock, gate, call
):
    """Its caller left while it was held for a retry (abandoned: it might still
    run); the replica's next pull drops it, never run. Its credits come back then,
    once; they used to be lost. So for a batch call's item."""
    async with trioserve.open_runtime(_config(gate)) as rt:
        scheduler = rt.models["m"].scheduler
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(rt.infer, "m", item(1)))
            await trio.testing.wait_all_tasks_blocked()  # item 1 holds the replica
            scope = trio.CancelScope()

            async def caller() -> None:
                with scope:
                    if call == "infer":
                        await rt.infer("m", item(2))
                    else:
                        await rt.infer_batch("m", [item(2)])

            nursery.start_soon(caller)
            await trio.testing.wait_all_tasks_blocked()
            request = await _handed_back(rt)
            scope.cancel("the caller left")
            await trio.testing.wait_all_tasks_blocked()
            assert request.reply.state is RequestState.ABANDONED
            assert _credits(rt) == (2, 0)  # it may still run: charged for now
            gate.release()  # item 1 ends; the replica's next pull drops item 2
        await trio.testing.wait_all_tasks_blocked()
        assert scheduler.queue_depth() == 0
        assert _credits(rt) == (1, 1)
    assert _credits(rt) == (1, 1)
    assert gate.seen == [1.0]


# ---------------------------------------------------------------- a worker process's staged batches
class _StagingWorker(_StandIn):
    """A worker process in trio time that runs nothing: each batch it is sent waits
    for the runtime to kill it. Closed, it says the batches left in flight after the
    first were never started, as a worker process that wrote no result does."""

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        self.pid = None
        self.busy_seconds = self.last_run_seconds = 0.0
        self.in_flight = 0
        self._exited = trio.Event()

    async def submit(self, items) -> None:
        await trio.lowlevel.checkpoint()
        self.in_flight += 1

    async def result(self):
        await self._exited.wait()
        raise self.Died("killed")

    async def aclose(self) -> None:
        self.kill()
        self.never_started = max(0, self.in_flight - 1)
        with trio.CancelScope(shield=True):  # as a worker process waits for its exit
            await trio.lowlevel.checkpoint()


async def test_batches_staged_on_a_worker_process_at_shutdown_are_refunded(
    autojump_clock, manual_watchdog, monkeypatch
):
    """At shutdown the batch its worker ran is failed as the runtime's close (charged:
    it may have run), the two staged behind it as never run (refunded, once): they
    used to be charged too."""
    import trioserve._runtime
    import trioserve.actors._batcher

    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", _StagingWorker)
    cfg = trioserve.Config(
        models=(callable_model(
            "m", lambda items: items, execution="process", max_batch_size=1,
            max_wait_ms=0, timeout_ms=None, adaptive_limit=False,
        ),),
        tenants=(TenantConfig(name="a", default=True, credit_rate=1.0, credit_burst=10.0),),
    )
    ended: dict[float, BaseException] = {}

    async def caller(rt, value: float) -> None:
        try:
            await rt.infer("m", item(value))
        except ActorClosed as exc:
            ended[value] = exc

    async with trio.open_nursery() as nursery:
        async with trioserve.open_runtime(cfg) as rt:
            for value in (1.0, 2.0, 3.0):
                nursery.start_soon(caller, rt, value)
                await trio.testing.wait_all_tasks_blocked()
            assert [len(b) for b in rt.models["m"].batchers[0]._in_flight] == [1, 1, 1]
            assert _credits(rt) == (3, 0)
    assert sorted(ended) == [1.0, 2.0, 3.0]
    assert [ended[v].in_queue for v in (1.0, 2.0, 3.0)] == [False, True, True]
    assert all("the runtime is shut down" in str(e) for e in ended.values())
    assert _credits(rt) == (1, 2)  # the staged ones given back: 1 charged, not 3


async def test_a_staged_request_whose_caller_left_is_refunded_when_its_worker_never_started_it(
    autojump_clock, manual_watchdog, monkeypatch
):
    """The caller of the last staged batch leaves before the shutdown (its request,
    dispatched, is abandoned: it might still run). The close finds its worker never
    started that batch: it never ran, and is refunded once, as the staged batch
    whose caller stayed is. It used to stay charged: the close fails only the
    requests still answerable, and nothing told the one abandoned that it never ran."""
    import trioserve._runtime
    import trioserve.actors._batcher

    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", _StagingWorker)
    cfg = trioserve.Config(
        models=(callable_model(
            "m", lambda items: items, execution="process", max_batch_size=1,
            max_wait_ms=0, timeout_ms=None, adaptive_limit=False,
        ),),
        tenants=(TenantConfig(name="a", default=True, credit_rate=1.0, credit_burst=10.0),),
    )
    ended: dict[float, BaseException] = {}
    scope = trio.CancelScope()

    async def caller(rt, value: float) -> None:
        try:
            await rt.infer("m", item(value))
        except ActorClosed as exc:
            ended[value] = exc

    async def leaving(rt) -> None:
        with scope:
            await rt.infer("m", item(3.0))

    async with trio.open_nursery() as nursery:
        async with trioserve.open_runtime(cfg) as rt:
            for value in (1.0, 2.0):
                nursery.start_soon(caller, rt, value)
                await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(leaving, rt)
            await trio.testing.wait_all_tasks_blocked()
            staged = rt.models["m"].batchers[0]._in_flight
            assert [len(b) for b in staged] == [1, 1, 1]
            (last,) = list(staged)[-1]
            scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert last.reply.state is RequestState.ABANDONED
            assert _credits(rt) == (3, 0)  # it may still run: kept
    assert sorted(ended) == [1.0, 2.0]
    assert [ended[v].in_queue for v in (1.0, 2.0)] == [False, True]
    assert _credits(rt) == (1, 2)  # the two staged given back, the abandoned one too


class _TooLargeWorker(_StandIn):
    """A worker process in trio time whose pipe cannot carry any batch: each one sent
    is refused, not sent (FrameTooLarge), once ``sending`` is set."""

    TooLarge = WorkerProcess.TooLarge
    sending: trio.Event

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        self.pid = None
        self.busy_seconds = self.last_run_seconds = 0.0
        self.in_flight = 0
        self._exited = trio.Event()

    async def submit(self, items) -> None:
        await self.sending.wait()
        raise self.TooLarge("its inputs are more bytes than a message carries")

    async def result(self):
        await self._exited.wait()
        raise self.Died("killed")


async def test_a_request_whose_caller_left_before_its_batch_was_refused_by_the_pipe_is_refunded(
    autojump_clock, manual_watchdog, monkeypatch
):
    """Its caller leaves once the request is dispatched (a pull yields before the
    batcher sends the batch): abandoned, it might still run. The batch is too large
    for the worker's pipe and is never sent: the request never ran, and is refunded.
    It used to stay charged: the halves to run again, or the answers, leave out a
    request whose caller left, and nothing told it that it never ran."""
    import trioserve._runtime
    import trioserve.actors._batcher

    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", _TooLargeWorker)
    monkeypatch.setattr(_TooLargeWorker, "sending", trio.Event(), raising=False)
    cfg = trioserve.Config(
        models=(callable_model(
            "m", lambda items: items, execution="process", max_batch_size=1,
            max_wait_ms=0, timeout_ms=None, adaptive_limit=False,
        ),),
        tenants=(TenantConfig(name="a", default=True, credit_rate=1.0, credit_burst=10.0),),
    )
    scope = trio.CancelScope()

    async def leaving(rt) -> None:
        with scope:
            await rt.infer("m", item(1.0))

    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        nursery.start_soon(leaving, rt)
        await trio.testing.wait_all_tasks_blocked()
        ((request,),) = rt.models["m"].batchers[0]._in_flight
        scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert request.reply.state is RequestState.ABANDONED
        assert _credits(rt) == (1, 0)  # it may still run: kept
        _TooLargeWorker.sending.set()
        await trio.testing.wait_all_tasks_blocked()
        assert _credits(rt) == (0, 1)  # never sent: given back, once


class _TooLargeAfterDeath(_StandIn):
    """Worker stand-ins in trio time: with ``die_first``, the first one made dies
    running its first batch (its result never comes); every later one's pipe cannot
    carry any batch: each one sent is refused, not sent (FrameTooLarge)."""

    TooLarge = WorkerProcess.TooLarge
    made: list[_TooLargeAfterDeath] = []
    die_first = False

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        self.pid = len(_TooLargeAfterDeath.made)
        self.busy_seconds = self.last_run_seconds = 0.0
        self.in_flight = 0
        self._exited = trio.Event()
        self.dies = self.die_first and not _TooLargeAfterDeath.made
        _TooLargeAfterDeath.made.append(self)

    async def submit(self, items) -> None:
        await trio.lowlevel.checkpoint()
        if not self.dies:
            raise self.TooLarge("its batch's inputs are more bytes than a message carries")

    async def result(self):
        await trio.lowlevel.checkpoint()
        raise self.Died("pipe broke")  # it died running the batch


@pytest.mark.parametrize("fresh", [True, False])
async def test_a_request_whose_inputs_its_workers_pipe_cannot_carry_is_the_callers_error(
    autojump_clock, manual_watchdog, monkeypatch, fresh
):
    """A request alone whose inputs are more than one message to its worker carries
    is refused before it is sent: the caller's InvalidInput (a 400 over HTTP, not the
    model's 500), never run (``in_queue``), so not charged; the worker is not blamed
    (not lost, its breaker not told, no model error counted). It used to be a
    ModelError ("failed on cpu"), charged, and counted as the model's error. A
    request that reached a device before (here: the retry of a batch whose worker
    died running it) stays charged."""
    import trioserve._runtime
    import trioserve.actors._batcher

    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", _TooLargeAfterDeath)
    monkeypatch.setattr(_TooLargeAfterDeath, "made", [])
    monkeypatch.setattr(_TooLargeAfterDeath, "die_first", not fresh)
    cfg = trioserve.Config(
        models=(callable_model(
            "m", lambda items: items, execution="process", max_batch_size=1,
            max_wait_ms=0, timeout_ms=None, adaptive_limit=False,
        ),),
        tenants=(TenantConfig(name="a", default=True, credit_rate=1.0, credit_burst=10.0),),
    )
    async with trioserve.open_runtime(cfg) as rt:
        batcher = rt.models["m"].batchers[0]
        with pytest.raises(InvalidInput) as caught:
            await rt.infer("m", item(1.0))
        assert batcher.workers_lost == (0 if fresh else 1)
        assert batcher._breaker.failures == (0 if fresh else 1)
        assert rt.statistics()["m"]["statuses"].get("model_error", 0) == 0
    assert str(caught.value) == (
        "model 'm': its batch's inputs are more bytes than a message carries; send a "
        'smaller request, or use execution = "thread"'
    )
    assert caught.value.in_queue is fresh
    assert _credits(rt) == ((0, 1) if fresh else (1, 0))


# ---------------------------------------------------------------- a hedged caller
class _Copies:
    """The hedging side of a scheduler, as ``Runtime._hedged`` uses it: every copy
    is queued, and kept here for the test to answer."""

    def __init__(self) -> None:
        self.copies: list[Request] = []

    def submit_copy_nowait(self, original: Request, copy: Request) -> bool:
        self.copies.append(copy)
        return True

    def forget_copy(self, original: Request, copy: Request) -> None:
        pass


def _unrun_error() -> DeadlineExceeded:
    return DeadlineExceeded("deadline passed while it waited for a replica", in_queue=True)


async def test_a_hedged_original_answered_unrun_before_its_wait_began_is_refunded(
    autojump_clock,
):
    """The original was answered "never ran" (pushed out) between the hedged
    caller's start and its wait's first step, and the caller was cancelled at that
    moment: its wait found the answer held, and was cancelled at its checkpoint
    before taking it. Nothing said the original never ran: the credits were lost."""
    request = Request(model="m", item=None)
    assert request.reply.set_error(Overloaded("model 'm': pushed out of a full queue"))
    refunds: list[int] = []
    with trio.CancelScope() as scope:
        scope.cancel("the caller left")
        await _Hedging._hedged(
            types.SimpleNamespace(hedges=0), _Copies(), request, 0.1,
            lambda: refunds.append(1),
        )
    assert scope.cancelled_caught
    assert refunds == [1]


@pytest.mark.parametrize(
    ("original", "copy", "refunded"),
    [
        ("queued", "answered unrun, then cancelled", 1),
        ("queued", "cancelled, then answered unrun", 1),
        ("queued", "cancelled, then dropped unrun", 1),
        ("queued", "cancelled, then ran", 0),
        ("dispatched", "cancelled, then answered unrun", 0),  # the original may still run
    ],
)
async def test_a_hedged_caller_is_refunded_once_when_neither_copy_ran(
    autojump_clock, original, copy, refunded
):
    """The caller leaves in the same step as its copy, dispatched, is answered or
    dropped. Refunded exactly when neither ran, once, whichever came first; a copy
    abandoned while dispatched that turns out never to run used to keep the
    credits."""
    request = Request(model="m", item=None)
    copies = _Copies()
    refunds: list[int] = []
    scope = trio.CancelScope()

    async def caller() -> None:
        with scope:
            await _Hedging._hedged(
                types.SimpleNamespace(hedges=0), copies, request, 0.1,
                lambda: refunds.append(1),
            )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(caller)
        await trio.sleep(0.2)
        await trio.testing.wait_all_tasks_blocked()
        (twin,) = copies.copies
        assert twin.reply.dispatch()
        if original == "dispatched":
            assert request.reply.dispatch()
        if copy == "answered unrun, then cancelled":
            twin.reply.set_error(_unrun_error())
            scope.cancel("the caller left")
        else:
            scope.cancel("the caller left")
            if copy == "cancelled, then answered unrun":
                twin.reply.set_error(_unrun_error())
            elif copy == "cancelled, then dropped unrun":
                await trio.testing.wait_all_tasks_blocked()
                assert refunds == []  # the copy may still run
                twin.reply.unrun()
            else:
                twin.reply.set_result({"y": 1})
    assert scope.cancelled_caught
    if refunded:
        twin.reply.unrun()  # dropped once more (say, at shutdown): no second refund
    assert refunds == [1] * refunded
    if original == "dispatched":
        assert request.reply.state is RequestState.ABANDONED
        request.reply.set_error(_unrun_error())  # neither ran, after all
        request.reply.unrun()
        assert refunds == [1]


# ---------------------------------------------------------------- a request that ran
def _process_config(**cfg) -> trioserve.Config:
    """Tenant a with 10 credits (1/s) and a one-replica worker-process model."""
    return trioserve.Config(
        models=(callable_model(
            "m", lambda items: items, execution="process", adaptive_limit=False, **cfg
        ),),
        tenants=(TenantConfig(name="a", default=True, credit_rate=1.0, credit_burst=10.0),),
    )


class _BigOutputsWorker(_StandIn):
    """A worker process in trio time whose first batch's outputs are too large for its
    pipe (it ran; FrameTooLarge, as the worker answers it). Every later batch is
    echoed, its sending held until ``resume`` is set."""

    TooLarge = WorkerProcess.TooLarge
    resume: trio.Event

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        self.pid = None
        self.busy_seconds = self.last_run_seconds = 0.0
        self._exited = trio.Event()
        self._sent: list[list] = []
        self._results = 0

    async def submit(self, items) -> None:
        if self._sent:
            await self.resume.wait()
        else:
            await trio.lowlevel.checkpoint()
        self._sent.append(items)

    async def result(self):
        await trio.lowlevel.checkpoint()
        self._results += 1
        if self._results == 1:
            raise self.TooLarge("its batch's outputs are more bytes than a message carries")
        return [{"y": it["x"]} for it in self._sent[self._results - 1]]


@pytest.mark.parametrize("end", ["caller left", "deadline passed"])
async def test_a_half_of_a_batch_whose_outputs_were_too_large_is_charged_while_it_waits(
    autojump_clock, manual_watchdog, monkeypatch, end
):
    """A batch whose outputs were too large for its worker's pipe ran: its halves run
    again. One waits for its run while the other is sent; its caller leaves, or its
    deadline passes. It ran: its caller stays charged. It used to be refunded (or
    answered "never ran"): nothing said its batch had run, the halves looking like a
    batch staged behind a lost worker's."""
    import trioserve._runtime
    import trioserve.actors._batcher

    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", _BigOutputsWorker)
    monkeypatch.setattr(_BigOutputsWorker, "resume", trio.Event(), raising=False)
    # the batch closes at its two requests (never at its wait)
    cfg = _process_config(max_batch_size=2, max_wait_ms=10_000, timeout_ms=1_000)
    scope = trio.CancelScope()
    ended: dict[float, object] = {}

    async def caller(rt, value: float, scope: trio.CancelScope) -> None:
        with scope:
            try:
                ended[value] = await rt.infer("m", item(value))
            except DeadlineExceeded as exc:
                ended[value] = exc

    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        nursery.start_soon(caller, rt, 1.0, trio.CancelScope())
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(caller, rt, 2.0, scope)
        await trio.testing.wait_all_tasks_blocked()
        batcher = rt.models["m"].batchers[0]
        # the halves: the first being sent, the second held for its run
        ((first,),) = batcher._in_flight
        (second,) = rt.models["m"].scheduler._retries[0]
        assert (first.item["x"][0], second.item["x"][0]) == (1.0, 2.0)
        assert second.reply.ran
        assert not second.reply.suspect  # no fault of its input
        if end == "caller left":
            scope.cancel("the caller left")
            await trio.testing.wait_all_tasks_blocked()
            assert second.reply.state is RequestState.ABANDONED
        else:
            await trio.sleep(1.5)  # trio time: past its deadline, still held
        _BigOutputsWorker.resume.set()
        await trio.testing.wait_all_tasks_blocked()
        if end == "deadline passed":
            assert isinstance(ended[2.0], DeadlineExceeded)
            assert not ended[2.0].in_queue  # it ran
        assert rt.models["m"].scheduler.queue_depth() == 0
        assert _credits(rt) == (2, 0)  # both ran: neither refunded
    assert _credits(rt) == (2, 0)


class _DyingWorker(_StandIn):
    """A worker process in trio time that answers no batch: the test makes it die
    (``die``), having written ``unread``, the results of its first batches, which
    nothing read (its reader waits until the runtime kills it)."""

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        self.pid = None
        self.busy_seconds = self.last_run_seconds = 0.0
        self._exited = trio.Event()  # killed by the runtime
        self._gone = trio.Event()  # exited on its own
        self._killed = False

    @property
    def alive(self) -> bool:
        return not self._killed

    def kill(self) -> None:
        self._killed = True
        self._exited.set()

    def die(self, unread: tuple) -> None:
        self.unread = unread
        self._gone.set()

    async def wait_exited(self) -> None:
        await self._gone.wait()

    async def submit(self, items) -> None:
        await trio.lowlevel.checkpoint()

    async def result(self):
        await self._exited.wait()
        raise self.Died("killed")


@pytest.mark.parametrize("crashed", ["its caller stays", "its caller left"])
async def test_a_worker_found_dead_before_its_results_were_read_crashed_on_the_batch_after_them(
    autojump_clock, manual_watchdog, monkeypatch, crashed
):
    """Its worker finished batch a (its result written, not read yet), died running
    b, and never started c; the watch on its exit finds the death first. b is the
    suspect (split, an attempt counted: a crashing input is recognised on the next
    worker), and charged when its caller left; a ran too (answered the result its
    worker wrote, charged); c never ran (its caller, gone, is refunded). b used to
    be handed back as never started (refunded, no attempt counted) and a made the
    suspect."""
    import trioserve._runtime
    import trioserve.actors._batcher

    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", _DyingWorker)
    cfg = _process_config(max_batch_size=1, max_wait_ms=0, timeout_ms=None)
    scopes = {v: trio.CancelScope() for v in (1.0, 2.0, 3.0)}
    answers: dict[float, list[float]] = {}

    async def caller(rt, value: float) -> None:
        with scopes[value]:
            answers[value] = (await rt.infer("m", item(value)))["y"].tolist()

    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        for value in (1.0, 2.0, 3.0):
            nursery.start_soon(caller, rt, value)
            await trio.testing.wait_all_tasks_blocked()
        batcher = rt.models["m"].batchers[0]
        worker = batcher._worker
        ((a,), (b,), (c,)) = batcher._in_flight
        scopes[3.0].cancel("the caller left")
        if crashed == "its caller left":
            scopes[2.0].cancel("the caller left")
        await trio.testing.wait_all_tasks_blocked()
        assert _credits(rt) == (3, 0)  # dispatched: each may still run
        worker.die(unread=(([{"y": np.array([1.0], dtype=np.float32)}], 0.0),))
        await trio.testing.wait_all_tasks_blocked()
        assert batcher.workers_lost == 1
        assert batcher._worker is not worker  # its successor runs what came back
        assert answers == {1.0: [1.0]}  # a: what its worker wrote
        assert not a.reply.suspect  # it did not fail
        if crashed == "its caller stays":
            assert b.reply.ran
            assert b.reply.suspect
            assert b.reply.attempts == 1  # run alone: one of its poison attempts
        assert not c.reply.ran
        assert _credits(rt) == (2, 1)  # c alone refunded: a and b ran
        nursery.cancel_scope.cancel("the test is over")


class _ReplacedWorker(_StandIn):
    """A worker process in trio time that answers its first batch once ``finish`` is
    set (echoing it), and runs each later one until the runtime kills it."""

    finish: trio.Event

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        self.pid = None
        self.busy_seconds = self.last_run_seconds = 0.0
        self._exited = trio.Event()
        self._sent: list[list] = []
        self._results = 0

    async def submit(self, items) -> None:
        await trio.lowlevel.checkpoint()
        self._sent.append(items)

    async def result(self):
        self._results += 1
        if self._results == 1:
            await self.finish.wait()
            return [{"y": it["x"]} for it in self._sent[0]]
        await self._exited.wait()
        raise self.Died("killed")


async def test_the_batch_a_replaced_worker_was_running_is_charged(
    autojump_clock, manual_watchdog, monkeypatch
):
    """The worker's breaker opened on another replica's evidence: it is replaced as
    its first batch is answered, running the second, the third staged behind. Both
    go back as they were (no suspects); the callers of both left. The second reached
    the model: its caller is charged; the third never started: refunded. Both used
    to be refunded (they "ran into nothing of their own")."""
    import trioserve._runtime
    import trioserve.actors._batcher

    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", _ReplacedWorker)
    monkeypatch.setattr(_ReplacedWorker, "finish", trio.Event(), raising=False)
    cfg = _process_config(max_batch_size=1, max_wait_ms=0, timeout_ms=None)
    scopes = {v: trio.CancelScope() for v in (1.0, 2.0, 3.0)}

    async def caller(rt, value: float) -> None:
        with scopes[value]:
            await rt.infer("m", item(value))

    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        for value in (1.0, 2.0, 3.0):
            nursery.start_soon(caller, rt, value)
            await trio.testing.wait_all_tasks_blocked()
        batcher = rt.models["m"].batchers[0]
        worker = batcher._worker
        ((_,), (running,), (staged,)) = batcher._in_flight
        scopes[2.0].cancel("the caller left")
        scopes[3.0].cancel("the caller left")
        await trio.testing.wait_all_tasks_blocked()
        assert _credits(rt) == (3, 0)  # dispatched: each may still run
        batcher._replace_due = True  # (as another replica's evidence sets it)
        _ReplacedWorker.finish.set()
        await trio.testing.wait_all_tasks_blocked()
        assert batcher.workers_broken == 1
        assert batcher._worker is not worker
        assert running.reply.ran
        assert not running.reply.suspect  # it did not fail
        assert not staged.reply.ran
        assert _credits(rt) == (2, 1)  # the first answered, the second charged
    assert _credits(rt) == (2, 1)
