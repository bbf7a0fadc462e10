"""Poison inputs do not isolate a sound replica: a model that raises on some inputs
(here, negative ones) raises on every replica that runs them, so a replica's raises
on a batch holding one are its inputs' doing, not its own. Only evidence that the
replica fails on sound input counts towards its breaker (docs/faults.md, "A broken
replica"): a request that raised alone there and was answered by another replica,
or a request alone on fresh work while another replica succeeded (nothing else can
be known of it).

Many callers send a seeded mix of good and bad requests to worker-thread replicas
(``mock_clock``: the clock stands still, so no breaker's cooldown passes unseen),
with batches of several requests. Before, a sound replica whose fresh batch raised
counted that raise whenever another replica had succeeded since its first raise, so
a few unlucky draws in a row (its own parts happening to be the bad ones) opened its
breaker: with 3 replicas and batches of 2, at 50% and 70% bad requests."""

from __future__ import annotations

import math
import os
import random

import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import (
    DEVICE_LOST,
    ILLEGAL_ACCESS,
    LosesItsDevice,
    X,
    Y,
    breaks_its_device,
    broken_once_config,
    callable_model,
    config,
    item,
    pythonpath_with,
    successor_up,
)
from trioserve import ModelConfig, ModelError, Request
from trioserve.actors import BatchLimits, Breaker, FairQueue, SchedulerActor
from trioserve.actors._scheduler import ELSEWHERE_RECHECK

TESTS = os.path.dirname(os.path.abspath(__file__))
CLIENTS = 32
PER_CLIENT = 25


class OpeningBreaker(Breaker):
    """A Breaker recording each time it (re)opened: the instance."""

    opened: list[Breaker]

    def failure(self, now: float) -> None:
        super().failure(now)
        if self.failures >= self.threshold:
            OpeningBreaker.opened.append(self)


@pytest.fixture
def opened(monkeypatch) -> list[Breaker]:
    monkeypatch.setattr(trioserve.actors, "Breaker", OpeningBreaker)
    OpeningBreaker.opened = []
    return OpeningBreaker.opened


class Picky(trioserve.ModelBackend):
    """A model run in worker threads that raises ValueError on a batch holding a
    negative input (on every replica) and otherwise answers ``y = x``; its
    replicas on the devices in ``broken`` raise on every call."""

    inputs = (X,)
    outputs = (Y,)
    default_execution = "thread"

    def __init__(self, broken: frozenset[str] = frozenset()) -> None:
        self.broken = broken

    def load(self, device, *, torch_threads=1):
        def run(items):
            if device in self.broken:
                raise RuntimeError(ILLEGAL_ACCESS)
            for it in items:
                if it["x"][0] < 0:
                    raise ValueError(f"negative input {float(it['x'][0])}")
            return [{"y": it["x"].copy()} for it in items]

        return run


def picky(replicas: int, max_batch_size: int, broken: frozenset[str] = frozenset()):
    return config(
        ModelConfig(
            name="m", backend=Picky(broken), devices=tuple(f"cpu:{i}" for i in range(replicas)),
            max_batch_size=max_batch_size, max_wait_ms=0,
        )
    )


def traffic(bad: float, seed: int) -> list[list[float]]:
    """Each client's values: positive, or negative (bad) with probability ``bad``."""
    rng = random.Random(seed)
    return [
        [rng.uniform(1, 10) * (-1 if rng.random() < bad else 1) for _ in range(PER_CLIENT)]
        for _ in range(CLIENTS)
    ]


async def send(rt, values: list[list[float]]) -> dict[tuple[int, int], object]:
    """Every client sends its values one after the other, all clients at once;
    returns what each request got: its y[0], or its ModelError's message."""
    got: dict[tuple[int, int], object] = {}

    async def client(c: int) -> None:
        for j, v in enumerate(values[c]):
            try:
                out = await rt.infer("m", item(v))
            except ModelError as exc:
                got[c, j] = str(exc)
            else:
                got[c, j] = float(out["y"][0])

    async with trio.open_nursery() as nursery:
        for c in range(CLIENTS):
            nursery.start_soon(client, c)
    return got


