"""A caller that joined an identical request in flight (``coalesce``, or the result
cache) is not failed by the first caller's deadline: the flight runs with the
deadline of the caller it runs for, and when that passes (queued, or while its
batch runs) a joined caller whose own deadline is later gets a run of its own,
under its own deadline, entering the queue at the back. Each caller gets one
answer, at its own deadline at the latest."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import GATE_LIMIT_S, Gate, Recorder, callable_model, item, key
from trioserve import CacheConfig, DeadlineExceeded, QuotaExceeded, TenantConfig

RUNNING = "deadline passed while its batch was running"
QUEUED = "in the queue"


def coalesced(model, *, capacity: int = 0, **cfg) -> trioserve.Config:
    """``model`` run in a thread, one item a batch, with a timeout of 1 s, coalesced
    (and cached, with a capacity), served to one open tenant."""
    cfg.setdefault("replicas", 1)
    return trioserve.Config(
        models=(callable_model(
            "m", model, execution="thread", coalesce=True, max_batch_size=1,
            max_wait_ms=0, timeout_ms=1_000.0, batch_timeout_floor_ms=30_000.0,
            batch_timeout_cap_ms=30_000.0, **cfg,
        ),),
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
    (a thread's call); the keys of every batch in ``seen``."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.seen: list[float] = []
        self._lock = threading.Lock()

    def __call__(self, items):
        with self._lock:
            first = not self.seen
            self.seen.extend(key(it) for it in items)
        if first:
            self.released.wait(GATE_LIMIT_S)
        return [{"y": it["x"] * 2 + 1} for it in items]

    def release(self) -> None:
        self.released.set()


async def test_a_follower_outlives_the_leaders_deadline_in_a_running_batch(
    autojump_clock, manual_watchdog
):
    """The leader's batch hangs in its thread on one replica; a follower joins 0.5 s
    later. The leader's deadline passes while its batch runs: the leader gets
    DeadlineExceeded, and the follower's own run goes to the other replica and
    answers it. The tenant is charged for both runs: each ran, for one caller."""
    model = HeldOnce()
    try:
        async with trioserve.open_runtime(coalesced(model, replicas=2)) as rt:
            dog = manual_watchdog.made[-1]
            async with trio.open_nursery() as nursery:
                callers = Callers(rt, nursery)
                await callers.start("leader", 5.0)  # its batch is running
                await trio.sleep(0.5)  # the mock clock's time
                await callers.start("follower", 5.0)
                assert rt.cache_statistics()["coalesced"] == 1
                dog.advance(0.999)
                await trio.testing.wait_all_tasks_blocked()
                assert callers.got == {}
                dog.advance(0.001)  # the leader's 1 s
                # its own run, on the other replica, while the first batch still hangs
                await callers.answered["follower"].wait()
                assert callers.got["follower"][0] == 11.0
                assert not model.released.is_set()
                model.release()
            stats, cache = flow(rt), rt.cache_statistics()
            used = rt.tenant_statistics()["t"]["credits_used"]
    finally:
        model.release()
    error, _ = callers.got["leader"]
    assert isinstance(error, DeadlineExceeded)
    assert RUNNING in str(error)
    assert not error.in_queue
    assert model.seen == [5.0, 5.0]
    assert (stats["dispatched"], stats["expired_running"], stats["expired"]) == (2, 1, 0)
    assert used == 2
    assert (cache["computations"], cache["coalesced"], cache["reruns"]) == (1, 1, 1)


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
