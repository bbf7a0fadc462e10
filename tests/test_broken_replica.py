"""A replica whose model raises on every call while the model's other replicas
succeed (a sticky CUDA error, a bad device) is isolated by its circuit breaker, and a
worker process is replaced; a model that raises everywhere opens no breaker, and its
callers get its error at once, as before.

The breaker's decision is sans-IO (``Breaker.raised``, explicit times and counts);
the runtime tests send requests one at a time, so the order of the answers is the
order in which the batchers saw the outcomes, and the number of callers that got an
error is exactly what the design says."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import (
    ILLEGAL_ACCESS,
    X,
    Y,
    broken_once_config,
    callable_model,
    config,
    item,
    successor_up,
)
from trioserve import ModelConfig, ModelError
from trioserve.actors import Breaker

TESTS = os.path.dirname(os.path.abspath(__file__))
THRESHOLD = Breaker().threshold  # 5


# ---------------------------------------------------------------- sans-IO decisions
def test_a_raise_counts_only_once_another_replica_succeeded_since_the_run_began():
    br = Breaker(threshold=3, cooldown=1.0, max_cooldown=3.0)
    assert not br.raised(0.0, 10)  # the run begins: no evidence
    for _ in range(10):
        assert not br.raised(0.0, 10)  # nothing succeeded anywhere since
    assert br.failures == 0
    assert not br.raised(0.0, 11)  # another replica succeeded: counts
    assert not br.raised(0.0, 11)  # still evidence (a success of its own ends the run)
    assert br.failures == 2
    assert br.raised(5.0, 11)  # the third opens it, for the cooldown
    assert br.is_open(5.9)
    assert not br.is_open(6.0)
    assert br.raised(6.0, 12)  # the half-open trial raised: open twice as long
    assert br.open_until == 8.0
    br.success()  # a trial that succeeds closes it and ends the run
    assert not br.is_open(6.0)
    assert br.failures == 0
    assert not br.raised(9.0, 12)  # a new run: its first raise is no evidence
    assert not br.raised(9.0, 12)
    assert not br.raised(9.0, 13)  # counts, from the base cooldown again
    assert br.failures == 1
    assert not br.raised(9.0, 13)
    assert br.raised(9.0, 13)
    assert br.open_until == 10.0


def test_a_raise_while_the_breaker_is_open_does_not_open_it_again():
    """A worker process holds several batches staged: one staged before the breaker
    opened can raise alone after, on the same failures. It counted as a second
    opening: the cooldown doubled, and the worker's successor waited it out
    instead of running its trial at once (``replaced``)."""
    br = Breaker(threshold=2, cooldown=1.0, max_cooldown=8.0)
    assert not br.raised(0.0, 10)
    assert not br.raised(0.0, 11)
    assert br.raised(0.0, 11)  # opened, until 1.0
    assert not br.raised(0.5, 12)  # a staged batch's raise while open: not new
    assert (br.openings, br.open_until) == (1, 1.0)
    br.replaced(0.5)  # the worker is replaced: its successor's trial comes at once
    assert not br.is_open(0.5)
    assert br.half_open(0.5)
    assert br.raised(1.0, 13)  # the trial raised: it opens again, twice as long
    assert (br.openings, br.open_until) == (2, 3.0)


def test_a_model_that_never_succeeds_anywhere_never_opens_a_breaker():
    br = Breaker(threshold=2)
    for i in range(100):
        assert not br.raised(float(i), 7)
    assert br.failures == 0
    assert br.open_until == -math.inf


def test_stragglers_and_counted_raises_make_one_run():
    br = Breaker(threshold=3)
    br.failure(0.0)  # a straggler
    assert not br.raised(0.0, 0)  # first raise: no evidence yet
    assert not br.raised(0.0, 1)  # evidence: the second failure in a row
    assert br.raised(0.0, 1)  # the third
    assert br.is_open(0.5)


# ---------------------------------------------------------------- worker threads
class PerDevice(trioserve.ModelBackend):
    """A model run in worker threads whose replicas on the devices in ``broken``
    raise on every call (an illegal memory access: the CUDA context is gone), and
    whose others answer ``y = [their device's index]``."""

    inputs = (X,)
    outputs = (Y,)
    default_execution = "thread"

    def __init__(self, broken: set[str]) -> None:
        self.broken = broken

    def load(self, device, *, torch_threads=1):
        index = float(device.partition(":")[2])

        def run(items):
            if device in self.broken:
                raise RuntimeError(ILLEGAL_ACCESS)
            return [{"y": np.array([index], dtype=np.float32)} for _ in items]

        return run


def per_device(
    broken: set[str], replicas: int = 2, max_batch_size: int = 1
) -> tuple[PerDevice, ModelConfig]:
    """The model, with a replica on each of cpu:0, cpu:1, ..."""
    backend = PerDevice(broken)
    devices = tuple(f"cpu:{i}" for i in range(replicas))
    return backend, ModelConfig(
        name="m", backend=backend, devices=devices, max_batch_size=max_batch_size,
        max_wait_ms=0,
    )


def test_a_replaced_worker_skips_only_the_first_cooldown_since_the_last_success():
    br = Breaker(threshold=2, cooldown=1.0, max_cooldown=8.0)
    br.failure(0.0)
    br.failure(0.0)  # opens (its first opening since a success)
    assert br.open_until == 1.0
    run = br.run
    br.replaced(0.0)  # the worker is replaced: its successor tries at once
    assert not br.is_open(0.0)
    assert br.run == run + 1  # what was marked against the old worker is stale
    assert not br.confirmed(0.0, run)
    br.failure(0.5)  # the successor's trial fails: open for twice as long
    assert br.open_until == 2.5
    br.replaced(0.5)  # replaced again: this time it waits out the cooldown
    assert br.is_open(2.4)
    assert not br.is_open(2.5)
    br.success()
    br.failure(3.0)
    br.failure(3.0)  # a new first opening since a success: the cooldown is the base
    assert br.open_until == 4.0
    br.replaced(3.0)
    assert not br.is_open(3.0)


async def one_at_a_time(rt, outcomes: list, *, until, most: int = 200) -> None:
    """Send requests one after the other until ``until()``, appending to
    ``outcomes`` what each caller got: "error" (ModelError) or the y[0] it was
    answered with."""
    for _ in range(most):
        if until():
            return
        try:
            out = await rt.infer("m", item(1.0))
        except ModelError as exc:
            error = str(exc)
        else:
            outcomes.append(float(out["y"][0]))
            continue
        assert ILLEGAL_ACCESS in error
        outcomes.append("error")
    raise AssertionError(f"not after {most} requests: {outcomes}")


def errors_before_evidence(outcomes: list) -> int:
    """The errors up to the first success that followed the first error: those the
    breaker could not count (nothing had succeeded elsewhere since its run began)."""
    first = outcomes.index("error")
    rest = outcomes[first:]
    return rest.index(next(o for o in rest if o != "error"))


async def seen_from_outside(rt, client) -> dict:
    """What an operator sees of model ``m``: ``rt.health()``'s replicas, the
    ``trioserve_replicas`` samples that are not 0 (``rt.statistics()``'s
    ``replica_health`` checked equal to all of them), and the status of
    ``/v2/health/ready`` and ``/v2/models/m/ready``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await (await client.get("/metrics")).get_data()).decode()
    (family,) = [f for f in text_string_to_metric_families(text)
                 if f.name == "trioserve_replicas"]
    samples = {s.labels["health"]: s.value for s in family.samples
               if s.labels["model"] == "m"}
    assert set(samples) >= {"ready", "half_open", "open"}  # each one from the start
    # rt.statistics() counts them as the gauge does (every health, 0 when none has
    # it), and names each replica's health as rt.health() does
    stats = rt.statistics()["m"]
    assert stats["replica_health"] == {h: int(v) for h, v in samples.items()}
    assert {r["name"]: r["health"] for r in stats["replicas"]} == rt.health()["m"]["replicas"]
    return {
        "replicas": rt.health()["m"]["replicas"],
        "metrics": {h: int(v) for h, v in samples.items() if v},
        "ready": ((await client.get("/v2/health/ready")).status_code,
                  (await client.get("/v2/models/m/ready")).status_code),
    }


async def test_an_operator_sees_a_breaker_open_then_on_probation_then_closed(mock_clock):
    """The breaker of a replica whose model raises there (cpu:0) while cpu:1 serves:
    open (pulls nothing), half-open once its cooldown passed (pulls on probation),
    open again after a trial that fails, and closed after one that succeeds. Each
    state shows in ``rt.health()`` and in ``trioserve_replicas``; the model stays
    ready throughout (the sound replica)."""
    from trioserve.transport import Gateway

    backend, model = per_device({"cpu:0"})
    async with trioserve.open_runtime(config(model)) as rt:
        client = Gateway(rt).app.test_client()
        broken, sound = rt.models["m"].batchers
        b, s = broken.name, sound.name
        assert await seen_from_outside(rt, client) == {
            "replicas": {b: "ready", s: "ready"}, "metrics": {"ready": 2},
            "ready": (200, 200),
        }
        await one_at_a_time(rt, [], until=lambda: broken._breaker.is_open(trio.current_time()))
        opened = await seen_from_outside(rt, client)
        assert not broken.ready

        mock_clock.jump(1.0)  # its cooldown passed
        await trio.testing.wait_all_tasks_blocked()
        probation = await seen_from_outside(rt, client)
        assert broken.ready  # it takes work: its trial
        await one_at_a_time(rt, [], until=lambda: broken._breaker.is_open(trio.current_time()))
        reopened = await seen_from_outside(rt, client)

        backend.broken.clear()  # its device recovers
        mock_clock.jump(2.0)  # the doubled cooldown
        await trio.testing.wait_all_tasks_blocked()
        second = await seen_from_outside(rt, client)
        healed: list = []
        await one_at_a_time(rt, healed, until=lambda: 0.0 in healed)  # its good batch
        closed = await seen_from_outside(rt, client)
    assert opened == {"replicas": {b: "open", s: "ready"},
                      "metrics": {"open": 1, "ready": 1}, "ready": (200, 200)}
    assert probation == {"replicas": {b: "half_open", s: "ready"},
                         "metrics": {"half_open": 1, "ready": 1}, "ready": (200, 200)}
    assert reopened == opened
    assert second == probation
    assert closed == {"replicas": {b: "ready", s: "ready"}, "metrics": {"ready": 2},
                      "ready": (200, 200)}


async def test_a_lone_replicas_open_breaker_fails_readiness_and_its_probation_passes_it(
    mock_clock,
):
    """A model's only replica: while its breaker is open the model is not ready (503
    on both probes), and once the cooldown passed it is again (half-open: it must
    take work for its trial to run); a good batch closes the breaker. The breaker is
    opened as a run of five stragglers would (its sans-IO ``failure``)."""
    from trioserve.transport import Gateway

    m = callable_model("m", lambda items: [{"y": it["x"]} for it in items],
                       execution="thread", max_wait_ms=0)
    async with trioserve.open_runtime(config(m)) as rt:
        client = Gateway(rt).app.test_client()
        (replica,) = rt.models["m"].batchers
        name = replica.name
        for _ in range(THRESHOLD):
            replica._breaker.failure(trio.current_time())
        opened = await seen_from_outside(rt, client)
        opened_ready = rt.model_ready("m")
        mock_clock.jump(1.0)
        probation = await seen_from_outside(rt, client)
        probation_ready = rt.model_ready("m")
        assert float((await rt.infer("m", item(2.0)))["y"][0]) == 2.0
        closed = await seen_from_outside(rt, client)
    assert (opened, opened_ready) == ({"replicas": {name: "open"}, "metrics": {"open": 1},
                                       "ready": (503, 503)}, False)
    assert (probation, probation_ready) == ({"replicas": {name: "half_open"},
                                             "metrics": {"half_open": 1},
                                             "ready": (200, 200)}, True)
    assert closed == {"replicas": {name: "ready"}, "metrics": {"ready": 1},
                      "ready": (200, 200)}


async def test_a_broken_thread_replica_is_isolated_and_its_trial_reopens_or_closes_it(
    mock_clock,
):
    """Replica cpu:0 raises on every call, cpu:1 is sound. cpu:0 kept pulling fresh
    batches and failing them for ever (a model raise never counted), so about half of
    all callers got the error. Now its breaker opens after the errors it could not
    count plus ``threshold``; then the sound replica answers everyone. The clock
    stands still unless the test moves it."""
    backend, model = per_device({"cpu:0"})
    async with trioserve.open_runtime(config(model)) as rt:
        broken, sound = rt.models["m"].batchers
        outcomes: list = []
        await one_at_a_time(rt, outcomes, until=lambda: broken.health == "open")
        errors = outcomes.count("error")
        # The first error begins the run; until the sound replica answers, the
        # broken one's errors are no evidence; after that the breaker counts each one.
        assert errors == errors_before_evidence(outcomes) + THRESHOLD
        assert outcomes[-1] == "error"  # the one that opened it
        assert set(outcomes) == {"error", 1.0}
        assert rt.model_ready("m")  # the sound replica serves
        assert rt.health()["m"]["replicas"] == {broken.name: "open", sound.name: "ready"}

        served: list = []
        await one_at_a_time(rt, served, until=lambda: len(served) == 20)
        assert served == [1.0] * 20  # while open, nobody gets the error

        # After the cooldown one batch is tried: it raises again, and counts (the
        # other replica still succeeds): open again, for twice as long.
        opened_at = trio.current_time()
        assert broken._breaker.open_until == opened_at + 1.0
        mock_clock.jump(1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert broken.health == "half_open"  # on probation: it pulls again
        assert broken.ready
        trial: list = []
        await one_at_a_time(rt, trial, until=lambda: "error" in trial)
        assert broken.health == "open"
        assert broken._breaker.open_until == opened_at + 1.0 + 2.0

        # Its device recovers: the next trial succeeds and closes the breaker.
        backend.broken.clear()
        mock_clock.jump(1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert broken.health == "open"  # a second of the two to go
        mock_clock.jump(1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert broken.health == "half_open"
        healed: list = []
        await one_at_a_time(rt, healed, until=lambda: 0.0 in healed)
        assert set(healed) <= {0.0, 1.0}  # no error
        assert broken.health == "ready"
        assert broken._breaker.failures == 0
        statuses = rt.statistics()["m"]["statuses"]
        assert statuses["model_error"] == errors + 1
        assert "worker_broken" not in statuses  # a thread cannot be replaced


@pytest.mark.parametrize("replicas", [1, 2])
async def test_a_model_that_raises_everywhere_opens_no_breaker(mock_clock, replicas):
    """Every caller gets the model's error at once (the clock never moves), one at a
    time or many together (batches split and retried), and every replica stays
    ready: nothing succeeded anywhere, so no raise is the replica's doing."""
    _, model = per_device({f"cpu:{i}" for i in range(replicas)}, replicas, max_batch_size=4)
    async with trioserve.open_runtime(config(model)) as rt:
        outcomes: list = []
        await one_at_a_time(rt, outcomes, until=lambda: len(outcomes) == 30)
        assert outcomes == ["error"] * 30
        got: list = []

        async def one() -> None:
            with pytest.raises(ModelError, match=ILLEGAL_ACCESS):
                await rt.infer("m", item(2.0))
            got.append("error")

        async with trio.open_nursery() as nursery:
            for _ in range(40):
                nursery.start_soon(one)
        assert got == ["error"] * 40
        assert trio.current_time() == 0.0
        for b in rt.models["m"].batchers:
            assert b.health == "ready"
            assert b._breaker.failures == 0
        assert rt.model_ready("m")
        assert rt.statistics()["m"]["statuses"]["model_error"] == 70


