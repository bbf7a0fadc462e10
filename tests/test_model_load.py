"""A model's load: its failure and its time limit (``load_timeout_s``), as the runtime
and ``trioserve serve`` report them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import trio
import trioserve
from runtime_helpers import X, Y, callable_model, pythonpath_with
from trioserve import ConfigError, ModelBackend, ModelConfig, ModelLoadError
from trioserve.cli import main

TESTS = os.path.dirname(os.path.abspath(__file__))

#: Real seconds a test waits for a stuck load's thread before giving up on it.
STUCK_LIMIT_S = 30.0


class Loading(ModelBackend):
    """A backend whose load raises, or waits for ``gate`` (a load that hangs)."""

    inputs = (X,)
    outputs = (Y,)

    def __init__(self, *, fail: bool = False) -> None:
        self.fail = fail
        self.gate = threading.Event()
        self.loads = 0

    def load(self, device: str, *, torch_threads: int = 1):
        self.loads += 1
        if self.fail:
            raise OSError(f"no weights for {device}")
        self.gate.wait(STUCK_LIMIT_S)
        return lambda items: [{"y": it["x"]} for it in items]


def one_model(backend: ModelBackend, **cfg) -> trioserve.Config:
    cfg.setdefault("execution", "thread")
    return trioserve.Config(models=(ModelConfig(name="m", backend=backend, **cfg),))


async def test_a_load_that_raises_is_a_model_load_error_naming_the_replica():
    backend = Loading(fail=True)
    with pytest.raises(ModelLoadError) as caught:
        async with trioserve.open_runtime(one_model(backend)):
            pass  # pragma: no cover
    assert str(caught.value) == (
        "model 'm': replica 0 on cpu failed to load: OSError: no weights for cpu"
    )
    assert isinstance(caught.value.__cause__, OSError)  # the backend's own error
    assert backend.loads == 1  # a start-up failure is not retried


class Escaping(ModelBackend):
    """A backend whose load raises what is no ordinary error: ``sys.exit`` (a
    command-line helper's way to give up) or a stray StopIteration."""

    inputs = (X,)
    outputs = (Y,)

    def __init__(self, exc: BaseException, execution: str = "thread") -> None:
        self.exc = exc
        self.default_execution = execution

    def load(self, device: str, *, torch_threads: int = 1):
        raise self.exc


def exits_on_load() -> Escaping:
    """An Escaping backend calling ``sys.exit`` in a worker process (importable)."""
    return Escaping(SystemExit("no weights in /models/m"), execution="process")


@pytest.mark.parametrize("execution", ["thread", "inline"])
@pytest.mark.parametrize(
    ("exc", "said"),
    [
        (SystemExit("no weights in /models/m"), "SystemExit: no weights in /models/m"),
        (StopIteration("no files left"), "StopIteration: no files left"),
    ],
)
async def test_a_load_that_exits_or_raises_stopiteration_is_a_model_load_error(
    execution, exc, said
):
    """A load calling ``sys.exit()`` ended the program out of ``open_runtime`` with
    the load's message as its only word (SystemExit is no Exception), and a stray
    StopIteration was told as "RuntimeError: coroutine raised StopIteration" (PEP
    479, out of the load's thread). Both are a load that raises: ModelLoadError,
    naming the replica, its cause the backend's own exception."""
    with pytest.raises(ModelLoadError) as caught:
        async with trioserve.open_runtime(one_model(Escaping(exc), execution=execution)):
            pass  # pragma: no cover
    assert str(caught.value) == f"model 'm': replica 0 on cpu failed to load: {said}"
    assert caught.value.__cause__ is exc


async def test_a_load_that_exits_in_a_worker_process_says_why(monkeypatch):
    """In a worker process the same ``sys.exit()`` ended the worker: the start failed
    with "worker process exited (pid N)" and no reason."""
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(TESTS))
    cfg = trioserve.Config(
        models=(ModelConfig(name="m", backend="test_model_load:exits_on_load"),)
    )
    with pytest.raises(ModelLoadError) as caught:
        async with trioserve.open_runtime(cfg):
            pass  # pragma: no cover
    assert str(caught.value) == (
        "model 'm': replica 0 on cpu failed to load: SystemExit: no weights in /models/m"
    )


class Dying(ModelBackend):
    """A backend whose load ends its worker process: a signal, or an exit status."""

    inputs = (X,)
    outputs = (Y,)
    default_execution = "process"

    def __init__(self, how: int | signal.Signals) -> None:
        self.how = how

    def load(self, device: str, *, torch_threads: int = 1):
        if isinstance(self.how, signal.Signals):
            os.kill(os.getpid(), self.how)
        os._exit(self.how)


