"""A caller that joined an identical request in flight (``coalesce``, or the result
cache) is not failed by the first caller's deadline: the flight runs with the
deadline of the caller it runs for, and when that passes (queued, or while its
batch runs) a joined caller whose own deadline is later gets a run of its own,
under its own deadline, entering the queue at the back; when it passed while its
batch ran, the joined callers first wait for that batch's answer. Each caller gets
one answer, at its own deadline at the latest."""

from __future__ import annotations

import threading

import numpy as np
import outcome
import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import (
    GATE_LIMIT_S,
    Gate,
    NoZygote,
    Recorder,
    SplitsInChunks,
    X,
    Y,
    _StandIn,
    callable_model,
    item,
    key,
)
from trioserve import (
    ActorBroken,
    ActorClosed,
    CacheConfig,
    DeadlineExceeded,
    InvalidInput,
    ModelBackend,
    ModelConfig,
    ModelError,
    QuotaExceeded,
    TenantConfig,
    WorkerProcess,
)
from trioserve._many import _SplitLate
from trioserve.actors import Breaker
from trioserve.actors._singleflight import LateOutcome

RUNNING = "deadline passed while its batch was running"
QUEUED = "in the queue"
JOINED = "waiting for the computation of an identical request it joined in flight"


def coalesced(model, *, capacity: int = 0, **cfg) -> trioserve.Config:
    """``model`` run in a thread (unless ``execution`` says otherwise), one item a
    batch, with a timeout of 1 s and batches cut off after 30 s (unless
    ``batch_timeout_floor_ms`` says otherwise), coalesced (and cached, with a
    capacity), served to one open tenant."""
    cfg.setdefault("replicas", 1)
    cfg.setdefault("max_batch_size", 1)
    cfg.setdefault("max_wait_ms", 0)
    cfg.setdefault("execution", "thread")
    cfg.setdefault("batch_timeout_floor_ms", 30_000.0)
    cfg.setdefault("batch_timeout_cap_ms", cfg["batch_timeout_floor_ms"])
    return trioserve.Config(
        models=(callable_model("m", model, coalesce=True, timeout_ms=1_000.0, **cfg),),
        tenants=(TenantConfig(name="t", default=True),),
        cache=CacheConfig(capacity_bytes=capacity),
    )


class Callers:
    """Callers of ``rt.infer("m", item(value))``, each by name: what each got (its
    output's ``y[0]``, or its error) and when, in ``got``; ``scopes`` to cancel
    them."""

    def __init__(self, rt, nursery) -> None:
        self.rt = rt
        self.nursery = nursery
        self.got: dict[str, tuple[object, float]] = {}
        self.scopes: dict[str, trio.CancelScope] = {}
        self.answered: dict[str, trio.Event] = {}

    async def start(self, name: str, value: float) -> None:
        """Start a caller and wait until it waits."""

        self.answered[name] = trio.Event()

        async def one() -> None:
            with trio.CancelScope() as self.scopes[name]:
                try:
                    out: object = float((await self.rt.infer("m", item(value)))["y"][0])
                except trioserve.TrioserveError as exc:
                    out = exc
                self.got[name] = (out, trio.current_time())
                self.answered[name].set()

        self.nursery.start_soon(one)
        await trio.testing.wait_all_tasks_blocked()


def flow(rt) -> dict:
    return rt.statistics()["m"]["flows"]["t/realtime"]


# ---------------------------------------------------------------- queued
@pytest.mark.parametrize("capacity", [0, 1 << 20])
async def test_a_follower_outlives_the_leaders_deadline_in_the_queue(mock_clock, capacity):
    """The replica is busy; the leader (t=0) and a follower (t=0.5) of one key wait
    in the queue. At 1.0 the leader's deadline passes: it gets DeadlineExceeded,
    and the follower, with 0.5 s left, is queued again under its own deadline and
    gets the model's answer when the replica frees. The model ran the key once."""
    gate = Gate(hold=0.0)
    try:
        async with trioserve.open_runtime(coalesced(gate, capacity=capacity)) as rt:
            async with trio.open_nursery() as nursery:
                callers = Callers(rt, nursery)
                await callers.start("blocker", 0.0)  # holds the replica
                await callers.start("leader", 5.0)
                mock_clock.jump(0.5)
                await callers.start("follower", 5.0)
                mock_clock.jump(0.5)
                await trio.testing.wait_all_tasks_blocked()
                error, at = callers.got["leader"]
                assert isinstance(error, DeadlineExceeded)
                assert error.in_queue
                assert at == 1.0
                assert "follower" not in callers.got
                assert flow(rt)["queued"] == 1  # its own request, queued
                gate.release()
            stats, cache = flow(rt), rt.cache_statistics()
    finally:
        gate.release()
    assert callers.got["follower"] == (11.0, 1.0)
    assert gate.seen == [0.0, 5.0]  # the leader's request never ran
    assert (stats["expired"], stats["dispatched"]) == (1, 2)
    # the blocker's flight and the leader's, which the follower joined
    assert (cache["computations"], cache["coalesced"], cache["reruns"]) == (2, 1, 1)
    assert cache["in_flight"] == 0


async def test_a_follower_whose_own_deadline_passes_too_gets_deadline_exceeded_at_it(
    mock_clock,
):
    """Three callers of one key at 0, 0.25 and 0.5 while the replica is busy: each
    gets DeadlineExceeded at its own deadline, 1.0, 1.25 and 1.5, not at the first
    one's, and not later; the flight ran once for each, the earliest first."""
    gate = Gate(hold=0.0)
    try:
        async with trioserve.open_runtime(coalesced(gate)) as rt:
            async with trio.open_nursery() as nursery:
                callers = Callers(rt, nursery)
                await callers.start("blocker", 0.0)
                await callers.start("first", 5.0)
                for name in ("second", "third"):
                    mock_clock.jump(0.25)
                    await callers.start(name, 5.0)
                mock_clock.jump(0.5)  # 1.0
                await trio.testing.wait_all_tasks_blocked()
                assert list(callers.got) == ["first"]
                assert flow(rt)["queued"] == 1  # second's own run
                for _ in range(2):  # 1.25, 1.5
                    mock_clock.jump(0.25)
                    await trio.testing.wait_all_tasks_blocked()
                gate.release()
            stats, cache = flow(rt), rt.cache_statistics()
    finally:
        gate.release()
    for name, deadline in [("first", 1.0), ("second", 1.25), ("third", 1.5)]:
        error, at = callers.got[name]
        assert isinstance(error, DeadlineExceeded), name
        assert QUEUED in str(error)
        assert error.in_queue
        assert at == deadline, name
    assert gate.seen == [0.0]
    assert stats["expired"] == 3
    assert (cache["computations"], cache["coalesced"], cache["reruns"]) == (2, 2, 2)