@pytest.mark.parametrize("bad", [0.2, 0.5, 0.7])
@pytest.mark.parametrize(("replicas", "max_batch_size"), [(3, 2), (2, 4), (3, 8)])
async def test_poison_inputs_open_no_breaker_of_a_sound_replica(
    mock_clock, opened, bad, replicas, max_batch_size
):
    values = traffic(bad, seed=7)
    async with trioserve.open_runtime(picky(replicas, max_batch_size)) as rt:
        got = await send(rt, values)
        assert opened == []
        for b in rt.models["m"].batchers:
            assert b.health == "ready"
        stats = rt.statistics()["m"]
    assert len(got) == CLIENTS * PER_CLIENT  # nothing lost
    n_bad = 0
    for (c, j), answer in got.items():
        v = values[c][j]
        if v < 0:
            n_bad += 1
            assert isinstance(answer, str)
            assert "ValueError: negative input" in answer
        else:
            assert answer == pytest.approx(v)
    assert n_bad > 0
    assert stats["statuses"]["model_error"] == n_bad  # only the bad ones
    assert trio.current_time() == 0.0


async def test_a_broken_replica_among_poison_inputs_is_isolated_and_only_it(
    mock_clock, opened
):
    """cpu:0 raises on every call, cpu:1 and cpu:2 are sound, and 30% of the
    requests are bad. The broken replica's breaker opens (the parts of its failed
    batches it ran alone, answered by the others, are the evidence); the sound
    ones' never do. A bad request gets the model's error; a good one its value, or
    the broken replica's error if it ran there alone on fresh work (nothing else
    can be known of it then)."""
    cfg = picky(3, 4, broken=frozenset({"cpu:0"}))
    values = traffic(0.3, seed=11)
    async with trioserve.open_runtime(cfg) as rt:
        broken, *sound = rt.models["m"].batchers
        got = await send(rt, values)
        assert opened
        assert {id(b) for b in opened} == {id(broken._breaker)}
        assert broken.health == "open"
        assert [b.health for b in sound] == ["ready", "ready"]
        assert len(got) == CLIENTS * PER_CLIENT
        for (c, j), answer in got.items():
            v = values[c][j]
            if v < 0:
                assert isinstance(answer, str)
                assert "ValueError: negative input" in answer or ILLEGAL_ACCESS in answer
            else:
                assert answer == pytest.approx(v) or ILLEGAL_ACCESS in str(answer)
        assert sum(ILLEGAL_ACCESS in str(a) for a in got.values()) < len(got) // 10

        # While it is open (the clock stands still) the sound replicas answer all.
        again = await send(rt, values)
        for (c, j), answer in again.items():
            v = values[c][j]
            if v < 0:
                assert "ValueError: negative input" in str(answer)
            else:
                assert answer == pytest.approx(v)


def test_a_batch_that_raises_is_no_evidence_but_its_part_answered_elsewhere_is():
    br = Breaker(threshold=2)
    assert not br.raised(0.0, 5, alone=False)  # the run begins
    for s in range(6, 20):
        assert not br.raised(0.0, s, alone=False)  # others succeed: still no evidence
    assert br.failures == 0
    run = br.run
    assert not br.confirmed(1.0, run)  # a part that raised alone here was answered
    assert br.confirmed(1.0, run)  # elsewhere: counts; the second opens it
    assert br.open_until == 2.0
    br.success()  # it succeeded since: a mark of the old run is stale
    assert not br.confirmed(3.0, run)
    assert br.failures == 0