def killed_on_load() -> Dying:
    return Dying(signal.SIGKILL)


def crashes_on_load() -> Dying:
    return Dying(signal.SIGSEGV)


def exits_3_on_load() -> Dying:
    return Dying(3)


@pytest.mark.parametrize(
    ("factory", "how"),
    [
        ("killed_on_load", "killed by SIGKILL: an out-of-memory kill, or kill -9"),
        ("crashes_on_load",
         "killed by SIGSEGV: a crash in native code, in an extension or the model's library"),
        ("exits_3_on_load", "exit status 3"),
    ],
)
async def test_a_worker_process_that_dies_loading_says_how(monkeypatch, factory, how):
    """A worker killed while it loaded (the kernel's out-of-memory killer, a crashing
    extension, a library's own exit) failed the start with "worker process exited
    (pid N)" alone: now with its exit status, or its signal by name, which its zygote
    (its parent: it reaps it) reports on the worker's reply pipe."""
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(TESTS))
    cfg = trioserve.Config(
        models=(ModelConfig(name="m", backend=f"test_model_load:{factory}"),)
    )
    with pytest.raises(ModelLoadError) as caught:
        async with trioserve.open_runtime(cfg):
            pass  # pragma: no cover
    said, _, stderr = str(caught.value).partition("; its stderr ended with:\n")
    assert said.startswith(
        "model 'm': replica 0 on cpu failed to load: worker process exited (pid "
    )
    assert said.endswith(f"; {how})")
    # What the worker left on its stderr follows: faulthandler's report of the crash.
    if factory == "crashes_on_load":
        assert "    Fatal Python error: Segmentation fault" in stderr
    else:
        assert stderr == ""


async def test_a_load_past_its_timeout_fails_the_start_in_wall_time():
    """A load that hangs (an import waiting on a lock, a stuck file system) left the
    runtime starting for ever: no listening socket, no error."""
    backend = Loading()
    try:
        start = trio.current_time()
        with pytest.raises(ModelLoadError) as caught:
            async with trioserve.open_runtime(one_model(backend, load_timeout_s=0.2)):
                pass  # pragma: no cover
        assert str(caught.value) == (
            "model 'm': replica 0 on cpu did not load within 0.2 s (models.m.load_timeout_s)"
        )
        assert trio.current_time() - start < STUCK_LIMIT_S  # the timeout, not the gate
    finally:
        backend.gate.set()


async def test_the_load_timeout_does_not_fire_under_an_autojumping_clock(autojump_clock):
    """Timed on the wall clock: a trio timer would fire at once while the loop waits
    for the loading thread with every task blocked."""
    backend = Loading()
    backend.gate.set()  # loads at once, in real time
    async with trioserve.open_runtime(one_model(backend, load_timeout_s=1.0)) as rt:
        assert (await rt.infer("m", {"x": [1.0, 2.0]}))["y"].tolist() == [1.0, 2.0]


def test_load_timeout_s_is_checked():
    assert ModelConfig(name="m", backend="echo").load_timeout_s == 600.0
    assert ModelConfig(name="m", backend="echo", load_timeout_s=None).load_timeout_s is None
    for bad in (0, -1, 86_401, float("nan"), "10"):
        with pytest.raises(ConfigError, match=r"^models\.m\.load_timeout_s: must be"):
            ModelConfig(name="m", backend="echo", load_timeout_s=bad)


def double(items):
    return [{"y": it["x"] * 2} for it in items]


def no_backend():
    return None


def broken_factory(**options):
    raise OSError("no such file: weights.pt")


# Regression: a callable given from Python as the backend was called bare, and a
# failure was raised as it came: the model's own function (not a factory) as
# TypeError "double() missing 1 required positional argument", a factory's own error
# unwrapped. Now it is called as a factory named in TOML is, with the same ConfigError.
@pytest.mark.parametrize(
    ("factory", "options", "message"),
    [
        (double, {}, "double failed with its options {}: TypeError: double() missing 1 "
                     "required positional argument: 'items' (name a ModelBackend, such as "
                     "trioserve.CallableBackend(fn, inputs=..., outputs=...)"),
        (broken_factory, {"size": 2}, "broken_factory failed with its options {'size': 2}: "
                                      "OSError: no such file: weights.pt"),
        (no_backend, {}, "no_backend() is not a ModelBackend (got NoneType; name a "
                         "ModelBackend"),
    ],
)
async def test_a_backend_factory_given_from_python_that_fails_is_a_config_error(
    factory, options, message
):
    cfg = trioserve.Config(models=(ModelConfig(name="m", backend=factory, options=options),))
    with pytest.raises(ConfigError) as caught:
        async with trioserve.open_runtime(cfg):
            pytest.fail("opened")  # pragma: no cover
    assert str(caught.value).startswith(f"models.m.backend: {message}")