async def test_a_follower_with_the_leaders_deadline_is_told_of_its_own_wait(mock_clock):
    """A follower that joined at the leader's instant has its deadline: the round the
    leader drove answers it when that deadline passes in the queue, in its own terms
    (it waited for an identical request's computation; it was never queued), not
    with the leader's "in the queue". Both are DeadlineExceeded, in_queue."""
    gate = Gate(hold=0.0)
    try:
        async with trioserve.open_runtime(coalesced(gate)) as rt:
            async with trio.open_nursery() as nursery:
                callers = Callers(rt, nursery)
                await callers.start("blocker", 0.0)
                mock_clock.jump(0.5)
                await callers.start("leader", 5.0)
                await callers.start("follower", 5.0)
                mock_clock.jump(1.0)
                await trio.testing.wait_all_tasks_blocked()
                gate.release()
            cache = rt.cache_statistics()
    finally:
        gate.release()
    leader, at = callers.got["leader"]
    assert isinstance(leader, DeadlineExceeded)
    assert str(leader) == "model 'm': deadline passed after 1.000s in the queue"
    assert at == 1.5
    follower, at = callers.got["follower"]
    assert isinstance(follower, DeadlineExceeded)
    assert str(follower) == (
        f"model 'm': deadline passed after 1.000s {JOINED} (limit: the model's or its "
        "class's timeout_ms)"
    )
    assert follower.in_queue
    assert at == 1.5
    assert gate.seen == [0.0]
    assert (cache["computations"], cache["coalesced"], cache["reruns"]) == (2, 1, 0)


async def test_a_follower_cancelled_during_its_run_withdraws_it(mock_clock):
    """The follower's own run is queued after the leader's deadline; the follower
    leaves: nobody waits any more, so the run is withdrawn from the queue and never
    runs, and the flight is gone."""
    gate = Gate(hold=0.0)
    try:
        async with trioserve.open_runtime(coalesced(gate)) as rt:
            async with trio.open_nursery() as nursery:
                callers = Callers(rt, nursery)
                await callers.start("blocker", 0.0)
                await callers.start("leader", 5.0)
                mock_clock.jump(0.5)
                await callers.start("follower", 5.0)
                mock_clock.jump(0.5)
                await trio.testing.wait_all_tasks_blocked()
                assert flow(rt)["queued"] == 1
                callers.scopes["follower"].cancel()
                await trio.testing.wait_all_tasks_blocked()
                assert flow(rt)["queued"] == 0
                gate.release()
            stats, cache = flow(rt), rt.cache_statistics()
    finally:
        gate.release()
    assert isinstance(callers.got["leader"][0], DeadlineExceeded)
    assert "follower" not in callers.got  # it left: its own cancel scope
    assert callers.got["blocker"][0] == 1.0
    assert gate.seen == [0.0]
    assert (stats["expired"], stats["withdrawn"]) == (1, 1)
    assert (cache["reruns"], cache["in_flight"]) == (1, 0)


# ---------------------------------------------------------------- running
class HeldOnce:
    """A model answering ``y = 2x + 1`` whose first batch waits for :meth:`release`
    (a thread's call), then raises if ``fail``; any batch holding the key
    ``poison`` raises. The keys of every batch in ``seen`` (one entry per item the
    model was called with)."""

    def __init__(self, *, fail: bool = False, poison: float | None = None) -> None:
        self.released = threading.Event()
        #: set once the first batch is in the model (its thread may start late)
        self.entered = threading.Event()
        self.fail = fail
        self.poison = poison
        self.seen: list[float] = []
        self._lock = threading.Lock()

    def __call__(self, items):
        keys = [key(it) for it in items]
        with self._lock:
            first = not self.seen
            self.seen.extend(keys)
        if first:
            self.entered.set()
            self.released.wait(GATE_LIMIT_S)
            if self.fail:
                raise RuntimeError("the first batch failed")
        if self.poison in keys:
            raise RuntimeError("a poison input")
        return [{"y": it["x"] * 2 + 1} for it in items]

    def release(self) -> None:
        self.released.set()


async def _leader_expires_running(rt, callers, mock_clock, dog, *followers: str) -> None:
    """The leader's batch runs (held); each of ``followers`` joins 0.25 s after the
    one before; the leader's deadline (1 s, on the replica's clock) passes while its
    batch still runs: it is answered at once."""
    await callers.start("leader", 5.0)
    for name in followers:
        mock_clock.jump(0.25)
        await callers.start(name, 5.0)
    dog.advance(1.0)  # the leader's 1 s
    await trio.testing.wait_all_tasks_blocked()
    error, _ = callers.got["leader"]
    assert isinstance(error, DeadlineExceeded)
    assert RUNNING in str(error)
    assert not error.in_queue
    assert list(callers.got) == ["leader"]


@pytest.mark.parametrize("capacity", [0, 1 << 20])
async def test_a_follower_gets_the_batch_still_running_for_a_leader_whose_deadline_passed(
    mock_clock, manual_watchdog, capacity
):
    """The leader's batch hangs in its thread; a follower joins 0.25 s later. The
    leader's deadline passes while its batch runs: the leader gets DeadlineExceeded
    at once, and the follower, with time left, waits for that batch instead of
    running the key again (the other replica stays idle); so does a caller that
    joins meanwhile. When the batch ends its answer is theirs, and kept in the cache
    as any answer. The model ran the key once, and the tenant paid once."""
    model = HeldOnce()
    try:
        async with trioserve.open_runtime(
            coalesced(model, replicas=2, capacity=capacity)
        ) as rt:
            dog = manual_watchdog.made[-1]
            async with trio.open_nursery() as nursery:
                callers = Callers(rt, nursery)
                await _leader_expires_running(rt, callers, mock_clock, dog, "follower")
                assert flow(rt)["dispatched"] == 1  # nothing ran again
                assert rt.cache_statistics()["in_flight"] == 1
                await callers.start("latecomer", 5.0)  # joins the wait
                model.release()
                await callers.answered["latecomer"].wait()
            if capacity:
                assert float((await rt.infer("m", item(5.0)))["y"][0]) == 11.0  # a hit
            stats, cache = flow(rt), rt.cache_statistics()
            used = rt.tenant_statistics()["t"]["credits_used"]
    finally:
        model.release()
    assert callers.got["follower"] == (11.0, 0.25)
    assert callers.got["latecomer"] == (11.0, 0.25)
    assert model.seen == [5.0]
    assert (stats["dispatched"], stats["expired_running"], stats["expired"]) == (1, 1, 0)
    assert used == 1
    assert (cache["computations"], cache["coalesced"]) == (1, 2)
    assert (cache["reruns"], cache["late_answers"], cache["in_flight"]) == (0, 1, 0)
    if capacity:
        assert (cache["hits"], cache["entries"]) == (1, 1)


async def test_the_models_error_on_the_leaders_item_alone_is_the_followers_answer(
    mock_clock, manual_watchdog
):
    """The leader's deadline passes while its batch (its item alone) runs, and the
    model then raises on that item: the follower gets the model's error, the one a
    direct caller of the item gets (same type, words and status), rather than a run
    of its own that would raise again. The model ran the item once for the two, and
    the tenant paid once (the leader's run); the direct call after runs and pays on
    its own."""
    model = HeldOnce(poison=5.0)
    try:
        async with trioserve.open_runtime(coalesced(model, replicas=2)) as rt:
            dog = manual_watchdog.made[-1]
            async with trio.open_nursery() as nursery:
                callers = Callers(rt, nursery)
                await _leader_expires_running(rt, callers, mock_clock, dog, "follower")
                assert flow(rt)["dispatched"] == 1
                model.release()
                await callers.answered["follower"].wait()
            stats, cache = flow(rt), rt.cache_statistics()
            used = rt.tenant_statistics()["t"]["credits_used"]
            assert model.seen == [5.0]
            with pytest.raises(ModelError) as direct:
                await rt.infer("m", item(5.0))
    finally:
        model.release()
    error, at = callers.got["follower"]
    assert type(error) is ModelError
    assert str(error) == str(direct.value) == (
        "model 'm' failed on cpu: RuntimeError: a poison input"
    )
    assert error.status == direct.value.status == 500
    assert at == 0.25
    assert model.seen == [5.0, 5.0]  # the flight's one run, then the direct call
    assert (stats["dispatched"], stats["expired_running"]) == (1, 1)
    assert used == 1
    assert (cache["computations"], cache["coalesced"]) == (1, 1)
    assert (cache["reruns"], cache["late_answers"], cache["in_flight"]) == (0, 1, 0)