# ---------------------------------------------------------------- worker processes
async def test_a_broken_worker_process_is_replaced_and_its_replica_serves_again(
    mock_clock, monkeypatch, tmp_path
):
    """One of two worker processes raises on every call from its first (a sticky CUDA
    error lives as long as its process). Its breaker opens after the errors it could
    not count plus ``threshold``, its worker is killed and a fresh one forked from the
    zygote (a fresh CUDA context), which runs the trial at once (the breaker's first
    opening) and serves again. Real processes."""
    cfg, flag = broken_once_config(monkeypatch, tmp_path, max_batch_size=1)
    replaced = successor_up(monkeypatch)
    async with trioserve.open_runtime(cfg) as rt:
        batchers = rt.models["m"].batchers
        first = {b: b._worker.pid for b in batchers}
        outcomes: list = []
        await one_at_a_time(rt, outcomes, until=lambda: any(b.workers_broken for b in batchers))
        [broken] = [b for b in batchers if b.workers_broken]
        [sound] = [b for b in batchers if b is not broken]
        assert not flag.exists()  # taken by the broken worker
        errors = outcomes.count("error")
        assert errors == errors_before_evidence(outcomes) + THRESHOLD
        assert outcomes[-1] == "error"
        sound_pid = float(first[sound])
        assert set(outcomes) == {"error", sound_pid}
        assert broken.workers_broken == 1
        assert broken.workers_lost == 0  # it did not die: it was replaced

        # The breaker's first opening: its successor runs the trial at once (the
        # clock does not move), and serves.
        assert broken._breaker.open_until == trio.current_time()
        await replaced.wait()
        assert broken.health == "half_open"  # the successor's trial
        await one_at_a_time(rt, outcomes, until=lambda: outcomes[-1] not in ("error", sound_pid))
        successor = broken._worker.pid
        assert successor != first[broken]
        assert outcomes[-1] == float(successor)
        assert outcomes.count("error") == errors  # no error since
        assert broken.health == "ready"
        assert broken._breaker.failures == 0
        assert rt.model_ready("m")
        stats = rt.statistics()["m"]["statuses"]
        assert stats["worker_broken"] == 1
        assert stats["model_error"] == errors
        assert "worker_lost" not in stats


