"""A model's (or a class's) ``timeout_ms`` ends the wait of a request whose batch is
running: the replica holding the batch answers it DeadlineExceeded at its deadline,
in wall-clock time (the watchdog's), and the batch goes on for the others; its late
answer, and the retries of a batch cut off or of a lost worker, skip it.

The logic is trio-side, tested under MockClock with a watchdog whose wall clock the
test moves (:class:`ManualWatchdog`); the wall-clock watchdog itself, a thread model,
a worker process and HTTP are tested on the real clock, with a 200 ms timeout against
a batch cut-off of seconds.
"""

from __future__ import annotations

import collections
import gc
import threading
import time
import weakref

import numpy as np
import pytest
import trio
import trio.testing
import trioserve
from http_helpers import Gate, held_model, serving
from runtime_helpers import (
    GATE_FILE_ENV,
    GATE_LIMIT_S,
    ManualWatchdog,
    NoZygote,
    _StandIn,
    callable_model,
    held_until_file,
    item,
    key,
    pythonpath_with,
)
from trioserve import DeadlineExceeded, Reply, Request, RequestState
from trioserve.actors import LateOutcome, Watchdog
from trioserve.actors._in_flight import InFlight
from trioserve.transport import open_http

RUNNING = "deadline passed while its batch was running"
TESTS = __file__.rsplit("/", 1)[0]


def classes_config(*models, realtime_ms: float = 200.0) -> trioserve.Config:
    """``models`` served to one open tenant, whose ``realtime`` class (its default)
    has a timeout of ``realtime_ms``; ``batch`` takes the model's."""
    return trioserve.Config(
        models=models,
        classes=(
            trioserve.ClassConfig(name="realtime", timeout_ms=realtime_ms),
            trioserve.ClassConfig(name="batch"),
        ),
        tenants=(trioserve.TenantConfig(name="t", default=True),),
    )


def thread_model(fn, **cfg):
    """A thread model whose batches close at two requests, with a 5 s timeout and a
    batch cut-off of 3 s."""
    cfg.setdefault("replicas", 1)
    return callable_model(
        "m", fn, execution="thread", max_batch_size=2, max_wait_ms=10_000,
        timeout_ms=5_000.0, batch_timeout_floor_ms=3_000.0, batch_timeout_cap_ms=3_000.0,
        **cfg,
    )