async def _split_with_poison(
    rt, callers, mock_clock, dog, model, other: tuple[str, float] = ("poison", 666.0)
) -> None:
    """The leader's item and a poison one (``other``: a caller 0.1 s later) run in
    one batch; a follower joins the leader at 0.05; the leader's deadline passes
    while the batch runs (the leader alone is answered); the batch then raises and
    is split for a retry, each item alone."""
    await callers.start("leader", 5.0)
    mock_clock.jump(0.05)
    await callers.start("follower", 5.0)
    mock_clock.jump(0.05)
    await callers.start(*other)  # fills the batch: it runs
    # its thread may not have called the model yet
    assert await trio.to_thread.run_sync(model.entered.wait, GATE_LIMIT_S)
    assert model.seen == [5.0, other[1]]
    # the leader's 1 s, not the poison caller's (its batch came in at 0.1 in trio
    # time, 0.0 on the replica's clock)
    dog.advance(0.9)
    await trio.testing.wait_all_tasks_blocked()
    assert list(callers.got) == ["leader"]
    assert isinstance(callers.got["leader"][0], DeadlineExceeded)
    model.release()


async def test_a_batch_split_after_the_leaders_deadline_answers_the_follower_from_its_part(
    mock_clock, manual_watchdog
):
    """The leader's deadline passes while its batch runs, and the batch raises (a
    poison item in it): it is retried in parts, the leader's item among them in its
    place although the leader was answered, and that part's answer is the
    follower's. Nothing runs again from the back of the queue, and nobody pays
    twice: the leader paid for its item, the poison caller for its own."""
    model = HeldOnce(poison=666.0)
    try:
        async with trioserve.open_runtime(
            coalesced(model, max_batch_size=2, max_wait_ms=500.0)
        ) as rt:
            dog = manual_watchdog.made[-1]
            async with trio.open_nursery() as nursery:
                callers = Callers(rt, nursery)
                await _split_with_poison(rt, callers, mock_clock, dog, model)
                await callers.answered["poison"].wait()  # its part ran last
                await trio.testing.wait_all_tasks_blocked()
                assert callers.got["follower"] == (11.0, 0.1)
                assert flow(rt)["queued"] == 0  # nothing runs again from the queue
            stats, cache = flow(rt), rt.cache_statistics()
            used = rt.tenant_statistics()["t"]["credits_used"]
    finally:
        model.release()
    assert callers.got["follower"] == (11.0, 0.1)
    assert isinstance(callers.got["poison"][0], trioserve.ModelError)
    assert model.seen == [5.0, 666.0, 5.0, 666.0]  # the batch, then its parts in order
    assert (stats["dispatched"], stats["expired_running"]) == (2, 1)
    assert used == 2  # the leader's, the poison caller's
    assert (cache["computations"], cache["coalesced"]) == (2, 1)
    assert (cache["reruns"], cache["late_answers"], cache["in_flight"]) == (0, 1, 0)


async def test_a_split_that_finds_the_leaders_item_bad_answers_the_follower_with_its_error(
    mock_clock, manual_watchdog
):
    """The leader's deadline passes while its batch runs, and the batch raises: the
    leader's item is the bad one. Split, its part (carried) raises alone on the one
    replica: that error, the model's for the item, is the follower's answer, as
    the direct caller of an item found so gets it; the flight does not run it a
    third time, and nobody pays for it again."""
    model = HeldOnce(poison=5.0)
    try:
        async with trioserve.open_runtime(
            coalesced(model, max_batch_size=2, max_wait_ms=500.0)
        ) as rt:
            dog = manual_watchdog.made[-1]
            async with trio.open_nursery() as nursery:
                callers = Callers(rt, nursery)
                await _split_with_poison(
                    rt, callers, mock_clock, dog, model, other=("sound", 7.0)
                )
                await callers.answered["sound"].wait()  # its part ran last
                await trio.testing.wait_all_tasks_blocked()
                assert flow(rt)["queued"] == 0  # nothing runs again from the queue
            stats, cache = flow(rt), rt.cache_statistics()
            used = rt.tenant_statistics()["t"]["credits_used"]
    finally:
        model.release()
    error, at = callers.got["follower"]
    assert type(error) is ModelError
    assert str(error) == "model 'm' failed on cpu: RuntimeError: a poison input"
    assert error.status == 500
    assert at == 0.1
    assert callers.got["sound"][0] == 15.0
    assert model.seen == [5.0, 7.0, 5.0, 7.0]  # the batch, then its parts in order
    assert (stats["dispatched"], stats["expired_running"]) == (2, 1)
    assert used == 2  # the leader's, the sound caller's
    assert (cache["computations"], cache["coalesced"]) == (2, 1)
    assert (cache["reruns"], cache["late_answers"], cache["in_flight"]) == (0, 1, 0)


class FailsOnOneReplica:
    """A model run in a thread, ``y = 2x + 1``, that raises on any batch of several;
    the second time it is called with the key 5.0 alone it waits for
    :meth:`release` (``entered`` set once it is in), then raises (a fault of the
    replica, not of the input). The keys it was called with in ``seen``."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.entered = threading.Event()
        self.seen: list[float] = []
        self._lock = threading.Lock()

    def __call__(self, items):
        keys = [key(it) for it in items]
        with self._lock:
            self.seen.extend(keys)
            n = self.seen.count(5.0)
        if len(keys) > 1:
            raise RuntimeError("a batch of several")
        if keys == [5.0] and n == 2:
            self.entered.set()
            self.released.wait(GATE_LIMIT_S)
            raise RuntimeError("a fault of this replica")
        return [{"y": it["x"] * 2 + 1} for it in items]

    def release(self) -> None:
        self.released.set()


async def test_the_leaders_part_raising_alone_runs_on_another_replica_for_the_follower(
    mock_clock, manual_watchdog
):
    """The leader's batch raises and is split; the leader's deadline passes while
    its part runs alone, which then raises. A request in that place runs once on
    another ready replica, which tells the item's error from its replica's: so does
    the leader's item, carried there for the follower, whose answer is what that
    replica computes. Nothing runs again from the back of the queue, nobody pays
    twice, and the first replica's breaker is told, as for a request of its own."""
    model = FailsOnOneReplica()
    try:
        async with trioserve.open_runtime(
            coalesced(model, replicas=2, max_batch_size=2, max_wait_ms=500.0)
        ) as rt:
            dog = manual_watchdog.made[-1]
            async with trio.open_nursery() as nursery:
                callers = Callers(rt, nursery)
                await callers.start("leader", 5.0)
                mock_clock.jump(0.05)
                await callers.start("follower", 5.0)
                mock_clock.jump(0.05)
                await callers.start("other", 7.0)  # fills the batch: it runs, raises
                assert await trio.to_thread.run_sync(model.entered.wait, GATE_LIMIT_S)
                await callers.answered["other"].wait()  # its part, on the other replica
                dog.advance(0.9)  # the leader's 1 s, while its part runs
                await trio.testing.wait_all_tasks_blocked()
                assert sorted(callers.got) == ["leader", "other"]
                assert RUNNING in str(callers.got["leader"][0])
                model.release()
                await callers.answered["follower"].wait()
                assert flow(rt)["queued"] == 0  # nothing runs again from the queue
            stats, cache = flow(rt), rt.cache_statistics()
            used = rt.tenant_statistics()["t"]["credits_used"]
            failures = sorted(b._breaker.failures for b in rt.models["m"].batchers)
    finally:
        model.release()
    assert callers.got["follower"] == (11.0, 0.1)
    assert callers.got["other"][0] == 15.0
    assert sorted(model.seen) == [5.0, 5.0, 5.0, 7.0, 7.0]
    assert model.seen[-1] == 5.0  # its part, run again elsewhere, carried
    assert stats["dispatched"] == 2
    assert used == 2  # the leader's, the other caller's
    assert failures == [0, 1]  # the result elsewhere is evidence against the first
    assert (cache["computations"], cache["coalesced"]) == (2, 1)
    assert (cache["reruns"], cache["late_answers"], cache["in_flight"]) == (0, 1, 0)


