"""The blocking client: ``serve_in_thread`` runs the runtime on its own trio thread and
plain threads call it. These tests are synchronous and use the real clock."""

from __future__ import annotations

import pathlib
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import numpy as np
import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import GATE_LIMIT_S, Gate, Recorder, X, Y, callable_model, config, item
from trioserve import (
    ActorClosed,
    ClassConfig,
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    ModelConfig,
    TenantConfig,
)


@pytest.fixture
def gate():
    g = Gate()
    yield g
    g.release()


@pytest.fixture
def served(gate):
    """A runtime in a thread serving ``double`` (y = 2x + 1, in a worker thread),
    ``echo``, ``gated`` (held by ``gate``) and ``sleep`` (x[0] ms per item, 4
    replicas)."""
    cfg = config(
        callable_model("double", Recorder(timed=False), execution="thread", max_wait_ms=1),
        ModelConfig(name="echo", backend="echo", max_wait_ms=1),
        callable_model("gated", gate, execution="thread", max_batch_size=1, max_wait_ms=0),
        ModelConfig(
            name="sleep",
            backend="sleep",
            max_batch_size=1,
            max_wait_ms=0,
            devices=["cpu"],
            replicas=4,
        ),
    )
    with trioserve.serve_in_thread(cfg) as client:
        yield client


def test_eight_threads_each_get_their_own_results(served):
    def work(t: int) -> list[str]:
        wrong = []
        for i in range(25):
            v = t * 1000 + i
            out = served.infer("double", item(v))
            if float(out["y"][0]) != 2 * v + 1:
                wrong.append(f"thread {t} item {i}: {out['y']}")
            echoed = served.infer("echo", {"a": [t, i]})
            if echoed["a"].tolist() != [t, i]:
                wrong.append(f"thread {t} echo {i}: {echoed['a']}")
        many = served.infer_many("double", [item(t * 1000 + 500 + i) for i in range(20)])
        want = [2 * (t * 1000 + 500 + i) + 1 for i in range(20)]
        if [float(o["y"][0]) for o in many] != want:
            wrong.append(f"thread {t} infer_many out of order")
        return wrong

    with ThreadPoolExecutor(8) as pool:
        problems = [p for ps in pool.map(work, range(8)) for p in ps]
    assert problems == []
    stats = served.statistics()
    assert stats["double"]["items"] == 8 * (25 + 20)
    assert stats["echo"]["items"] == 8 * 25


def test_infer_many_returns_results_in_input_order(served):
    # Four replicas sleep x[0] ms each: the items finish in a different order than
    # they were given, and come back in the order given.
    delays = [30.0, 0.0, 20.0, 5.0, 10.0, 0.0, 25.0, 1.0]
    inputs = [{"x": np.array([d, i], dtype=np.float32)} for i, d in enumerate(delays)]
    results = served.infer_many("sleep", inputs)
    assert [r["y"].tolist() for r in results] == [[d, i] for i, d in enumerate(delays)]


def test_timeout_raises_deadline_exceeded(served, gate):
    with pytest.raises(DeadlineExceeded, match=r"model 'gated': no answer within 0\.05s"):
        served.infer("gated", item(1), timeout=0.05)
    results = served.infer_many("gated", [item(2), item(3)], timeout=0.05, return_exceptions=True)
    assert [type(r) for r in results] == [DeadlineExceeded, DeadlineExceeded]
    gate.release()
    out = served.infer("gated", item(4), timeout=30)
    assert float(out["y"][0]) == 9.0


def test_infer_many_reports_failures_in_place_or_raises_the_first(served):
    inputs = [item(1), {"x": ["not", "numbers"]}, item(3), {"nope": [1.0]}]
    results = served.infer_many("double", inputs, return_exceptions=True)
    assert float(results[0]["y"][0]) == 3.0
    assert isinstance(results[1], InvalidInput)
    assert "expected FP32" in str(results[1])
    assert float(results[2]["y"][0]) == 7.0
    assert isinstance(results[3], InvalidInput)
    assert "missing input 'x'" in str(results[3])
    with pytest.raises(InvalidInput, match="expected FP32"):
        served.infer_many("double", inputs)


