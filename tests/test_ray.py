"""Replicas on Ray (``execution = "ray"``): each replica a Ray actor, driven by the
batcher's worker feed as a worker process is. One local Ray for the module (two
CPUs); real clock throughout: the replicas run in Ray's processes, and the batch
deadline's watchdog keeps wall time."""

from __future__ import annotations

import logging
import os
import re

import numpy as np
import pytest
import trio
import trio.testing

ray = pytest.importorskip("ray")

import ray_models  # noqa: E402
import trioserve  # noqa: E402
from runtime_helpers import X, Y, call_all, config, item, pythonpath_with  # noqa: E402
from trioserve import (  # noqa: E402
    ActorClosed,
    CallableBackend,
    ModelConfig,
    ModelError,
    ModelLoadError,
    RayReplica,
)
from trioserve._builtin import resolve_backend  # noqa: E402
from trioserve._ray import wait_ref  # noqa: E402
from trioserve._ray_connect import start_ray  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
NAMESPACE = "trioserve-tests"


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        namespace=NAMESPACE,
        log_to_driver=False,
        # where the actors find ray_models
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath_with(TESTS)}},
    )
    yield
    ray.shutdown()


def actors() -> list[str]:
    """The names of the live Ray actors of replicas."""
    return sorted(
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("trioserve:")
    )


def on_ray(name: str = "m", **cfg) -> ModelConfig:
    """A model running ``ray_models.doubled`` on Ray, half a CPU per replica (two
    replicas fit the module's two CPUs)."""
    cfg.setdefault("ray", {"num_cpus": 0.5})
    backend = CallableBackend(ray_models.doubled, inputs=(X,), outputs=(Y,))
    return ModelConfig(name=name, backend=backend, execution="ray", **cfg)


async def test_mlp_on_two_ray_replicas_answers_as_the_model_does_here():
    cfg = config(ModelConfig(
        name="mlp", backend="mlp", execution="ray", replicas=2, max_batch_size=8,
        max_wait_ms=5.0, ray={"num_cpus": 0.5},
    ))
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(256).astype(np.float32) for _ in range(40)]
    local = resolve_backend(cfg.models[0]).load("cpu")
    want = [o["y"] for o in local([{"x": x} for x in xs])]
    async with trioserve.open_runtime(cfg) as rt:
        assert len(actors()) == 2
        assert [b.device for b in rt.models["mlp"].batchers] == ["cpu", "cpu"]
        one = await rt.infer("mlp", {"x": xs[0]})
        np.testing.assert_allclose(one["y"], want[0], rtol=1e-5, atol=1e-6)
        assert one["y"].flags.writeable  # the caller's own, not Ray's read-only view
        got: dict[int, np.ndarray] = {}

        async def batch(lo: int, hi: int) -> None:
            outs = await rt.infer_batch("mlp", [{"x": x} for x in xs[lo:hi]])
            got.update({lo + i: o["y"] for i, o in enumerate(outs)})

        async with trio.open_nursery() as nursery:
            for lo in range(0, 40, 10):
                nursery.start_soon(batch, lo, lo + 10)
        for i in range(40):
            np.testing.assert_allclose(got[i], want[i], rtol=1e-5, atol=1e-6)
        # both replicas ran batches
        assert all(b.device_seconds > 0 for b in rt.models["mlp"].batchers)
    assert actors() == []
    assert ray.is_initialized()  # the module's Ray: not started here, left running