async def test_a_broken_worker_process_is_replaced_on_the_evidence_of_its_parts(
    mock_clock, monkeypatch, tmp_path
):
    """One of two worker processes raises on every call; requests come many at a
    time, in batches of up to 4, so its raises are batches of several (no evidence
    by themselves) and the evidence is their parts that raised alone there and were
    answered by the other replica. Its breaker opens and its worker is replaced.
    Real processes."""
    cfg, flag = broken_once_config(monkeypatch, tmp_path, max_batch_size=4)
    replaced = successor_up(monkeypatch)
    async with trioserve.open_runtime(cfg) as rt:
        batchers = rt.models["m"].batchers
        got = await send(rt, [[1.0] * 8 for _ in range(CLIENTS)])
        assert not flag.exists()  # taken by the broken worker
        assert sorted(b.workers_broken for b in batchers) == [0, 1]
        assert all(b.workers_lost == 0 for b in batchers)
        assert len(got) == CLIENTS * 8
        errors = sum(isinstance(a, str) for a in got.values())
        assert all(ILLEGAL_ACCESS in a for a in got.values() if isinstance(a, str))
        assert errors < len(got) // 4
        assert rt.statistics()["m"]["statuses"]["worker_broken"] == 1
        # The clock never moved: the successor runs the breaker's trial without
        # waiting out its first cooldown (a fresh process is the remedy), and passes.
        await replaced.wait()
        # the successor is on probation (half-open) until its first good batch
        assert sorted(b.health for b in batchers) == ["half_open", "ready"]
        assert all(b.ready for b in batchers)  # a replica on probation takes work
        again = await send(rt, [[1.0] * 4 for _ in range(CLIENTS)])
        assert not [a for a in again.values() if isinstance(a, str)]  # no errors
        assert all(b.ready for b in batchers)


class _Replica:
    """A puller as the scheduler sees one: ready or not."""

    def __init__(self, ready: bool = True) -> None:
        self.ready = ready


async def test_a_retry_left_to_a_replica_that_stops_being_ready_is_taken_back(autojump_clock):
    """A request that raised alone on replica A waits for another ready replica; A
    passes it by. If that replica stops being ready before it pulls (its breaker
    opens), nothing else would wake A (no arrival comes): A looks again after
    ELSEWHERE_RECHECK and runs it itself, rather than leave it to its deadline."""
    queue = FairQueue(BatchLimits(max_size=4), bound=16, model="m", adaptive=False)
    scheduler = SchedulerActor("m", queue)
    a, b = _Replica(), _Replica()
    scheduler.batchers = [a, b]
    scheduler.replicas = 2
    request = Request(
        model="m", item=None, cost=1, tenant="t", priority="default",
        arrival=0.0, deadline=math.inf, answer_expiry=False,
    )
    scheduler.submit_nowait(request)
    (pulled,) = await scheduler.pull(a)
    assert pulled is request
    scheduler.completed([request], failed=True)
    request.reply.suspect = request.reply.ran = True
    request.reply.raised_on = (a, 0)
    scheduler.retry([[request]])

    got: list[list] = []
    taken = trio.Event()

    async def pull_a() -> None:
        got.append(await scheduler.pull(a))
        taken.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pull_a)
        await trio.testing.wait_all_tasks_blocked()
        assert not got  # left to b, which is ready
        start = trio.current_time()
        b.ready = False  # b's breaker opens before it pulls
        with trio.fail_after(0.1):  # (never, without the look again)
            await taken.wait()
        assert trio.current_time() - start <= ELSEWHERE_RECHECK
    assert got == [[request]]


async def test_an_input_that_breaks_its_workers_device_is_poison_and_nothing_else_fails(
    mock_clock, monkeypatch
):
    """An input that leaves its worker's device unusable (a CUDA device-side assert:
    every later call in the process would fail, whatever its inputs). The worker
    finds its device lost after the raise and exits, so the batch is a lost
    worker's: bisected on fresh workers, the bad input answered as poison, every
    other request with its value, and no breaker opens. Without the check the
    worker stayed, failed everything, and broke the other replica too when its
    part ran there once (hundreds of good requests got the error). Real
    processes; tests/test_cuda.py has it on a GPU."""
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(TESTS))  # where breaks_its_device is
    cfg = config(
        callable_model(
            "m", breaks_its_device, execution="process", replicas=2, max_batch_size=4,
            max_wait_ms=0, timeout_ms=None,
        )
    )
    values = [[float(1 + c * PER_CLIENT + j) for j in range(PER_CLIENT)] for c in range(CLIENTS)]
    values[5][3] = -1.0
    async with trioserve.open_runtime(cfg) as rt:
        batchers = rt.models["m"].batchers
        got = await send(rt, values)
        assert rt.model_ready("m")
        lost = [b.workers_lost for b in batchers]
        again = await send(rt, [[2.0] * 4 for _ in range(CLIENTS)])
        assert set(again.values()) == {2.0}
    poison = got.pop((5, 3))
    assert "poison request" in poison
    assert DEVICE_LOST in poison
    assert got == {(c, j): values[c][j] for c, j in got}  # each its value, no error
    assert 1 <= sum(lost) <= 4  # the bad input's runs, each of which took a worker