class HeldOnOne:
    """A model echoing ``x``; a batch holding 1 waits for :meth:`release` (a
    thread's call). Records the keys of each batch, in the order the calls began
    (a thread may begin after a later batch's)."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.batches: list[list[float]] = []
        self._lock = threading.Lock()

    def __call__(self, items):
        keys = [key(it) for it in items]
        with self._lock:
            self.batches.append(keys)
        if 1.0 in keys:
            self.released.wait(GATE_LIMIT_S)
        return [{"y": it["x"].copy()} for it in items]

    def release(self) -> None:
        self.released.set()


async def two_callers(rt, got: dict, nursery) -> dict[float, trio.Event]:
    """Start a realtime request of 1 (200 ms) and a batch one of 2 (the model's 5 s),
    which close one batch; what each gets goes into ``got`` with the time. Returns
    an event for each, set when it is answered."""
    answered = {1.0: trio.Event(), 2.0: trio.Event()}

    async def one(v: float, cls: str) -> None:
        try:
            out: object = await rt.infer("m", item(v), priority=cls)
        except DeadlineExceeded as exc:
            out = exc
        got[v] = (out, trio.current_time())
        answered[v].set()

    nursery.start_soon(one, 1.0, "realtime")
    nursery.start_soon(one, 2.0, "batch")
    return answered


def flow(rt, cls: str) -> dict:
    return rt.statistics()["m"]["flows"][f"t/{cls}"]


# ---------------------------------------------------------------- the watchdog
async def test_the_watchdog_calls_back_after_wall_time_and_not_when_disarmed():
    dog = Watchdog()
    dog.start()
    try:
        called = trio.Event()
        quiet: list[str] = []
        t0 = time.monotonic()
        dog.arm_call(0.05, called.set)
        Watchdog.disarm(dog.arm_call(0.01, lambda: quiet.append("fired")))
        with trio.fail_after(5):
            await called.wait()
        assert time.monotonic() - t0 >= 0.05
        assert quiet == []
        assert dog.fired == 1
    finally:
        dog.stop()


def test_disarmed_deadlines_do_not_pile_up_in_the_watchdog():
    # A batch's deadline of 60 s disarmed when the batch ends within a millisecond
    # stayed in the heap for its minute: tens of thousands at a thousand batches a
    # second. The heap is compacted once it holds twice the live ones.
    dog = Watchdog(clock=lambda: 0.0)  # never started: nothing fires
    kept = [dog.arm_call(60.0, lambda: None) for _ in range(10)]
    for _ in range(10_000):
        Watchdog.disarm(dog.arm_call(60.0, lambda: None))
    assert len(dog._heap) <= 2 * len(kept) + Watchdog.SLACK + 1
    assert sum(e.live for _, _, e in dog._heap) == 10
    Watchdog.disarm(kept[0])
    Watchdog.disarm(kept[0])  # twice: counted once
    assert dog._live == 9


# ---------------------------------------------------------------- InFlight, alone
def dispatched(deadlines: list[float], *, answer_expiry: bool = True) -> list[Request]:
    reqs = [
        Request(model="m", item=i, arrival=0.0, deadline=d, answer_expiry=answer_expiry,
                reply=Reply())
        for i, d in enumerate(deadlines)
    ]
    for r in reqs:
        r.reply.dispatch()
    return reqs


def states(batch: list[Request]) -> list[RequestState]:
    return [r.reply.state for r in batch]


async def test_due_requests_are_answered_and_the_next_deadline_armed(autojump_clock):
    dog = ManualWatchdog()
    noted: list[list[int]] = []
    held = InFlight(model="m", watchdog=dog, noted=lambda rs: noted.append([r.item for r in rs]))
    batch = dispatched([0.5, 0.2, 0.2, 9.0])
    batch.append(dispatched([0.1], answer_expiry=False)[0])  # the caller's own deadline
    held.append(batch)
    D = RequestState.DISPATCHED
    dog.advance(0.1)  # the caller's deadline: its own cancel scope answers it
    assert states(batch) == [D] * 5
    dog.advance(0.1)
    assert noted == [[1, 2]]
    assert states(batch) == [D, RequestState.DONE, RequestState.DONE, D, D]
    limit = rf"{RUNNING} \(limit 0.200s: the model's or its class's timeout_ms\)"
    with pytest.raises(DeadlineExceeded, match=limit) as info:
        await batch[1].reply.wait()
    assert not info.value.in_queue  # it was dispatched: charged
    dog.advance(0.3)
    assert noted == [[1, 2], [0]]
    assert held[0] is batch  # the batch is still in flight
    assert len(held) == 1
    assert held.popleft() is batch
    assert dog._live == 0  # disarmed as it left (9.0 was armed)
    dog.advance(60)
    assert states(batch)[3] is D


async def test_a_callback_that_comes_in_after_its_batch_left_does_nothing(autojump_clock):
    dog = ManualWatchdog()
    held = InFlight(model="m", watchdog=dog)
    batch = dispatched([0.2, 0.3])
    held.append(batch)
    (_, _, entry), = dog._heap
    held.clear()  # the batch ended as the watchdog fired (the disarm raced it)
    dog.wall = 1.0
    entry.fn()
    assert states(batch) == [RequestState.DISPATCHED] * 2
    assert dog._live == 0


async def test_an_answered_or_abandoned_request_is_left_alone_and_nothing_armed_without_a_deadline(
    autojump_clock,
):
    dog = ManualWatchdog()
    held = InFlight(model="m", watchdog=dog)
    held.append(dispatched([float("inf")]))
    held.append(dispatched([0.2], answer_expiry=False))
    assert dog._heap == []
    batch = dispatched([0.2, 0.2])
    batch[0].reply.set_result("answered")
    batch[1].reply.withdraw()
    held.append(batch)
    assert dog._heap == []  # nothing of it still waits
    inline = InFlight(model="m", watchdog=None)
    inline.append(dispatched([0.2]))
    assert list(inline) == [inline[0]]


async def test_a_late_hook_keeps_nothing_of_its_batch_once_it_left(autojump_clock):
    """A request answered at its deadline while its batch runs, with a late hook (a
    coalesced flight's others wait for its batch): once the batch left, the hook,
    which its request's reply holds, holds nothing of the batch. It held the batch's
    clock, and through it the batch: a reference cycle (reply, hook, batch, request)
    that kept every request of the batch, and their items and results, until the
    garbage collector's next full pass."""
    dog = ManualWatchdog()
    held = InFlight(model="m", watchdog=dog)
    # (its mate has no deadline the runtime answers: nothing else is armed for it)
    batch = dispatched([0.2]) + dispatched([9.0], answer_expiry=False)
    hook = batch[0].reply.late = LateOutcome()
    held.append(batch)
    gc.disable()  # what is freed is freed by its count of references alone
    try:
        dog.advance(0.2)
        assert hook.expected
        assert hook.call_at is not None  # its waiters' clock
        mate = weakref.ref(batch[1])
        assert held.popleft() is batch
        assert hook.result is None  # settled: no outcome came
        assert hook.call_at is None
        del batch, hook
        assert mate() is None
    finally:
        gc.enable()


async def test_a_batch_that_left_is_not_kept_by_its_disarmed_deadline(autojump_clock):
    """A batch leaves before its first deadline: that deadline's callback is
    disarmed, but stays in the watchdog's heap until its time (or the heap's next
    compaction), up to a model's timeout later. It keeps nothing of the batch: its
    requests (their items and answers) are freed by their count of references as
    soon as the batch left."""
    dog = ManualWatchdog()
    held = InFlight(model="m", watchdog=dog)
    batch = dispatched([60.0, 60.0])
    held.append(batch)
    gc.disable()  # what is freed is freed by its count of references alone
    try:
        first = weakref.ref(batch[0])
        assert held.popleft() is batch
        del batch
        assert first() is None
    finally:
        gc.enable()


# ---------------------------------------------------------------- a thread model
async def test_a_request_in_a_hung_thread_batch_is_answered_at_its_timeout_its_mate_later():
    """Real clock: the watchdog keeps wall time. The batch holding a 200 ms request
    and a 5 s one hangs in its thread; its cut-off is 3 s. The first caller used to
    wait for the cut-off (and then its retry); it gets DeadlineExceeded at 200 ms,
    while the thread still hangs, and the second gets its result when the thread
    returns."""
    model = HeldOnOne()
    got: dict[float, tuple[object, float]] = {}
    try:
        async with trioserve.open_runtime(classes_config(thread_model(model))) as rt:
            t0 = trio.current_time()
            with trio.fail_after(GATE_LIMIT_S):
                async with trio.open_nursery() as nursery:
                    answered = await two_callers(rt, got, nursery)
                    await answered[1.0].wait()
                    assert 2.0 not in got
                    assert not model.released.is_set()
                    model.release()
            stats = rt.statistics()["m"]
            realtime, batch = flow(rt, "realtime"), flow(rt, "batch")
    finally:
        model.release()
    error, at = got[1.0]
    assert isinstance(error, DeadlineExceeded)
    assert RUNNING in str(error)
    assert not error.in_queue
    assert 0.2 <= at - t0 < 2.0  # well before the cut-off at 3 s
    out, _ = got[2.0]
    assert float(out["y"][0]) == 2.0
    assert model.batches == [[1.0, 2.0]]
    assert stats["statuses"].get("straggler", 0) == 0
    assert (realtime["dispatched"], realtime["expired_running"], realtime["expired"]) == (1, 1, 0)
    assert (batch["dispatched"], batch["expired_running"]) == (1, 0)


async def test_the_late_answer_of_a_batch_skips_the_request_it_answered(
    autojump_clock, manual_watchdog
):
    """A second answer to a request raised inside its reply and crashed the replica:
    the batch's other caller got ActorBroken. The late answer goes to the other one
    alone, and each statistic counts once."""
    model = HeldOnOne()
    got: dict[float, tuple[object, float]] = {}
    try:
        async with trioserve.open_runtime(classes_config(thread_model(model))) as rt:
            dog = manual_watchdog.made[-1]
            batcher = rt.models["m"].batchers[0]
            async with trio.open_nursery() as nursery:
                await two_callers(rt, got, nursery)
                await trio.testing.wait_all_tasks_blocked()
                assert len(batcher._in_flight) == 1
                dog.advance(0.199)
                await trio.testing.wait_all_tasks_blocked()
                assert got == {}
                dog.advance(0.001)
                await trio.testing.wait_all_tasks_blocked()
                assert list(got) == [1.0]
                model.release()
            stats = rt.statistics()["m"]
            realtime = flow(rt, "realtime")
            assert batcher.restarts == 0
            assert rt.model_ready("m")
    finally:
        model.release()
    assert isinstance(got[1.0][0], DeadlineExceeded)
    assert float(got[2.0][0]["y"][0]) == 2.0
    assert model.batches == [[1.0, 2.0]]
    assert (stats["batches"], stats["items"]) == (1, 2)  # the batch ran, whole
    assert dict(stats["statuses"]) == {}
    assert (realtime["dispatched"], realtime["expired_running"]) == (1, 1)
    assert dog._live == 0  # nothing armed once the batch is done


async def test_a_batch_cut_off_retries_only_its_requests_not_answered(
    autojump_clock, manual_watchdog
):
    """The batch hangs; its 200 ms request is answered at its deadline, then the
    batch is cut off at 3 s and handed back: only the other request is retried (on
    another replica, with a third to spare: it may be the one that hangs, see
    test_thread_hang.py), and the one answered never runs again."""
    model = HeldOnOne()
    got: dict[float, tuple[object, float]] = {}
    try:
        cfg = classes_config(thread_model(model, replicas=3))
        async with trioserve.open_runtime(cfg) as rt:
            dog = manual_watchdog.made[-1]
            async with trio.open_nursery() as nursery:
                await two_callers(rt, got, nursery)
                await trio.testing.wait_all_tasks_blocked()
                dog.advance(0.2)
                await trio.testing.wait_all_tasks_blocked()
                assert list(got) == [1.0]
                dog.advance(2.8)  # the cut-off
            stats = rt.statistics()["m"]
            realtime = flow(rt, "realtime")
            model.release()
    finally:
        model.release()
    assert isinstance(got[1.0][0], DeadlineExceeded)
    assert float(got[2.0][0]["y"][0]) == 2.0
    # (the retry's thread may begin before the cut-off batch's)
    assert sorted(model.batches) == [[1.0, 2.0], [2.0]]
    assert stats["statuses"]["straggler"] == 1
    assert stats["statuses"]["retried"] == 1
    assert realtime["expired_running"] == 1


# ---------------------------------------------------------------- a worker process
class HeldWorker(_StandIn):
    """A worker process in trio time: its first batch runs until the test makes the
    worker die (:meth:`die`, as a crash would); the later ones answer at once.
    ``submitted``: the keys of each batch sent to any of them."""

    submitted: list[list[float]]
    made: list[HeldWorker]

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        self.pid = None
        self.busy_seconds = self.last_run_seconds = 0.0
        self._staged: collections.deque = collections.deque()
        self._exited = trio.Event()
        self._killed = False
        HeldWorker.made.append(self)

    @property
    def alive(self) -> bool:
        return not self._killed  # as WorkerProcess: not killed (it may have died)

    def die(self) -> None:
        self._exited.set()

    def kill(self) -> None:
        self._staged.clear()
        self._killed = True
        self._exited.set()

    async def submit(self, items) -> None:
        await trio.lowlevel.checkpoint()
        HeldWorker.submitted.append([key(it) for it in items])
        self._staged.append((items, len(HeldWorker.submitted) == 1))

    async def result(self):
        items, held = self._staged[0]
        if held:
            await self._exited.wait()
        if self._exited.is_set():
            raise self.Died("killed by its batch")
        self._staged.popleft()
        return [{"y": it["x"].copy()} for it in items]


@pytest.fixture
def held_workers(monkeypatch, manual_watchdog):
    import trioserve._runtime
    import trioserve.actors._batcher

    HeldWorker.submitted, HeldWorker.made = [], []
    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", HeldWorker)
    return HeldWorker


def process_model(fn=None, **cfg):
    return callable_model(
        "m", fn if fn is not None else held_until_file, execution="process",
        max_batch_size=2, max_wait_ms=10_000, timeout_ms=5_000.0,
        batch_timeout_floor_ms=3_000.0, batch_timeout_cap_ms=3_000.0, **cfg,
    )


async def test_a_lost_worker_hands_back_only_the_requests_not_answered(
    autojump_clock, held_workers, manual_watchdog
):
    got: dict[float, tuple[object, float]] = {}
    async with trioserve.open_runtime(classes_config(process_model())) as rt:
        dog = manual_watchdog.made[-1]
        batcher = rt.models["m"].batchers[0]
        async with trio.open_nursery() as nursery:
            await two_callers(rt, got, nursery)
            await trio.testing.wait_all_tasks_blocked()
            dog.advance(0.2)
            await trio.testing.wait_all_tasks_blocked()
            assert list(got) == [1.0]
            held_workers.made[0].die()
        stats = rt.statistics()["m"]
        realtime = flow(rt, "realtime")
    assert isinstance(got[1.0][0], DeadlineExceeded)
    assert RUNNING in str(got[1.0][0])
    assert float(got[2.0][0]["y"][0]) == 2.0
    assert held_workers.submitted == [[1.0, 2.0], [2.0]]  # its successor ran 2 alone
    assert batcher.workers_lost == 1
    assert stats["statuses"]["retried"] == 1
    assert realtime["expired_running"] == 1


async def test_a_request_in_a_running_worker_process_batch_is_answered_at_its_timeout(
    monkeypatch, tmp_path
):
    """Real clock and a real worker process, held until a file exists: the 200 ms
    request is answered at its deadline while the worker runs its batch (cut-off
    3 s), the other one when the batch ends."""
    gate = tmp_path / "open"
    monkeypatch.setenv(GATE_FILE_ENV, str(gate))
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(TESTS))
    got: dict[float, tuple[object, float]] = {}
    async with trioserve.open_runtime(classes_config(process_model())) as rt:
        t0 = trio.current_time()
        with trio.fail_after(GATE_LIMIT_S):
            async with trio.open_nursery() as nursery:
                answered = await two_callers(rt, got, nursery)
                await answered[1.0].wait()
                assert 2.0 not in got
                gate.write_text("")
        realtime = flow(rt, "realtime")
        stats = rt.statistics()["m"]
    error, at = got[1.0]
    assert isinstance(error, DeadlineExceeded)
    assert RUNNING in str(error)
    assert not error.in_queue
    assert 0.2 <= at - t0 < 2.0  # well before the cut-off at 3 s
    assert float(got[2.0][0]["y"][0]) == 2.0
    assert stats["statuses"].get("worker_lost", 0) == 0  # the batch ran to its end
    assert (stats["batches"], stats["items"]) == (1, 2)
    assert realtime["expired_running"] == 1


# ---------------------------------------------------------------- coalescing, HTTP
class Counting:
    """A thread model echoing ``x``, held until :meth:`release`; records each key."""

    def __init__(self) -> None:
        self.seen: list[float] = []
        self.released = threading.Event()

    def __call__(self, items):
        self.seen.extend(key(it) for it in items)
        self.released.wait(GATE_LIMIT_S)
        return [{"y": it["x"].copy()} for it in items]

    def release(self) -> None:
        self.released.set()


async def test_callers_joined_to_an_expired_request_get_its_error_and_nothing_is_cached(
    autojump_clock, manual_watchdog
):
    """Callers joined to an identical request in flight, with its deadline, get
    DeadlineExceeded when it passes while the batch runs, each its own: the one
    whose request ran says so; the joined ones say they waited for an identical
    request's computation (in_queue: none of theirs ran). Errors are not cached:
    the next identical request runs."""
    model = Counting()
    cfg = trioserve.Config(
        models=(callable_model(
            "m", model, execution="thread", coalesce=True, max_wait_ms=0,
            timeout_ms=200.0, batch_timeout_floor_ms=3_000.0, batch_timeout_cap_ms=3_000.0,
        ),),
        tenants=(trioserve.TenantConfig(name="t", default=True),),
        cache=trioserve.CacheConfig(capacity_bytes=1 << 20),
    )
    errors: list[BaseException] = []
    try:
        async with trioserve.open_runtime(cfg) as rt:
            dog = manual_watchdog.made[-1]

            async def one() -> None:
                with pytest.raises(DeadlineExceeded) as info:
                    await rt.infer("m", item(5))
                errors.append(info.value)

            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(one)
                await trio.testing.wait_all_tasks_blocked()
                dog.advance(0.2)
            model.release()
            # the batch's thread returns (the clock would jump past the next
            # request's deadline while it is queued behind it)
            await rt.models["m"].scheduler.wait_empty()
            out = await rt.infer("m", item(5))
            cache = rt.cache_statistics()
    finally:
        model.release()
    assert len(errors) == 3
    assert len({id(e) for e in errors}) == 3  # each its own copy
    ran = [e for e in errors if RUNNING in str(e)]
    assert len(ran) == 1
    assert not ran[0].in_queue
    joined = [e for e in errors if e not in ran]
    assert all(
        isinstance(e, DeadlineExceeded) and e.in_queue and str(e) == (
            "model 'm': deadline passed after 0.200s waiting for the computation of an "
            "identical request it joined in flight (limit: the model's or its class's "
            "timeout_ms)"
        )
        for e in joined
    )
    assert float(out["y"][0]) == 5.0
    assert model.seen == [5.0, 5.0]  # once for the three, once after
    assert cache["coalesced"] == 2


async def test_over_http_a_model_timeout_passing_in_a_running_batch_is_504():
    """Real clock: the model's 200 ms timeout passes while the thread holds the
    batch (cut-off 3 s); the client gets 504 at once, not when the batch ends."""
    gate = Gate()
    cfg = trioserve.Config(
        models=(held_model(
            gate, name="held", max_batch_size=1, timeout_ms=200.0,
            batch_timeout_floor_ms=3_000.0, batch_timeout_cap_ms=3_000.0,
        ),),
        tenants=(trioserve.TenantConfig(name="t", default=True),),
        server=trioserve.ServerConfig(stream_ping_interval_s=0),
    )
    try:
        async with serving(cfg) as gw, open_http(gw.url) as http:
            t0 = trio.current_time()
            with trio.fail_after(GATE_LIMIT_S):
                res = await http.infer("held", {"x": np.ones((1, 1), np.float32)})
            elapsed = trio.current_time() - t0
            assert gate.entered == 1
            assert not gate._open.is_set()  # the batch still runs
            gate.release()
            flows = gw.runtime.statistics()["held"]["flows"]
    finally:
        gate.release()
    assert res.status == 504
    assert RUNNING in res.json()["error"]
    assert 0.2 <= elapsed < 2.0
    assert flows["t/realtime"]["expired_running"] == 1