async def test_a_model_error_on_ray_is_the_models_error_and_the_actor_goes_on():
    async with trioserve.open_runtime(config(on_ray(max_batch_size=1))) as rt:
        first = actors()
        with pytest.raises(ModelError, match=r"x\[0\] == -3 is refused"):
            await rt.infer("m", item(ray_models.RAISE))
        out = await rt.infer("m", item(4.0))
        assert float(out["y"][0]) == 8.0
        assert actors() == first  # the same actor: a model error replaces nothing
        assert rt.models["m"].batchers[0].workers_lost == 0


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (ray_models.INTERRUPT, "KeyboardInterrupt: the model's own"),
        (ray_models.BASE, "ModelsOwnBaseException: x[0] == -6"),
    ],
)
async def test_a_models_base_exception_on_ray_is_a_model_error_and_the_actor_goes_on(
    value, text
):
    """Not an Exception: it ended the actor's call as Ray's failure, not the
    model's error (a worker process and a thread replica answer it so)."""
    async with trioserve.open_runtime(config(on_ray(max_batch_size=1))) as rt:
        first = actors()
        with pytest.raises(ModelError, match=re.escape(text)):
            await rt.infer("m", item(value))
        out = await rt.infer("m", item(4.0))
        assert float(out["y"][0]) == 8.0
        assert actors() == first
        assert rt.models["m"].batchers[0].workers_lost == 0


async def test_an_actor_that_dies_mid_batch_is_replaced_and_its_batch_retried(caplog):
    caplog.set_level(logging.WARNING, logger="trioserve")
    cfg = config(on_ray(replicas=2, max_batch_size=4, max_wait_ms=20, timeout_ms=None))
    async with trioserve.open_runtime(cfg) as rt:
        before = actors()
        values = [1.0, 2.0, ray_models.CRASH, 3.0, 4.0, 5.0, 6.0, 7.0]
        results = await call_all(rt, "m", [item(v) for v in values])
        assert sorted(results) == list(range(len(values)))  # each answered, once
        for i, v in enumerate(values):
            out = results[i][0]
            if v == ray_models.CRASH:
                assert isinstance(out, ModelError)
                assert "poison request" in str(out)
            else:
                assert float(out["y"][0]) == 2 * v, (v, out)
        lost = sum(b.workers_lost for b in rt.models["m"].batchers)
        assert lost >= 2  # its first batch, and each run of it alone
        assert rt.statistics()["m"]["statuses"]["worker_lost"] == lost
        # fresh actors (a successor may still be starting: its breaker spaces them)
        assert not set(actors()) & set(before)
        out = await rt.infer("m", item(9.0))  # and they serve
        assert float(out["y"][0]) == 18.0
        names = {b.name for b in rt.models["m"].batchers}
    assert actors() == []
    # each loss logged once the actor was closed, as a Ray actor's, with no stderr
    # tail (Ray keeps an actor's output in its own logs)
    logged = [r.getMessage() for r in caplog.records if " lost: " in r.getMessage()]
    assert len(logged) == lost
    for line in logged:
        name, _, why = line.partition(": Ray actor lost: its Ray actor ")
        assert name in names, line
        assert why.startswith("died (pid "), line  # one wording, however found
        assert line.endswith("; a new one is started"), line


async def test_a_straggler_past_the_batch_deadline_is_killed_and_replaced():
    cfg = config(on_ray(
        max_batch_size=1, poison_attempts=1, batch_timeout_floor_ms=500.0,
        batch_timeout_cap_ms=500.0,
    ))
    async with trioserve.open_runtime(cfg) as rt:
        before = actors()
        start = trio.current_time()
        with pytest.raises(ModelError, match="poison request"):
            await rt.infer("m", item(ray_models.HANG))
        assert trio.current_time() - start < 30  # cut off, not waited for (60 s)
        batcher = rt.models["m"].batchers[0]
        assert batcher.stragglers == 1
        assert rt.statistics()["m"]["statuses"]["straggler"] == 1
        out = await rt.infer("m", item(3.0))  # by its successor
        assert float(out["y"][0]) == 6.0
        after = actors()
        assert len(after) == 1
        assert after != before


async def test_shutdown_with_batches_in_flight_answers_each_once_and_leaves_no_actor():
    cfg = config(
        on_ray(replicas=2, max_batch_size=2, max_wait_ms=0.0, timeout_ms=None),
        graceful_timeout_s=0.1,
    )
    results: dict[int, object] = {}
    async with trio.open_nursery() as nursery:
        async with trioserve.open_runtime(cfg) as rt:
            assert len(actors()) == 2

            async def one(i: int, v: float) -> None:
                try:
                    results[i] = await rt.infer("m", item(v))
                except ActorClosed as exc:
                    results[i] = exc

            for i in range(8):
                nursery.start_soon(one, i, ray_models.SLOW if i % 2 else float(i))
            # every caller waits, and each replica holds batches in its actor
            await trio.testing.wait_all_tasks_blocked()
            assert all(b._in_flight for b in rt.models["m"].batchers)
    assert sorted(results) == list(range(8))
    closed = [i for i, r in results.items() if isinstance(r, ActorClosed)]
    assert closed  # a 1.5 s batch does not end within a grace of 0.1 s
    for i, r in results.items():
        if not isinstance(r, ActorClosed):
            assert float(r["y"][0]) == 2 * i
    assert actors() == []