async def test_a_replica_crashing_under_the_leaders_carried_item_runs_it_again(
    mock_clock, manual_watchdog, monkeypatch
):
    """The leader's deadline passes while its batch runs; the batch raises and is
    split, the leader's item carried into a part; the replica then crashes while
    that part runs (a fault of the batcher's, not the item's): the carrying
    request's ActorBroken is no answer of the item's, so the flight runs again for
    the follower, as its own request, which the restarted replica answers."""
    from trioserve.actors import BatcherActor

    original = BatcherActor._execute
    batches: list[list[float]] = []

    async def execute(self, batch):
        batches.append([key(r.item) for r in batch])
        if len(batches) == 2:  # the part carrying the leader's item
            raise RuntimeError("a batcher bug")
        await original(self, batch)

    monkeypatch.setattr(BatcherActor, "_execute", execute)
    model = HeldOnce(poison=666.0)
    try:
        async with trioserve.open_runtime(
            coalesced(model, max_batch_size=2, max_wait_ms=500.0)
        ) as rt:
            dog = manual_watchdog.made[-1]
            async with trio.open_nursery() as nursery:
                callers = Callers(rt, nursery)
                await _split_with_poison(rt, callers, mock_clock, dog, model)
                await callers.answered["poison"].wait()  # its part ran after the crash
                await trio.testing.wait_all_tasks_blocked()
                assert "follower" not in callers.got
                assert flow(rt)["queued"] == 1  # its own request: the batch waits to close
                mock_clock.jump(0.5)
                await callers.answered["follower"].wait()
            stats, cache = flow(rt), rt.cache_statistics()
            used = rt.tenant_statistics()["t"]["credits_used"]
            replica = rt.statistics()["m"]["replicas"][0]
    finally:
        model.release()
    assert callers.got["follower"] == (11.0, 0.6)
    assert isinstance(callers.got["poison"][0], ModelError)
    assert replica["restarts"] == 1
    # the batch, the carried part (crashed before the model ran it), the poison's
    # part, then the follower's own request
    assert batches == [[5.0, 666.0], [5.0], [666.0], [5.0]]
    assert model.seen == [5.0, 666.0, 666.0, 5.0]
    assert stats["dispatched"] == 3
    assert used == 3  # the leader's, the poison caller's, the follower's own run
    assert (cache["computations"], cache["coalesced"]) == (2, 1)
    assert (cache["reruns"], cache["late_answers"], cache["in_flight"]) == (1, 0, 0)


async def test_a_carried_item_nobody_waits_for_leaves_the_queue_at_once(
    mock_clock, manual_watchdog
):
    """The leader's deadline passes while its batch runs, in a thread on the one
    replica; the batch is then cut off, and the leader's item, carried, waits to
    be retried while the straggling thread holds the replica. The follower's own
    deadline passes first: nobody waits for the item any more, and the request
    carrying it leaves the queue at once, as a withdrawn request does (it has no
    deadline: it stayed, counted in the queue's depth and load, until the replica
    pulled again). It never runs."""
    model = HeldOnce()
    try:
        async with trioserve.open_runtime(
            coalesced(model, batch_timeout_floor_ms=1_100.0)
        ) as rt:
            dog = manual_watchdog.made[-1]
            scheduler = rt.models["m"].scheduler
            async with trio.open_nursery() as nursery:
                callers = Callers(rt, nursery)
                await _leader_expires_running(rt, callers, mock_clock, dog, "follower")
                dog.advance(0.1)  # the batch's 1.1 s: cut off, handed back split
                await trio.testing.wait_all_tasks_blocked()
                assert rt.models["m"].batchers[0].health == "degraded"
                assert (scheduler.queue_depth(), scheduler.load()) == (1, 1)  # carried
                mock_clock.jump(1.0)  # the follower's 1 s, kept on trio's clock now
                await trio.testing.wait_all_tasks_blocked()
                error, at = callers.got["follower"]
                assert isinstance(error, DeadlineExceeded)
                assert JOINED in str(error)
                assert at == 1.25
                assert (scheduler.queue_depth(), scheduler.load()) == (0, 0)
                model.release()
            await scheduler.wait_empty()
            cache = rt.cache_statistics()
    finally:
        model.release()
    assert model.seen == [5.0]  # the carried item never ran
    assert (cache["reruns"], cache["late_answers"], cache["in_flight"]) == (0, 0, 0)


class HeldTwice(HeldOnce):
    """:class:`HeldOnce` whose second call of the key ``held`` waits for
    :meth:`release_again` too (its thread, once in, sets ``entered_again``)."""

    def __init__(self, *, held: float, **kw) -> None:
        super().__init__(**kw)
        self.held = held
        self.again = threading.Event()
        self.entered_again = threading.Event()

    def __call__(self, items):
        keys = [key(it) for it in items]
        if self.seen and self.held in keys and self.held in self.seen:
            with self._lock:
                self.seen.extend(keys)
            self.entered_again.set()
            self.again.wait(GATE_LIMIT_S)
            return [{"y": it["x"] * 2 + 1} for it in items]
        return super().__call__(items)

    def release_again(self) -> None:
        self.again.set()