async def test_a_thread_replica_whose_device_is_lost_serves_no_more(mock_clock, lose_devices):
    """A thread (or the event loop) cannot be given a fresh device context: the
    replica whose model left its device unusable answers its batch with the error
    (not retried: each run of that input would take one more device) and pulls no
    more; the other replica serves everything after, and the model stays ready."""
    cfg = config(
        ModelConfig(name="m", backend=LosesItsDevice(lose_devices), devices=("cpu:0", "cpu:1"),
                    max_batch_size=4, max_wait_ms=0)
    )
    async with trioserve.open_runtime(cfg) as rt:
        batchers = rt.models["m"].batchers
        with pytest.raises(ModelError, match="left it unusable") as info:
            await rt.infer("m", item(-1.0))
        assert DEVICE_LOST in str(info.value)
        [lost] = [b for b in batchers if b.health == "lost"]
        assert lose_devices == {lost.device}
        got = await send(rt, [[float(c + 1)] * 5 for c in range(CLIENTS)])
        assert got == {(c, j): float(c + 1) for c in range(CLIENTS) for j in range(5)}
        assert rt.model_ready("m")
        assert lost.lost is not None
        assert DEVICE_LOST in lost.lost
        stats = rt.statistics()["m"]["statuses"]
        assert stats["device_lost"] == 1
        assert stats["model_error"] == 1
        # Evidence from another replica no longer counts against it (nor is logged).
        failures = lost._breaker.failures
        for _ in range(10):
            lost._failed_here(lost._breaker.run)
        assert lost._breaker.failures == failures


async def test_a_lone_inline_replica_whose_device_is_lost_leaves_the_model_not_ready(
    autojump_clock, lose_devices
):
    """The model's only replica lost its device: the model is not ready, and its
    requests are refused at once with why (they waited out their deadlines)."""
    cfg = config(
        ModelConfig(name="m", backend=LosesItsDevice(lose_devices, "inline"), devices=("cpu",),
                    max_wait_ms=0, timeout_ms=1000)
    )
    async with trioserve.open_runtime(cfg) as rt:
        assert (await rt.infer("m", item(3.0)))["y"][0] == 3.0
        with pytest.raises(ModelError, match="left it unusable"):
            await rt.infer("m", item(-1.0))
        assert not rt.model_ready("m")
        assert rt.models["m"].batchers[0].health == "lost"
        start = trio.current_time()
        # Nothing serves it any more: refused at once, not held to its deadline.
        with pytest.raises(ModelError, match="no replica can serve it any more") as info:
            await rt.infer("m", item(3.0))
        assert DEVICE_LOST in str(info.value)
        assert trio.current_time() == start


async def test_a_retired_queue_answers_what_waits_and_refuses_what_comes_with_its_error():
    """What the last replica to lose its device does to its queue: everything waiting
    (queued, handed back for a retry) gets the error, each its own copy, and so does
    every request after; a shutdown later says so again as ActorClosed."""
    queue = FairQueue(BatchLimits(max_size=4), bound=16, model="m", adaptive=False)
    scheduler = SchedulerActor("m", queue)

    def request() -> Request:
        return Request(model="m", item=None, cost=1, tenant="t", priority="default",
                       arrival=0.0, deadline=math.inf, answer_expiry=False)

    waiting = [request() for _ in range(3)]
    for r in waiting:
        scheduler.submit_nowait(r)
    (first,) = [await scheduler.pull()]
    scheduler.completed(first, failed=True)
    scheduler.retry([first])
    queued = request()
    scheduler.submit_nowait(queued)
    error = ModelError("model 'm': no replica can serve it any more")
    assert scheduler.retire(error) == 4
    errors = [r.reply.error for r in [*waiting, queued]]
    assert all(isinstance(e, ModelError) and str(e) == str(error) for e in errors)
    assert len({id(e) for e in errors}) == 4  # each its own copy
    with pytest.raises(ModelError, match="no replica can serve it any more"):
        scheduler.submit_nowait(request())
    scheduler.close(trioserve.ActorClosed("shut down"))
    with pytest.raises(trioserve.ActorClosed):
        scheduler.submit_nowait(request())