async def test_a_cancelled_wait_for_a_batch_abandons_it_and_the_actor_is_closed():
    m = on_ray(max_batch_size=1)
    replica = RayReplica(m, m.backend, "cpu", 1, name="m#0")
    await replica.start()
    try:
        assert replica.alive
        assert isinstance(replica.pid, int)
        await replica.submit([item(ray_models.SLOW)])
        with trio.move_on_after(0.2) as scope:
            await replica.result()
        assert scope.cancelled_caught
        assert replica.in_flight == 1  # still the actor's: abandoned, not lost
    finally:
        await replica.aclose()
    assert not replica.alive
    assert actors() == []
    with pytest.raises(RayReplica.Died):
        await replica.submit([item(1.0)])


async def test_wait_ref_is_a_checkpoint_and_cancellable_while_a_task_runs():
    @ray.remote
    def slow(x: float) -> float:
        import time

        time.sleep(1.0)
        return 2 * x

    ref = slow.remote(2.0)
    with trio.move_on_after(0.05) as scope:
        await wait_ref(ref)
    assert scope.cancelled_caught
    assert await wait_ref(ref) == 4.0
    # a ref whose value is in: answered, still at a checkpoint
    with trio.CancelScope() as cancelled:
        cancelled.cancel()
        await wait_ref(ref)
    assert cancelled.cancelled_caught


async def test_a_runtime_leaves_a_ray_it_did_not_start_alone():
    assert not await start_ray(trioserve.RayConfig())  # connected already: not ours
    assert ray.is_initialized()


async def test_a_replica_whose_model_fails_to_load_on_ray_is_a_model_load_error():
    cfg = config(ModelConfig(
        name="m", backend="ray_models:fails_to_load", execution="ray", ray={"num_cpus": 0.5},
    ))
    with pytest.raises(ModelLoadError, match="failed to load: RuntimeError: no weights for cpu"):
        async with trioserve.open_runtime(cfg):
            pass
    assert actors() == []


@pytest.mark.parametrize(
    ("options", "asked", "has"),
    [
        ({"num_cpus": 4}, "CPU 4", "CPU 2"),
        ({"num_cpus": 0.5, "num_gpus": 1}, "CPU 0.5, GPU 1", "CPU 2, GPU 0"),
        ({"num_cpus": 0.5, "resources": {"tpu_pod": 1}}, "CPU 0.5, tpu_pod 1", "tpu_pod 0"),
    ],
)
async def test_an_actor_no_node_of_a_local_ray_can_hold_fails_the_start_at_once(
    options, asked, has, caplog
):
    """The module's Ray is a local one, started in this process (two CPUs, no GPU):
    no node will ever join it. An actor it cannot hold used to wait out the model's
    load_timeout_s (600 s by default) and fail saying only that the replica did not
    load in time."""
    caplog.set_level(logging.INFO, logger="trioserve")
    cfg = config(on_ray(ray=options, load_timeout_s=20.0))
    t0 = trio.current_time()
    with pytest.raises(ModelLoadError) as raised:
        async with trioserve.open_runtime(cfg):
            pass
    message = str(raised.value)
    assert "could never be placed" in message, message
    assert f"it asks for {asked}" in message
    assert has in message
    assert "models.m.ray" in message
    assert trio.current_time() - t0 < 10  # not the load timeout
    assert actors() == []
    device = "cuda:0" if options.get("num_gpus") else "cpu"
    assert f"model 'm': loading 1 replica (ray on {device})" in caplog.text