def test_client_errors_are_the_runtime_errors(served):
    with pytest.raises(trioserve.UnknownModel, match="unknown model 'nope'"):
        served.infer("nope", item(1))
    with pytest.raises(InvalidInput, match=r"expected shape \[-1\]"):
        served.infer("double", {"x": [[1.0, 2.0]]})
    # An unknown keyword is Python's TypeError, in the calling thread, before
    # anything is submitted (there is no ``deadline=``: ``timeout=`` is in seconds).
    with pytest.raises(TypeError, match="unexpected keyword argument 'deadline'"):
        served.infer("double", item(1), deadline=1.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'return_exception'"):
        served.infer_many("double", [item(1)], return_exception=True)


# Regression: infer_many of more items than the queue ever holds answered those past
# the bound Overloaded (queue full: the call's own other items), at no load at all.
# The call now keeps at most what the tenant may queue in flight, so every item runs.
def test_infer_many_of_more_items_than_the_queue_holds_runs_them_all():
    recorder = Recorder(timed=False)
    cfg = trioserve.Config(
        models=[callable_model("m", recorder, adaptive_limit=False)],
        tenants=[TenantConfig(name="t", default=True),
                 TenantConfig(name="half", api_keys=["k"], queue_share=0.5)],
        runtime=trioserve.RuntimeLimits(queue_bound=8),
    )
    with trioserve.serve_in_thread(cfg) as client:
        for tenant in ("t", "half"):
            recorder.batches.clear()
            outs = client.infer_many("m", [item(i) for i in range(50)], tenant=tenant)
            assert [float(o["y"][0]) for o in outs] == [2.0 * i + 1 for i in range(50)]
            assert sorted(recorder.seen) == list(range(50))  # each item ran once
        # a call-wide mistake is still each item's answer, in its place
        assert [type(e) for e in client.infer_many(
            "nope", [item(i) for i in range(9)], return_exceptions=True
        )] == [trioserve.UnknownModel] * 9


def test_calls_after_the_block_raise_actor_closed():
    cfg = config(ModelConfig(name="echo", backend="echo"))
    with trioserve.serve_in_thread(cfg) as client:
        assert client.infer("echo", {"x": [1.0]})["x"].tolist() == [1.0]
    with pytest.raises(ActorClosed, match="shut down"):
        client.infer("echo", {"x": [1.0]})
    with pytest.raises(ActorClosed):
        client.infer_many("echo", [{"x": [1.0]}])


def outcome_of(call) -> object:
    """What ``call()`` returned or raised, BaseExceptions included."""
    try:
        return call()
    except BaseException as exc:
        return exc


def test_a_call_as_the_runtime_thread_ends_raises_actor_closed(monkeypatch):
    # Client calls run as trio system tasks, which trio cancels once the runtime's
    # main task has returned. A call arriving then is refused before it yields; it
    # used to reach a checkpoint under that cancellation and raise trio.Cancelled in
    # the calling thread.
    cfg = config(ModelConfig(name="echo", backend="echo"))
    clients = []
    late: list[object] = []
    real_open_runtime = trioserve._thread.open_runtime

    async def call_as_the_run_ends() -> None:
        answered = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def call() -> None:
            late.append(outcome_of(lambda: clients[0].infer("echo", {"a": [1]})))
            late.append(outcome_of(lambda: clients[0].infer_many("echo", [{"a": [1]}])))
            token.run_sync_soon(answered.set)

        try:
            await trio.sleep_forever()
        finally:
            # Cancelled with the other system tasks: the main task has returned. Keep
            # the run going until a call made now is answered.
            with trio.CancelScope(shield=True):
                threading.Thread(target=call).start()
                await answered.wait()

    @asynccontextmanager
    async def open_runtime(config):
        async with real_open_runtime(config) as rt:
            trio.lowlevel.spawn_system_task(call_as_the_run_ends)
            yield rt

    monkeypatch.setattr(trioserve._thread, "open_runtime", open_runtime)
    with trioserve.serve_in_thread(cfg) as client:
        clients.append(client)
        assert client.infer("echo", {"a": [1]})["a"].tolist() == [1]
    assert [type(e) for e in late] == [ActorClosed, ActorClosed], late
    assert [str(e) for e in late] == ["the runtime is shut down"] * 2


def test_a_call_waiting_for_credits_at_shutdown_raises_actor_closed():
    # A call waiting for its tenant's credits is not in any queue, so the runtime's
    # shutdown does not answer it: trio cancels it when the runtime's main task
    # returns, and the calling thread gets ActorClosed (it used to get trio.Cancelled).
    cfg = trioserve.Config(
        models=[ModelConfig(name="echo", backend="echo")],
        tenants=[TenantConfig(name="t", default=True, credit_rate=0.1, credit_burst=1)],
        classes=[ClassConfig(name="batch", over_quota="wait")],
    )
    waiting: list[object] = []
    with trioserve.serve_in_thread(cfg) as client:
        assert client.infer("echo", {"a": [1]})["a"].tolist() == [1]  # the only credit
        caller = threading.Thread(
            target=lambda: waiting.append(outcome_of(lambda: client.infer("echo", {"a": [2]})))
        )
        caller.start()

        async def until_it_waits() -> None:
            while client.runtime.credits_used["t"] < 2:
                await trio.testing.wait_all_tasks_blocked()

        trio.from_thread.run(until_it_waits, trio_token=client._token)
    caller.join()
    (error,) = waiting
    assert isinstance(error, ActorClosed), repr(error)
    assert str(error) == "the runtime shut down before this call was answered"


def test_the_client_reads_tenant_and_cache_statistics_and_invalidates_until_shutdown():
    cfg = trioserve.Config(
        models=[ModelConfig(name="echo", backend="echo")],
        tenants=[TenantConfig(name="t", default=True, credit_rate=0.1, credit_burst=2)],
        cache=trioserve.CacheConfig(capacity_bytes=1 << 20),
    )
    with trioserve.serve_in_thread(cfg) as client:
        for _ in range(2):
            assert client.infer("echo", {"a": [1]})["a"].tolist() == [1]
        credits = client.tenant_statistics()["t"]
        assert credits["credits_used"] == 1  # the repeat was a hit: no credit
        assert 1.0 <= credits["credits_available"] <= 2.0  # refilling at 0.1/s
        cache = client.cache_statistics()
        assert (cache["hits"], cache["misses"]) == (1, 1)
        assert client.invalidate_cache("echo") == 1
        with pytest.raises(trioserve.UnknownModel, match="unknown model 'ehco'"):
            client.invalidate_cache("ehco")
        client.infer("echo", {"a": [1]})  # computed again: the weights changed
        assert client.cache_statistics()["misses"] == 2
    for read in (client.statistics, client.tenant_statistics, client.cache_statistics):
        with pytest.raises(ActorClosed, match="the runtime is shut down"):
            read()
    with pytest.raises(ActorClosed, match="the runtime is shut down"):
        client.invalidate_cache("echo")


def test_a_runtime_that_cannot_start_raises_in_the_caller():
    cfg = config(ModelConfig(name="m", backend="no_such_module_here:thing"))
    with pytest.raises(ConfigError, match=r"models\.m\.backend: cannot import"):
        with trioserve.serve_in_thread(cfg):
            pytest.fail("started without its model")


# Regression: a path or a parsed TOML mapping where a Config belongs failed with
# AttributeError ('str' object has no attribute 'runtime'), from the runtime's thread.
@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("my.toml", r"got str 'my\.toml': read a config file with trioserve\.load_config"),
        (pathlib.Path("my.toml"), r"got PosixPath .*trioserve\.load_config\(path\)"),
        ({"models": {"e": {"backend": "echo"}}},
         r"got dict .*trioserve\.config_from_mapping\(data\)"),
        (ModelConfig(name="e", backend="echo"), r"got ModelConfig .*trioserve\.Config\(models="),
    ],
)
async def test_something_else_than_a_config_is_a_config_error_saying_what_to_pass(
    given, message
):
    with pytest.raises(ConfigError, match=r"^open_runtime takes a trioserve\.Config \(or "
                                          r"None: the built-in default\), " + message):
        async with trioserve.open_runtime(given):
            pytest.fail("opened")  # pragma: no cover
    threads = threading.active_count()
    with pytest.raises(ConfigError, match=r"^serve_in_thread takes a trioserve\.Config"):
        with trioserve.serve_in_thread(given):
            pytest.fail("opened")  # pragma: no cover
    assert threading.active_count() == threads  # refused before a thread started