async def test_a_backend_factory_given_from_python_takes_the_models_options():
    def factory(*, scale):
        return trioserve.CallableBackend(
            lambda items: [{"y": it["x"] * scale} for it in items], inputs=[X], outputs=[Y]
        )

    cfg = trioserve.Config(models=(ModelConfig(name="m", backend=factory,
                                               options={"scale": 3.0}),))
    async with trioserve.open_runtime(cfg) as rt:
        assert (await rt.infer("m", [2.0]))["y"].tolist() == [6.0]


NO_RUNNER = """
    from trioserve import ModelBackend, TensorSpec

    class NoRunner(ModelBackend):
        inputs = (TensorSpec(name="x", datatype="FP32", shape=(-1,)),)
        outputs = (TensorSpec(name="y", datatype="FP32", shape=(-1,)),)

        def load(self, device, *, torch_threads=1):
            return None  # forgot to return the runner
"""


# Regression: a load that returned no runner started the model, ready, and then
# failed every batch with "TypeError: 'NoneType' object is not callable".
@pytest.mark.parametrize("execution", ["thread", "inline", "process"])
async def test_a_load_that_returns_no_runner_fails_the_start(tmp_path, monkeypatch, execution):
    (tmp_path / "norunner.py").write_text(textwrap.dedent(NO_RUNNER))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(tmp_path))
    from norunner import NoRunner

    cfg = trioserve.Config(
        models=(ModelConfig(name="m", backend=NoRunner(), execution=execution),)
    )
    with pytest.raises(ModelLoadError) as caught:
        async with trioserve.open_runtime(cfg):
            pytest.fail("started without a runner")  # pragma: no cover
    assert str(caught.value) == (
        "model 'm': replica 0 on cpu failed to load: TypeError: NoRunner.load returned "
        "None; expected the runner: a callable over a list of items, returning one "
        "output mapping each"
    )


BACKEND = """
    from trioserve import ModelBackend, TensorSpec

    class Broken(ModelBackend):
        inputs = (TensorSpec(name="x", datatype="FP32", shape=(2,)),)
        outputs = (TensorSpec(name="y", datatype="FP32", shape=(2,)),)

        def load(self, device, *, torch_threads=1):
            return read_weights(device)

    def read_weights(device):
        raise FileNotFoundError("weights.pt")

    def broken(**options):
        return Broken()
"""