async def test_a_follower_whose_deadline_passes_while_the_leaders_item_runs_in_a_part(
    mock_clock, manual_watchdog
):
    """As above, but the part holding the leader's item hangs: the follower's own
    deadline (1.05) passes while it runs, and the follower gets its own
    DeadlineExceeded then, in its own terms; nobody waits for the part's answer any
    more, which then answers nobody, and nothing runs again."""
    model = HeldTwice(held=5.0, poison=666.0)
    try:
        async with trioserve.open_runtime(
            coalesced(model, max_batch_size=2, max_wait_ms=500.0)
        ) as rt:
            dog = manual_watchdog.made[-1]
            async with trio.open_nursery() as nursery:
                callers = Callers(rt, nursery)
                await _split_with_poison(rt, callers, mock_clock, dog, model)
                await trio.testing.wait_all_tasks_blocked()
                assert flow(rt)["queued"] == 0  # nothing runs again from the queue
                assert await trio.to_thread.run_sync(model.entered_again.wait, GATE_LIMIT_S)
                assert rt.cache_statistics()["in_flight"] == 2  # the poison's waits too
                mock_clock.jump(0.949)  # 1.049: the follower has 1 ms left
                await trio.testing.wait_all_tasks_blocked()
                assert "follower" not in callers.got
                mock_clock.jump(0.002)
                await callers.answered["follower"].wait()
                error, at = callers.got["follower"]
                assert isinstance(error, DeadlineExceeded)
                assert str(error) == (
                    f"model 'm': deadline passed after 1.000s {JOINED} (limit: the "
                    "model's or its class's timeout_ms)"
                )
                assert error.in_queue
                assert at == pytest.approx(1.05, abs=0.002)  # its own deadline
                assert rt.cache_statistics()["in_flight"] == 1
                model.release_again()
                await callers.answered["poison"].wait()
            cache = rt.cache_statistics()
            used = rt.tenant_statistics()["t"]["credits_used"]
    finally:
        model.release()
        model.release_again()
    assert model.seen == [5.0, 666.0, 5.0, 666.0]
    assert used == 2
    assert (cache["reruns"], cache["late_answers"], cache["in_flight"]) == (0, 0, 0)


async def test_a_follower_whose_own_deadline_passes_before_the_late_batch_ends(
    mock_clock, manual_watchdog
):
    """The follower waits for the batch of the leader, whose deadline passed while
    it ran; its own deadline (1.25, on the replica's clock, as the batch's requests')
    passes first: it alone gets DeadlineExceeded then, and was charged nothing.
    Nobody waits any more: the flight is gone, and the batch's end, later, answers
    no one and runs nothing again (a probe queued behind it on the one replica is
    the next and last thing the model runs)."""
    model = HeldOnce()
    try:
        async with trioserve.open_runtime(coalesced(model)) as rt:
            dog = manual_watchdog.made[-1]
            async with trio.open_nursery() as nursery:
                callers = Callers(rt, nursery)
                await _leader_expires_running(rt, callers, mock_clock, dog, "follower")
                dog.advance(0.249)
                await trio.testing.wait_all_tasks_blocked()
                assert "follower" not in callers.got
                dog.advance(0.001)  # the follower's 1 s
                await trio.testing.wait_all_tasks_blocked()
                error, _ = callers.got["follower"]
                assert isinstance(error, DeadlineExceeded)
                # its own figures: its 1 s, spent waiting for the leader's batch (not
                # the leader's, whose limit passed while its batch ran)
                assert str(error) == (
                    f"model 'm': deadline passed after 1.000s {JOINED} (limit: the "
                    "model's or its class's timeout_ms)"
                )
                assert RUNNING not in str(error)
                assert error.in_queue  # no device ran for it, nothing charged
                assert rt.cache_statistics()["in_flight"] == 0
                await callers.start("probe", 7.0)
                model.release()
                await callers.answered["probe"].wait()
            stats, cache = flow(rt), rt.cache_statistics()
            used = rt.tenant_statistics()["t"]["credits_used"]
    finally:
        model.release()
    assert callers.got["probe"][0] == 15.0
    assert model.seen == [5.0, 7.0]
    assert stats["dispatched"] == 2
    assert used == 2  # the leader's run and the probe's
    assert (cache["computations"], cache["coalesced"]) == (2, 1)
    assert (cache["reruns"], cache["late_answers"], cache["in_flight"]) == (0, 0, 0)


async def test_a_cancelled_follower_leaves_the_late_batch_to_the_others(
    mock_clock, manual_watchdog
):
    """Two followers wait for the batch of the leader, whose deadline passed while
    it ran; the first one leaves (its own cancel scope): the other still gets the
    batch's answer, and nothing ran again."""
    model = HeldOnce()
    try:
        async with trioserve.open_runtime(coalesced(model, replicas=2)) as rt:
            dog = manual_watchdog.made[-1]
            async with trio.open_nursery() as nursery:
                callers = Callers(rt, nursery)
                await _leader_expires_running(rt, callers, mock_clock, dog, "gone", "stays")
                callers.scopes["gone"].cancel()
                await trio.testing.wait_all_tasks_blocked()
                assert rt.cache_statistics()["in_flight"] == 1
                model.release()
                await callers.answered["stays"].wait()
            cache = rt.cache_statistics()
            used = rt.tenant_statistics()["t"]["credits_used"]
    finally:
        model.release()
    assert "gone" not in callers.got
    assert callers.got["stays"] == (11.0, 0.5)
    assert model.seen == [5.0]
    assert used == 1
    assert (cache["reruns"], cache["late_answers"], cache["in_flight"]) == (0, 1, 0)


class HeldParts(SplitsInChunks, ModelBackend):
    """A model run in a thread whose items cost their length and split into chunks
    of the budget (their outputs concatenated): ``y = 2x + 1``. Every call waits
    for :meth:`release`; ``entered`` is set once ``calls`` calls are in. The chunk
    each call ran, by its ``x[0]``, in ``seen``."""

    inputs = (X,)
    outputs = (Y,)
    default_execution = "thread"
    supports_split = True

    def __init__(self, calls: int) -> None:
        self.released = threading.Event()
        self.entered = threading.Event()
        self.calls = calls
        self.seen: list[float] = []
        self._lock = threading.Lock()

    def prepare(self, name, inputs):
        it, _ = super().prepare(name, inputs)
        return it, int(it["x"].shape[0])

    def load(self, device, *, torch_threads=1):
        def run(items):
            with self._lock:
                self.seen.extend(key(it) for it in items)
                if len(self.seen) >= self.calls:
                    self.entered.set()
            self.released.wait(GATE_LIMIT_S)
            return [{"y": it["x"] * 2 + 1} for it in items]

        return run


    def release(self) -> None:
        self.released.set()


async def test_a_follower_gets_the_parts_of_an_oversize_item_still_running(
    mock_clock, manual_watchdog
):
    """An item over the batch budget runs in parts (two, one on each replica). The
    leader's deadline passes while both run: the leader is answered at once, and the
    follower, with time left, waits for the parts as for a plain batch; their
    answers, merged, are its answer. Nothing runs again, and the tenant paid for the
    parts once."""
    model = HeldParts(calls=2)
    config = trioserve.Config(
        models=(ModelConfig(
            name="m", backend=model, coalesce=True, timeout_ms=1_000.0, replicas=2,
            max_batch_size=1, max_batch_tokens=2, max_wait_ms=0, oversize="split",
            batch_timeout_floor_ms=30_000.0, batch_timeout_cap_ms=30_000.0,
        ),),
        tenants=(TenantConfig(name="t", default=True),),
    )
    x = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    got: dict[str, object] = {}

    async def call(name: str) -> None:
        try:
            got[name] = (await rt.infer("m", {"x": x}))["y"].tolist()
        except trioserve.TrioserveError as exc:
            got[name] = exc

    try:
        async with trioserve.open_runtime(config) as rt:
            dog = manual_watchdog.made[-1]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, "leader")
                await trio.testing.wait_all_tasks_blocked()
                mock_clock.jump(0.25)
                nursery.start_soon(call, "follower")
                await trio.testing.wait_all_tasks_blocked()
                assert await trio.to_thread.run_sync(model.entered.wait, GATE_LIMIT_S)
                dog.advance(1.0)  # the leader's 1 s, while both parts run
                await trio.testing.wait_all_tasks_blocked()
                assert list(got) == ["leader"]
                assert isinstance(got["leader"], DeadlineExceeded)
                assert RUNNING in str(got["leader"])
                assert flow(rt)["queued"] == 0
                model.release()
            stats, cache = flow(rt), rt.cache_statistics()
            used = rt.tenant_statistics()["t"]["credits_used"]
    finally:
        model.release()
    assert got["follower"] == [3.0, 5.0, 7.0, 9.0]
    assert sorted(model.seen) == [1.0, 3.0]  # the two parts, once each
    assert (stats["dispatched"], stats["expired_running"]) == (2, 2)
    assert used == 4  # the parts' cost, once
    assert (cache["computations"], cache["coalesced"]) == (1, 1)
    assert (cache["reruns"], cache["late_answers"], cache["in_flight"]) == (0, 1, 0)