def test_a_version_and_a_bad_timeout(served):
    out = served.infer("double", item(2), version="1")
    assert float(out["y"][0]) == 5.0
    assert [float(o["y"][0]) for o in served.infer_many("double", [item(1)], version="1")] == [3.0]
    with pytest.raises(trioserve.UnknownModel, match="has no version '9'"):
        served.infer("double", item(2), version="9")
    # a version is a string, as the config names it: version=1 was "has no version 1"
    for bad in (1, True):
        with pytest.raises(InvalidInput, match="version must be a string, one of '1'"):
            served.infer("double", item(2), version=bad)
        with pytest.raises(InvalidInput, match="version must be a string, one of '1'"):
            served.infer_many("double", [item(1)], version=bad)
    for bad in (0, -1, float("nan"), float("inf"), "1", True):
        with pytest.raises(InvalidInput, match="timeout must be a positive number"):
            served.infer("double", item(2), timeout=bad)


def test_ragged_inputs_to_an_open_model_are_invalid_input(served):
    with pytest.raises(InvalidInput, match="inputs are not arrays"):
        served.infer("echo", {"a": [[1, 2], [3]]})


def test_a_numpy_integer_is_a_priority_level(served):
    assert float(served.infer("double", item(2), priority=np.int64(2))["y"][0]) == 5.0
    with pytest.raises(InvalidInput, match="unknown request class"):
        served.infer("double", item(2), priority=np.float64(2))