@pytest.mark.parametrize("execution", ["thread", "process"])
def test_serve_reports_a_model_that_cannot_load_with_its_own_traceback(
    tmp_path, monkeypatch, capsys, execution
):
    """It printed some sixty lines of the runtime's nurseries around the error."""
    (tmp_path / "brokenmodel.py").write_text(textwrap.dedent(BACKEND))
    monkeypatch.syspath_prepend(str(tmp_path))
    # for a worker process, ahead of wherever trioserve itself is found
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(tmp_path))
    path = tmp_path / "serve.toml"
    path.write_text(
        f'[server]\nport = 0\n[models.b]\nbackend = "brokenmodel:broken"\n'
        f'execution = "{execution}"\n'
    )
    assert main(["serve", "--config", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == f"trioserve: model 'b': loading 1 replica ({execution} on cpu)"
    lines = err.splitlines()
    assert lines[-1] == (
        "trioserve: model 'b': replica 0 on cpu failed to load: "
        "FileNotFoundError: weights.pt"
    )
    assert lines[0] == "Traceback (most recent call last):"
    # the backend's frames, and none of the runtime's
    assert "in read_weights" in err
    assert "brokenmodel.py" in err
    assert "trio" not in err.replace("trioserve: ", "")


def test_serve_reports_a_load_failure_with_no_frame_of_the_model_on_one_line(
    tmp_path, monkeypatch, capsys
):
    """A replica that fails to load with no traceback of the model's to show (here a
    worker process that exits while it loads; on Ray, an actor no node can hold) is
    the line that says why: it used to come after a traceback of one runtime frame,
    the line raising the runtime's own error, which reads as a crash."""
    (tmp_path / "exitsloading.py").write_text(
        "import os\n"
        "from trioserve import CallableBackend, TensorSpec\n"
        "X = TensorSpec(name='x', datatype='FP32', shape=(2,))\n"
        "class Exits(CallableBackend):\n"
        "    def load(self, device, *, torch_threads=1):\n"
        "        os._exit(3)\n"
        "def make():\n"
        "    return Exits(lambda items: items, inputs=(X,), outputs=(X,))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(tmp_path))
    path = tmp_path / "serve.toml"
    path.write_text(
        '[server]\nport = 0\n[models.b]\nbackend = "exitsloading:make"\n'
        'execution = "process"\n'
    )
    assert main(["serve", "--config", str(path)]) == 1
    _, err = capsys.readouterr()
    assert err.splitlines()[-1].startswith(
        "trioserve: model 'b': replica 0 on cpu failed to load: worker process exited "
    ), err
    assert "exit status 3" in err.splitlines()[-1]
    assert "Traceback" not in err, err


async def test_a_backend_the_worker_process_cannot_import_says_so(tmp_path, monkeypatch):
    """A callable of a module the parent imports but a worker process cannot (a
    script's own function, a module on the parent's sys.path only) failed the start
    with "worker process exited (pid N)" and no reason: the worker died unpickling
    it. The error now says what the worker could not rebuild and what to do."""
    (tmp_path / "parentonly.py").write_text(
        "def double(items):\n    return [{'y': it['x'] * 2} for it in items]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # this process only, not PYTHONPATH
    import parentonly

    cfg = trioserve.Config(models=(callable_model("m", parentonly.double, execution="process"),))
    with pytest.raises(ModelLoadError) as caught:
        async with trioserve.open_runtime(cfg):
            pass  # pragma: no cover
    message = str(caught.value)
    assert message.startswith(
        "model 'm': replica 0 on cpu failed to load: the worker process cannot rebuild "
        "the model's backend (ModuleNotFoundError: No module named 'parentonly'): define "
        "it (or its factory) in a module the worker can import"
    )
    assert message.endswith('or use execution = "thread"')


SLOW = """
import time
from trioserve import ModelBackend, TensorSpec

class Slow(ModelBackend):
    inputs = (TensorSpec(name="x", datatype="FP32", shape=[1]),)
    outputs = (TensorSpec(name="y", datatype="FP32", shape=[1]),)

    def load(self, device, *, torch_threads=1):
        time.sleep(120)  # weights on a slow disk

def slow():
    return Slow()
"""


@pytest.mark.parametrize("execution", ["thread", "process"])
async def test_a_signal_while_the_models_load_stops_serve_at_once(tmp_path, execution):
    """SIGINT went unheard until every model had loaded (up to load_timeout_s, 600 s by
    default); then the server started, printed its banner, and only then drained."""
    (tmp_path / "slowmodel.py").write_text(textwrap.dedent(SLOW))
    path = tmp_path / "serve.toml"
    path.write_text(
        f'[server]\nport = 0\n[models.s]\nbackend = "slowmodel:slow"\n'
        f'execution = "{execution}"\n'
    )
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "trioserve.cli", "serve", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath_with(tmp_path)},
    )
    out = b""
    try:
        with trio.fail_after(60):
            while b"loading 1 replica" not in out:
                chunk = await proc.stdout.receive_some()
                assert chunk, out
                out += chunk
        proc.send_signal(signal.SIGINT)
        with trio.fail_after(20):  # the load alone has 120 s to go
            rc = await proc.wait()
            while chunk := await proc.stdout.receive_some():
                out += chunk
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = out.decode()
    assert rc == 0, text
    assert "SIGINT while the models load: stopping" in text
    assert text.rstrip().endswith("trioserve: stopped")
    assert "serving" not in text
    assert "Traceback" not in text


async def test_a_signal_while_the_backends_libraries_import_stops_serve_at_once(
    monkeypatch, capsys
):
    """minilm's imports (torch, transformers: ~2 s) ran on the event loop, and a
    signal meanwhile was heard only once they were done."""
    from trioserve.transport import _main

    importing, done = threading.Event(), threading.Event()

    def slow_imports(models):
        importing.set()
        done.wait(STUCK_LIMIT_S)  # an import of seconds

    monkeypatch.setattr(_main, "warm_imports", slow_imports)
    config = trioserve.Config(
        models=(ModelConfig(name="e", backend="echo"),),
        server=trioserve.ServerConfig(port=0),
    )
    results = []
    try:
        with trio.fail_after(STUCK_LIMIT_S / 2):
            async with trio.open_nursery() as nursery:

                async def run() -> None:
                    results.append(await _main.serve(config))

                nursery.start_soon(run)
                await trio.to_thread.run_sync(importing.wait)
                os.kill(os.getpid(), signal.SIGTERM)  # serve's receiver has it
    finally:
        done.set()
    assert results == [0]
    out = capsys.readouterr().out
    assert "SIGTERM while the models load: stopping" in out
    assert out.rstrip().endswith("trioserve: stopped")
    assert "serving" not in out