async def test_a_carried_part_left_when_another_part_expires_queued_leaves_the_queue(
    mock_clock, manual_watchdog
):
    """An item over the batch budget runs in two parts on the one replica: the
    first runs (held in its thread), the second waits in the queue. The caller's
    deadline passes while the first runs (answered at once), and its batch is then
    cut off: its item, carried, waits to be retried while the straggling thread
    holds the replica. The second part's deadline then passes in the queue: no
    outcome of the whole item can come, and the request carrying the first part
    leaves the queue at once, as a withdrawn request does (it has no deadline: it
    stayed, counted in the queue's depth and load, until the replica pulled
    again). It never runs."""
    model = HeldParts(calls=1)
    config = trioserve.Config(
        models=(ModelConfig(
            name="m", backend=model, coalesce=True, timeout_ms=1_000.0, replicas=1,
            max_batch_size=1, max_batch_tokens=2, max_wait_ms=0, oversize="split",
            batch_timeout_floor_ms=1_100.0, batch_timeout_cap_ms=1_100.0,
        ),),
        tenants=(TenantConfig(name="t", default=True),),
    )
    x = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    got: dict[str, object] = {}

    async def call() -> None:
        try:
            got["caller"] = (await rt.infer("m", {"x": x}))["y"].tolist()
        except trioserve.TrioserveError as exc:
            got["caller"] = exc

    try:
        async with trioserve.open_runtime(config) as rt:
            dog = manual_watchdog.made[-1]
            scheduler = rt.models["m"].scheduler
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)
                await trio.testing.wait_all_tasks_blocked()
                assert await trio.to_thread.run_sync(model.entered.wait, GATE_LIMIT_S)
                assert scheduler.queue_depth() == 1  # the second part
                dog.advance(1.0)  # the caller's 1 s, while the first part runs
                await trio.testing.wait_all_tasks_blocked()
                dog.advance(0.1)  # the batch's 1.1 s: cut off, its item carried
                await trio.testing.wait_all_tasks_blocked()
                assert rt.models["m"].batchers[0].health == "degraded"
                assert scheduler.queue_depth() == 2  # the carried part, the second
                mock_clock.jump(1.0)  # the second part's 1 s, in the queue
                await trio.testing.wait_all_tasks_blocked()
                assert isinstance(got["caller"], DeadlineExceeded)
                assert scheduler.queue_depth() == 0
                # the expired part's cost is counted until the queue skips it
                # (FairQueue.queued_cost); the carried part's is not held
                assert scheduler.load() == 2
                model.release()
            await scheduler.wait_empty()
    finally:
        model.release()
    assert model.seen == [1.0]  # the carried part never ran again


class HeldPartAndPoisonPart(SplitsInChunks, ModelBackend):
    """A model run in a thread whose items cost their length and split into chunks
    of the budget: ``y = 2x + 1``. A chunk starting at ``held`` waits for
    :meth:`release` (``entered`` set once it is in); one starting at ``poison``
    raises. The chunks it was called with, by their ``x[0]``, in ``seen``."""

    inputs = (X,)
    outputs = (Y,)
    default_execution = "thread"
    supports_split = True

    def __init__(self, *, held: float, poison: float) -> None:
        self.held = held
        self.poison = poison
        self.released = threading.Event()
        self.entered = threading.Event()
        #: set as the poison chunk raises
        self.poisoned = threading.Event()
        self.seen: list[float] = []
        self._lock = threading.Lock()

    def prepare(self, name, inputs):
        it, _ = super().prepare(name, inputs)
        return it, int(it["x"].shape[0])

    def load(self, device, *, torch_threads=1):
        def run(items):
            keys = [key(it) for it in items]
            with self._lock:
                self.seen.extend(keys)
            if self.held in keys:
                self.entered.set()
                self.released.wait(GATE_LIMIT_S)
            if self.poison in keys:
                self.poisoned.set()
                raise RuntimeError("a poison part")
            return [{"y": it["x"] * 2 + 1} for it in items]

        return run

    def release(self) -> None:
        self.released.set()


async def test_the_models_error_on_one_part_is_the_followers_answer_for_the_whole_item(
    mock_clock, manual_watchdog
):
    """An item over the batch budget runs in two parts, one on each replica. The
    second part raises at once (the model's error, answered directly); the leader's
    deadline then passes while the first part still runs. The follower gets the
    model's error, the one a direct caller of the item gets (same type, words and
    status), as it would for a whole item's late ModelError: before, the item ran
    again for it (both parts, paid again), only for the second part to raise again.
    The model ran each part once for the two callers, and the tenant paid once."""
    model = HeldPartAndPoisonPart(held=1.0, poison=3.0)
    config = trioserve.Config(
        models=(ModelConfig(
            name="m", backend=model, coalesce=True, timeout_ms=1_000.0, replicas=2,
            max_batch_size=1, max_batch_tokens=2, max_wait_ms=0, oversize="split",
            batch_timeout_floor_ms=30_000.0, batch_timeout_cap_ms=30_000.0,
        ),),
        tenants=(TenantConfig(name="t", default=True),),
    )
    x = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    got: dict[str, tuple[object, float]] = {}

    async def call(name: str) -> None:
        try:
            out: object = (await rt.infer("m", {"x": x}))["y"].tolist()
        except trioserve.TrioserveError as exc:
            out = exc
        got[name] = (out, trio.current_time())

    try:
        async with trioserve.open_runtime(config) as rt:
            dog = manual_watchdog.made[-1]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, "leader")
                await trio.testing.wait_all_tasks_blocked()
                assert await trio.to_thread.run_sync(model.entered.wait, GATE_LIMIT_S)
                mock_clock.jump(0.25)
                nursery.start_soon(call, "follower")
                await trio.testing.wait_all_tasks_blocked()
                # the second part raised, and was answered: its thread runs, and
                # returns to trio, after the tasks are blocked (a wait for tasks
                # blocked does not wait for a thread)
                assert await trio.to_thread.run_sync(model.poisoned.wait, GATE_LIMIT_S)
                assert sorted(model.seen) == [1.0, 3.0]
                for _ in range(1000):
                    if rt.statistics()["m"]["statuses"].get("model_error", 0):
                        break
                    assert await trio.to_thread.run_sync(model.poisoned.wait, GATE_LIMIT_S)
                    await trio.testing.wait_all_tasks_blocked()
                assert rt.statistics()["m"]["statuses"]["model_error"] == 1
                assert got == {}  # the leader waits for its first part
                dog.advance(1.0)  # the leader's 1 s, while the first part runs
                await trio.testing.wait_all_tasks_blocked()
                assert isinstance(got["leader"][0], DeadlineExceeded)
                assert RUNNING in str(got["leader"][0])
                assert "follower" in got  # answered then, nothing run for it
                assert flow(rt)["queued"] == 0
                model.release()
            stats, cache = flow(rt), rt.cache_statistics()
            used = rt.tenant_statistics()["t"]["credits_used"]
            assert sorted(model.seen) == [1.0, 3.0]
            with pytest.raises(ModelError) as direct:
                await rt.infer("m", {"x": x})
    finally:
        model.release()
    error, at = got["follower"]
    assert type(error) is ModelError
    assert str(error) == str(direct.value) == (
        "model 'm' failed on cpu: RuntimeError: a poison part"
    )
    assert error.status == direct.value.status == 500
    assert at == 0.25
    assert sorted(model.seen) == [1.0, 1.0, 3.0, 3.0]  # the flight's parts, the direct call's
    assert (stats["dispatched"], stats["expired_running"]) == (2, 1)
    assert used == 4  # the parts' cost, once
    assert (cache["computations"], cache["coalesced"]) == (1, 1)
    assert (cache["reruns"], cache["late_answers"], cache["in_flight"]) == (0, 1, 0)