# Regression: infer_many of a value that holds no items raised TypeError from list().
# A mapping was listed as its keys, each taken for an item.
@pytest.mark.parametrize(
    "inputs", [None, 5, np.array(1.0), {"x": [[1.0]]}], ids=["none", "int", "0d", "mapping"]
)
def test_infer_many_of_no_sequence_of_items_is_invalid_input(served, inputs):
    with pytest.raises(
        InvalidInput, match=r"^model 'double': infer_many takes a sequence of items, got "
    ):
        served.infer_many("double", inputs)
    assert served.infer_many("double", iter([item(1)]))[0]["y"].tolist() == [3.0]


# Regression: a str was iterated as its characters, each taken for an item, and the
# call failed on the first of them with "expected FP32, got BYTES".
@pytest.mark.parametrize("inputs", ["abc", b"abc", bytearray(b"abc")])
def test_infer_many_of_a_str_or_bytes_is_refused_saying_it_wants_a_list(served, inputs):
    with pytest.raises(InvalidInput) as caught:
        served.infer_many("double", inputs)
    assert str(caught.value) == (
        "model 'double': infer_many takes a sequence of items, got a "
        f"{type(inputs).__name__} (one value, not a list of items: pass [value] for one "
        "item)"
    )
    assert served.infer_many("double", [item(1)])[0]["y"].tolist() == [3.0]


def test_infer_many_of_a_set_is_refused_saying_to_pass_a_list(served):
    """A set's results came back in the set's order, matching no order of the
    caller's."""
    with pytest.raises(TypeError, match=r"got a frozenset, which has no order: .* pass a list$"):
        served.infer_many("double", frozenset([1.0, 2.0]))
    with pytest.raises(InvalidInput, match=r"got a set, which has no order"):
        served.infer_many("double", {1.0, 2.0})
    assert [r["y"].tolist() for r in served.infer_many("double", (item(1), item(2)))] == [
        [3.0], [5.0]
    ]