async def test_a_replica_ray_has_no_room_for_in_time_says_its_actor_was_never_placed():
    """The node holds two CPUs, which the first model takes: the second model's actor
    fits the node but waits for a CPU, past its load_timeout_s. The error says why."""
    cfg = config(
        on_ray("big", ray={"num_cpus": 2}),
        on_ray("m", ray={"num_cpus": 1}, load_timeout_s=1.5),
    )
    with pytest.raises(ModelLoadError) as raised:
        async with trioserve.open_runtime(cfg):
            pass
    message = str(raised.value)
    assert message.startswith("model 'm': replica 0 on cpu did not load within 1.5 s "), message
    assert "its Ray actor was never placed: no node had CPU 1 free for it" in message
    assert actors() == []


async def test_a_model_timeout_passing_in_a_running_ray_batch_is_answered_then():
    """The batch holding a realtime request (its class's 200 ms timeout) and a batch
    one takes 1.5 s in its actor (cut-off 3 s): the first caller gets
    DeadlineExceeded at 200 ms, the second its result when the batch ends."""
    cfg = trioserve.Config(
        models=(on_ray(
            max_batch_size=2, max_wait_ms=10_000, timeout_ms=5_000.0,
            batch_timeout_floor_ms=3_000.0, batch_timeout_cap_ms=3_000.0,
        ),),
        classes=(
            trioserve.ClassConfig(name="realtime", timeout_ms=200.0),
            trioserve.ClassConfig(name="batch"),
        ),
        tenants=(trioserve.TenantConfig(name="t", default=True),),
    )
    got: dict[str, tuple[object, float]] = {}
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()

        async def one(v: float, cls: str) -> None:
            try:
                out: object = await rt.infer("m", item(v), priority=cls)
            except trioserve.DeadlineExceeded as exc:
                out = exc
            got[cls] = (out, trio.current_time() - t0)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, ray_models.SLOW, "realtime")
                nursery.start_soon(one, 1.0, "batch")
        flows = rt.statistics()["m"]["flows"]
    error, at = got["realtime"]
    assert isinstance(error, trioserve.DeadlineExceeded)
    assert "deadline passed while its batch was running" in str(error)
    assert 0.2 <= at < ray_models.SLOW_S  # while the batch ran
    out, done = got["batch"]
    assert float(out["y"][0]) == 2.0
    assert done >= ray_models.SLOW_S
    assert flows["t/realtime"]["expired_running"] == 1


def test_a_local_ray_started_here_lives_until_stopped_and_writes_no_info_lines():
    """A local Ray's head processes (GCS, raylet) get Linux's parent-death signal
    when the *thread* that started them ends. Started from one of trio's worker
    threads, they were killed when it went idle (10 s after ``ray.init``): the
    actors answered on, but the process's Ray threads spun retrying the GCS, took
    the GIL from the event loop (batches stalled for most of a second), and Ray
    ends a driver that cannot reach its GCS for a minute. Here, in a process of
    its own, trio's idle threads end after 0.1 s, and the local Ray lives on until
    it is stopped. Its INFO lines ("Started a local Ray instance") are not written
    to stderr either."""
    import subprocess
    import sys

    script = (
        "import time, trio, ray\n"
        "import trio._core._thread_cache as cache\n"
        "from trioserve import RayConfig\n"
        "from trioserve._ray_connect import start_ray, stop_ray\n"
        "cache.IDLE_TIMEOUT = 0.1\n"
        "async def main():\n"
        "    assert await start_ray(RayConfig())\n"
        "    await trio.sleep(2)\n"
        "    node = ray._private.worker._global_node\n"
        "    processes = [(name, info.process) for name, infos in node.all_processes.items()\n"
        "                 for info in infos]\n"
        "    assert any(name == 'gcs_server' for name, _ in processes)\n"
        "    print(sorted(name for name, p in processes if p.poll() is not None))\n"
        "    await stop_ray()\n"
        "trio.run(main)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"  # none of its processes ended
    assert "Started a local Ray instance" not in out.stderr
    assert not [line for line in out.stderr.splitlines() if "\tINFO " in line]