@pytest.mark.parametrize(
    ("first", "second", "whole"),
    [
        # the second part's model error, before the first (still running) expired
        ("running", ModelError("model 'm' failed on cpu: RuntimeError: bad"), "error"),
        # the model's error wins over a replica's: a rerun would raise it again
        (ActorBroken("replica m#0 crashed"), ModelError("model 'm' failed"), "error"),
        # a part refused before it ran (too large for a worker's message): a rerun
        # would be refused again; it used to leave no outcome, and the flight ran again
        ("running", InvalidInput("model 'm': its inputs are too many bytes"), "error"),
        # a replica's error or a part expired queued: no outcome of the item comes
        ("running", ActorBroken("replica m#1 crashed"), None),
        ("running", ActorClosed("the runtime is closing"), None),
        ("running", DeadlineExceeded("model 'm': deadline passed in the queue"), None),
    ],
)
def test_a_parts_direct_error_is_the_whole_items_outcome_when_it_is_the_models(
    first, second, whole
):
    """A split item's call failed: a part answered directly with the model's error,
    or refused before it ran (InvalidInput), settles the flight's hook with that
    error (which its ``input_error`` makes every waiter's answer); a part answered
    directly otherwise leaves it no outcome (the flight runs again)."""
    late = LateOutcome()
    split = _SplitLate(late, 2, merge=None)
    answers = []
    for part, answer in zip(split.parts, (first, second), strict=True):
        if answer == "running":  # answered DeadlineExceeded while its batch runs
            part.expect()
            answer = DeadlineExceeded("model 'm': deadline passed while its batch was running")
        answers.append(outcome.Error(answer))
    split.answered(answers)
    split.close()
    if whole is None:
        assert (late.expected, late.settled) == (False, False)
    else:
        assert (late.expected, late.settled) == (True, True)
        assert late.result.error is second
    assert split.over


# ---------------------------------------------------------------- credits
async def test_a_credit_refusal_measured_against_the_leaders_deadline_is_not_the_followers(
    autojump_clock,
):
    """The leader's credits would refill only after its own (cancel scope's)
    deadline: it is refused at once, QuotaExceeded. A follower that joined it, with
    no deadline of its own that soon, waits for the refill in its own run and gets
    the answer."""
    model = Recorder()
    config = trioserve.Config(
        models=(callable_model("m", model, coalesce=True, max_wait_ms=0, timeout_ms=5_000.0),),
        tenants=(TenantConfig(name="t", default=True, credit_rate=1.0, credit_burst=1.0),),
    )
    got: dict[str, object] = {}
    async with trioserve.open_runtime(config) as rt:
        await rt.infer("m", item(1.0), priority="batch")  # spends the burst
        t0 = trio.current_time()

        async def follower() -> None:
            got["follower"] = float((await rt.infer("m", item(5.0), priority="batch"))["y"][0])
            got["at"] = trio.current_time()

        async def leader(nursery) -> None:
            # the follower is called before the flight's task runs: it joins
            nursery.start_soon(follower)
            with trio.move_on_after(0.5), pytest.raises(QuotaExceeded) as refused:
                await rt.infer("m", item(5.0), priority="batch")
            got["leader"] = refused.value

        async with trio.open_nursery() as nursery:
            nursery.start_soon(leader, nursery)
        cache = rt.cache_statistics()
        used = rt.tenant_statistics()["t"]["credits_used"]
    assert got["leader"].deadline == pytest.approx(t0 + 0.5)
    assert got["follower"] == 11.0
    assert got["at"] == pytest.approx(t0 + 1.0)  # the refill
    assert model.seen == [1.0, 5.0]
    assert used == 2
    # the first request's flight, and the leader's, which the follower joined
    assert (cache["computations"], cache["coalesced"], cache["reruns"]) == (2, 1, 1)


async def test_a_follower_refused_for_the_leaders_deadline_is_told_of_its_own_request(
    autojump_clock,
):
    """The tenant's credits refill only after the model's timeout (0.5 s): the leader
    is refused, QuotaExceeded measured against its deadline, and so is a follower
    that joined it at its instant (its deadline is the same). The follower's refusal
    describes its own request: its own deadline, its time left and its wait for the
    computation it joined, not the leader's words."""
    model = Recorder()
    config = trioserve.Config(
        models=(callable_model("m", model, coalesce=True, max_wait_ms=0, timeout_ms=500.0),),
        tenants=(TenantConfig(name="t", default=True, credit_rate=1.0, credit_burst=1.0),),
    )
    got: dict[str, object] = {}
    async with trioserve.open_runtime(config) as rt:
        await rt.infer("m", item(1.0), priority="batch")  # spends the burst
        t0 = trio.current_time()

        async def one(name: str, nursery=None) -> None:
            if nursery is not None:
                # the follower is called before the flight's task runs: it joins
                nursery.start_soon(one, "follower")
            with pytest.raises(QuotaExceeded) as refused:
                await rt.infer("m", item(5.0), priority="batch")
            got[name] = refused.value

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "leader", nursery)
        cache = rt.cache_statistics()
    leader, follower = got["leader"], got["follower"]
    assert str(leader) == (
        "tenant 't' is over its credit rate (1/s) and its credits refill only after "
        "the request's deadline"
    )
    assert leader.deadline == pytest.approx(t0 + 0.5)
    assert type(follower) is QuotaExceeded
    assert str(follower) == (
        "model 'm': refused: the tenant's credits refill only after its deadline "
        f"(500 ms left), after 0.000s {JOINED}"
    )
    assert follower.deadline == pytest.approx(t0 + 0.5)  # its own
    assert follower.retry_after == leader.retry_after
    assert model.seen == [1.0]
    assert (cache["computations"], cache["coalesced"], cache["reruns"]) == (2, 1, 0)