def test_leaving_the_block_answers_every_thread_in_flight_with_actor_closed():
    # Five threads call a model held by its gate: one call running, four queued.
    # Leaving the block (its grace spent on the stuck call) must answer each of them,
    # and return, however long the model stays stuck.
    gate = Gate()
    cfg = config(
        callable_model("g", gate, execution="thread", max_batch_size=1, max_wait_ms=0,
                       timeout_ms=None),
        graceful_timeout_s=0.2,
    )
    got: dict[int, object] = {}
    try:
        with trioserve.serve_in_thread(cfg) as client:
            threads = [
                threading.Thread(
                    target=lambda i=i: got.__setitem__(
                        i, outcome_of(lambda: client.infer("g", item(float(i))))
                    )
                )
                for i in range(5)
            ]
            for t in threads:
                t.start()
            # every call in: one running (the gate holds it), the others queued
            while client.statistics()["g"]["queue_depth"] < 4 or not gate.seen:
                pass
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)
    finally:
        gate.release()
    assert sorted(got) == [0, 1, 2, 3, 4]
    assert all(isinstance(e, ActorClosed) for e in got.values()), got
    assert len(gate.seen) == 1  # the queued ones never ran


def test_the_blocking_client_loads_and_unloads_under_explicit_control():
    """The blocking client had no model control: load_model, unload_model and
    model_state now call the runtime's, in its thread, with its errors."""
    cfg = trioserve.Config(
        models=(
            ModelConfig(name="echo", backend="echo", max_wait_ms=1),
            ModelConfig(name="later", backend="echo", max_wait_ms=1, load_at_start=False),
        ),
        tenants=(TenantConfig(name="t", default=True),),
        server=trioserve.ServerConfig(model_control="explicit"),
    )
    x = {"x": np.arange(3, dtype=np.float32)}
    with trioserve.serve_in_thread(cfg) as client:
        assert client.model_state("later") == ("UNAVAILABLE", "not loaded")
        with pytest.raises(trioserve.UnknownModel, match="'later' is not loaded"):
            client.infer("later", x)
        client.load_model("later")
        assert client.model_state("later") == ("READY", "")
        assert client.infer("later", x)["x"].tolist() == [0.0, 1.0, 2.0]
        client.unload_model("later")
        assert client.model_state("later") == ("UNAVAILABLE", "unloaded")
        with pytest.raises(trioserve.UnknownModel, match="unknown model 'nope'"):
            client.load_model("nope")
    with trioserve.serve_in_thread(config(ModelConfig(name="echo", backend="echo"))) as client:
        with pytest.raises(ConfigError, match="model control is off"):
            client.unload_model("echo")


# Regression: serve_in_thread called by a trio task (a program that should have used
# open_runtime) started the runtime on its thread, then failed with trio's "this is a
# blocking function; call it from a thread" when the block was left, before it had
# told the runtime to stop: the runtime, its models and its thread were left running.
async def test_serve_in_thread_from_a_trio_task_is_refused_before_a_thread_starts():
    cfg = config(ModelConfig(name="echo", backend="echo"))
    threads = threading.active_count()
    with pytest.raises(RuntimeError, match=r"^serve_in_thread is for blocking code, and was "
                                           r"called by a trio task: .*trioserve\.open_runtime"):
        with trioserve.serve_in_thread(cfg):
            pytest.fail("started")  # pragma: no cover
    assert threading.active_count() == threads
    assert "trioserve-runtime" not in {t.name for t in threading.enumerate()}


def test_a_client_called_by_a_trio_task_says_to_call_it_in_a_thread(served):
    async def call():
        served.infer("echo", {"a": [1]})

    with pytest.raises(RuntimeError, match=r"^the blocking client was called by a trio task, "
                                           r".*: call it in trio\.to_thread\.run_sync"):
        trio.run(call)
    assert served.infer("echo", {"a": [1]})["a"].tolist() == [1]  # still serving


def test_a_serve_in_thread_object_is_entered_once():
    # It raised Python's own AttributeError, as open_runtime's did.
    served = trioserve.serve_in_thread(config(callable_model("m", Recorder(timed=False))))
    once = r"^this serve_in_thread\(\.\.\.\) was entered already: it is entered once"
    with served as client:
        with pytest.raises(RuntimeError, match=once), served:
            pass
        assert client.infer("m", item(1.0))["y"].tolist() == [3.0]
    with pytest.raises(RuntimeError, match=once), served:
        pass