class TellingBreaker(Breaker):
    """A Breaker recording the model raises it was told of: (now, successes)."""

    def __init__(self) -> None:
        super().__init__()
        self.raises: list[tuple[float, int]] = []

    def raised(self, now: float, successes: int, **kw) -> bool:
        self.raises.append((now, successes))
        return super().raised(now, successes, **kw)


async def test_only_a_raise_on_fresh_work_is_told_to_the_breaker(monkeypatch):
    """The parts of a batch that raised, run again, are retries: their raise is their
    requests' doing (the input that raises), not the replica's."""
    monkeypatch.setattr(trioserve.actors, "Breaker", TellingBreaker)

    def picky(items):
        if any(float(it["x"][0]) == 13.0 for it in items):
            raise ValueError("cannot take 13")
        return [{"y": it["x"]} for it in items]

    cfg = config(callable_model("m", picky, max_batch_size=8, max_wait_ms=1))
    async with trioserve.open_runtime(cfg) as rt:
        await rt.infer_batch("m", [item(v) for v in range(3)])  # one batch succeeds
        with pytest.raises(ModelError, match="cannot take 13"):
            await rt.infer_batch("m", [item(v) for v in range(8, 16)])
        breaker = rt.models["m"].batchers[0]._breaker
        # the batch of 8, not its 8 parts (13 alone among them)
        assert [successes for _, successes in breaker.raises] == [1]
        assert rt.statistics()["m"]["statuses"]["retried"] == 8
        assert breaker.failures == 0