# ---------------------------------------------------------------- a worker process
class StagedWorker(_StandIn):
    """Stands in for a worker process (none runs), in trio time: batches are staged
    and answered in order, ``y = 2x + 1``. The first batch sent to the first worker
    waits for ``gate``, then fails as ``fate`` says: "raises" (the model raised),
    "too_large" (its outputs do not fit in a message); every other batch is
    answered at once. Workers are numbered as they are made (a successor gets the
    next number); each batch sent is recorded in ``sent`` as (worker number,
    keys)."""

    gate: trio.Event
    fate: str
    sent: list[tuple[int, list[float]]]
    made: int

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        self.number = StagedWorker.made
        StagedWorker.made += 1
        self.pid = None
        self.busy_seconds = self.last_run_seconds = 0.0
        self._staged: list = []
        self._answered = 0
        self._exited = trio.Event()

    async def submit(self, items) -> None:
        await trio.lowlevel.checkpoint()
        StagedWorker.sent.append((self.number, [key(it) for it in items]))
        self._staged.append(items)

    async def result(self):
        first = self.number == 0 and not self._answered
        self._answered += 1
        items = self._staged.pop(0)
        if first:
            await StagedWorker.gate.wait()
            if StagedWorker.fate == "raises":
                raise self.Failed("a sticky device error")
            raise WorkerProcess.TooLarge("its outputs are more than one message can carry")
        await trio.lowlevel.checkpoint()
        return [{"y": it["x"] * 2 + 1} for it in items]


class OpensOnARaise(Breaker):
    """A breaker that opens on the model's first raise on fresh work, as on evidence
    that its replica, not the input, is at fault."""

    def __init__(self) -> None:
        super().__init__(threshold=1)

    def raised(self, now: float, successes: int, *, alone: bool = True) -> bool:
        self.failure(now)
        return True


@pytest.fixture
def staged_workers(monkeypatch, manual_watchdog):
    import trioserve._runtime
    import trioserve.actors._batcher

    StagedWorker.gate, StagedWorker.fate = trio.Event(), "raises"
    StagedWorker.sent, StagedWorker.made = [], 0
    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", StagedWorker)
    return StagedWorker


async def test_a_worker_replaced_for_its_breaker_carries_the_leaders_staged_item(
    mock_clock, manual_watchdog, staged_workers, monkeypatch
):
    """The leader's batch is staged behind another on a worker process; a follower
    joins; the leader's deadline passes while its batch is staged (it is answered
    at once, as is the one ahead, whose deadline is the same). The batch ahead then
    raises and opens the replica's breaker: the worker is replaced, and the staged
    batch goes back as it was, the leader's item carried by a request of its own,
    whose answer is the follower's. The flight
    does not run again for the follower, and nobody pays twice."""
    monkeypatch.setattr(trioserve.actors, "Breaker", OpensOnARaise)
    async with trioserve.open_runtime(coalesced(None, execution="process")) as rt:
        dog = manual_watchdog.made[-1]
        batcher = rt.models["m"].batchers[0]
        async with trio.open_nursery() as nursery:
            callers = Callers(rt, nursery)
            await callers.start("blocker", 0.0)  # runs first, held
            await callers.start("leader", 5.0)
            mock_clock.jump(0.25)
            await callers.start("follower", 5.0)
            dog.advance(1.0)  # the blocker's 1 s, and the leader's, staged
            await trio.testing.wait_all_tasks_blocked()
            assert sorted(callers.got) == ["blocker", "leader"]
            assert RUNNING in str(callers.got["leader"][0])
            assert staged_workers.sent == [(0, [0.0]), (0, [5.0])]  # the leader's staged
            staged_workers.gate.set()  # the blocker's batch raises: the breaker opens
            await callers.answered["follower"].wait()
        stats, cache = flow(rt), rt.cache_statistics()
        used = rt.tenant_statistics()["t"]["credits_used"]
    assert batcher.workers_broken == 1
    assert callers.got["follower"] == (11.0, 0.25)
    # the successor ran the leader's item, carried: the follower's own request never
    # entered the queue
    assert staged_workers.sent == [(0, [0.0]), (0, [5.0]), (1, [5.0])]
    assert stats["dispatched"] == 2
    assert used == 2  # the blocker's, the leader's
    assert (cache["reruns"], cache["late_answers"], cache["in_flight"]) == (0, 1, 0)


def test_an_item_refused_before_it_ran_answers_the_flights_waiters():
    """The late outcome of an item whose inputs its worker's pipe could not carry
    (refused before it was sent: InvalidInput, never run) is the input's own, as
    the model's error for it is: the flight's waiters get it, where running the item
    again for them would be refused the same way. Before, the refusal was a
    ModelError; as an InvalidInput it made the flight run again."""
    from trioserve.actors._cache_actor import input_error

    assert input_error(ModelError("model 'm' failed on cpu: ValueError: bad"))
    assert input_error(InvalidInput("model 'm': its batch's inputs are 5000 bytes ..."))
    assert not input_error(ActorBroken("batcher crashed mid-batch"))
    assert not input_error(ActorClosed("the runtime is shut down"))


async def test_a_batch_too_large_for_its_worker_carries_the_leaders_item_into_its_halves(
    mock_clock, manual_watchdog, staged_workers
):
    """The leader's item runs in a batch of three on a worker process; a follower
    joins; the leader's deadline passes while the batch runs. The batch's outputs
    are then too large for one message: it runs again in halves, the leader's item
    among them in its place (carried), and that half's answer is the follower's.
    Nothing runs again from the back of the queue, and nobody pays twice."""
    staged_workers.fate = "too_large"
    async with trioserve.open_runtime(
        coalesced(None, execution="process", max_batch_size=3, max_wait_ms=500.0)
    ) as rt:
        dog = manual_watchdog.made[-1]
        async with trio.open_nursery() as nursery:
            callers = Callers(rt, nursery)
            await callers.start("leader", 5.0)
            mock_clock.jump(0.05)
            await callers.start("follower", 5.0)
            mock_clock.jump(0.05)
            await callers.start("a", 7.0)
            await callers.start("b", 9.0)  # fills the batch: it runs
            assert staged_workers.sent == [(0, [5.0, 7.0, 9.0])]
            # the leader's 1 s (the batch came in at 0.1 in trio time, 0.0 on the
            # replica's clock), not the others'
            dog.advance(0.9)
            await trio.testing.wait_all_tasks_blocked()
            assert list(callers.got) == ["leader"]
            assert RUNNING in str(callers.got["leader"][0])
            staged_workers.gate.set()
            await trio.testing.wait_all_tasks_blocked()
            assert sorted(callers.got) == ["a", "b", "follower", "leader"]
            assert flow(rt)["queued"] == 0  # nothing runs again from the queue
        stats, cache = flow(rt), rt.cache_statistics()
        used = rt.tenant_statistics()["t"]["credits_used"]
    assert callers.got["follower"] == (11.0, 0.1)
    assert (callers.got["a"][0], callers.got["b"][0]) == (15.0, 19.0)
    assert staged_workers.sent == [(0, [5.0, 7.0, 9.0]), (0, [5.0]), (0, [7.0, 9.0])]
    assert stats["dispatched"] == 3
    assert used == 3  # the leader's, a's, b's
    assert (cache["reruns"], cache["late_answers"], cache["in_flight"]) == (0, 1, 0)