def test_a_serve_in_thread_object_whose_entry_failed_says_so_when_entered_again():
    # It said "entered already", as if it ran, instead of its first entry's error.
    served = trioserve.serve_in_thread("trioserve.toml")  # a path: refused at entry
    with pytest.raises(ConfigError, match="load_config"), served:
        pytest.fail("started")  # pragma: no cover
    failed = (
        r"^this serve_in_thread\(\.\.\.\) was entered already, and that entry failed "
        r"\(ConfigError: see its error\): it is entered once; call "
        r"serve_in_thread\(config\) again for another runtime$"
    )
    for _ in range(2):  # each time
        with pytest.raises(RuntimeError, match=failed), served:
            pytest.fail("started")  # pragma: no cover


def test_health_is_the_runtimes_read_in_its_thread():
    # The async runtime had health(); the blocking client had none.
    cfg = config(
        callable_model("m", Recorder(timed=False), execution="thread", replicas=2),
        ModelConfig(name="echo", backend="echo"),
    )
    with trioserve.serve_in_thread(cfg) as client:
        health = client.health()
        names = {m: [r["name"] for r in s["replicas"]] for m, s in client.statistics().items()}
        assert health == {
            m: {"ready": True, "replicas": dict.fromkeys(names[m], "ready")} for m in names
        }
        assert len(health["m"]["replicas"]) == 2
        # the same answer as the runtime's own, read in its thread
        assert health == trio.from_thread.run_sync(client.runtime.health,
                                                   trio_token=client._token)
    with pytest.raises(ActorClosed, match="the runtime is shut down"):
        client.health()


def test_an_interrupt_as_its_thread_starts_stops_the_runtime_it_was_starting(monkeypatch):
    # A Ctrl-C that lands while Thread.start() returns (the main thread waiting for
    # the GIL while the runtime thread ran on to load the models) left the runtime
    # thread behind, as before the start was waited for: start() was outside the
    # block that stops it. Here the interrupt comes just after the thread started.
    loading = threading.Event()
    release = threading.Event()

    class Blocking(trioserve.CallableBackend):
        def load(self, device, *, torch_threads=1):
            loading.set()
            release.wait(GATE_LIMIT_S)
            return super().load(device, torch_threads=torch_threads)

    class Interrupted(threading.Thread):
        def start(self):
            super().start()
            if self.name == "trioserve-runtime":  # (no other thread's start)
                loading.wait(GATE_LIMIT_S)
                raise KeyboardInterrupt

    monkeypatch.setattr(threading, "Thread", Interrupted)
    backend = Blocking(Recorder(timed=False), inputs=[X], outputs=[Y], execution="thread")
    _check_an_interrupted_start_adds_no_runtime(backend, loading, release)


def test_an_interrupt_while_it_starts_stops_the_runtime_it_was_starting():
    # A Ctrl-C while the models loaded raised KeyboardInterrupt in the caller and left
    # the runtime thread behind: it went on loading, then served with nobody to stop
    # it (its worker processes too), until the interpreter's exit killed it.
    loading = threading.Event()
    release = threading.Event()

    class Interrupting(trioserve.CallableBackend):
        def load(self, device, *, torch_threads=1):
            loading.set()
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            release.wait(GATE_LIMIT_S)  # the caller's interrupt comes meanwhile
            return super().load(device, torch_threads=torch_threads)

    backend = Interrupting(Recorder(timed=False), inputs=[X], outputs=[Y], execution="thread")
    _check_an_interrupted_start_adds_no_runtime(backend, loading, release)


def _check_an_interrupted_start_adds_no_runtime(backend, loading, release):
    """serve_in_thread with ``backend`` (whose load sets ``loading`` and waits for
    ``release``) is interrupted as it starts: KeyboardInterrupt, and no runtime
    thread is left."""
    runtimes = [t for t in threading.enumerate() if t.name == "trioserve-runtime"]
    try:
        with pytest.raises(KeyboardInterrupt), trioserve.serve_in_thread(
            config(ModelConfig(name="m", backend=backend))
        ):
            pytest.fail("started")  # pragma: no cover
        assert loading.is_set()
        # the load is abandoned (a thread cannot be stopped); the runtime is not
        # (a runtime thread of an earlier test may end meanwhile: none may be added)
        left = [t for t in threading.enumerate() if t.name == "trioserve-runtime"]
        assert set(left) <= set(runtimes)
    finally:
        release.set()
