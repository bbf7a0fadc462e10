"""The configuration of replicas on Ray: ``[ray]`` and a model's ``ray`` table, their
errors, and a model on Ray where Ray is not installed. None of these needs a running Ray."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import trioserve
from runtime_helpers import config
from trioserve import (
    ConfigError,
    ModelConfig,
    RayConfig,
    RayReplicaConfig,
    config_from_mapping,
    load_config,
)


def test_a_toml_file_configures_ray_and_a_models_actor_options(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[ray]\naddress = "ray://head:10001"\nnamespace = "serving"\n'
        '[models.m]\nbackend = "mlp"\nexecution = "ray"\nreplicas = 3\n'
        'ray = { num_cpus = 2, num_gpus = 0.5, resources = { accel = 1 }, '
        'runtime_env = { env_vars = { A = "1" } } }\n'
    )
    cfg = load_config(path)
    assert cfg.ray == RayConfig(address="ray://head:10001", namespace="serving")
    m = cfg.model("m")
    assert m.ray == RayReplicaConfig(
        num_cpus=2, num_gpus=0.5, resources={"accel": 1}, runtime_env={"env_vars": {"A": "1"}}
    )
    assert m.ray.device == "cuda:0"  # the GPU Ray gives the actor
    assert m.ray.actor_options() == {
        "num_cpus": 2, "num_gpus": 0.5, "resources": {"accel": 1},
        "runtime_env": {"env_vars": {"A": "1"}},
    }
    assert len(m.replica_devices) == 3


def test_defaults_a_local_ray_and_one_cpu_per_replica():
    cfg = config_from_mapping({"models": {"m": {"backend": "mlp", "execution": "ray"}}})
    assert cfg.ray == RayConfig(address=None, namespace=None)
    m = cfg.model("m")
    assert m.ray is None  # RayReplicaConfig() applies
    assert RayReplicaConfig().actor_options() == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert RayReplicaConfig().device == "cpu"


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"execution": "ray", "ray": {"num_cpu": 1}},
         "models.m.ray.num_cpu: unknown key; did you mean 'num_cpus'? expected one of "
         "num_cpus, num_gpus"),
        ({"execution": "ray", "ray": {"num_cpus": -1}},
         "models.m.ray.num_cpus: must be a finite number >= 0.0, got -1"),
        ({"execution": "ray", "ray": {"num_gpus": 1.5}},
         "models.m.ray.num_gpus: must be at most 1 or a whole number"),
        ({"execution": "ray", "ray": {"resources": {"GPU": 1}}},
         "models.m.ray.resources: 'GPU' is not set here: use num_gpus"),
        ({"execution": "ray", "ray": {"resources": {"accel": "x"}}},
         "models.m.ray.resources: 'accel': must be a finite number"),
        ({"execution": "ray", "ray": {"runtime_env": "env"}},
         "models.m.ray.runtime_env: must be a table"),
        ({"execution": "ray", "ray": 2}, "models.m.ray: must be a table"),
        ({"execution": "process", "ray": {"num_cpus": 1}},
         'models.m.ray: Ray actor options do nothing unless execution = "ray"'),
        ({"execution": "ray", "devices": ["cuda:0"]},
         "models.m.devices: cuda:0 on Ray needs a GPU from Ray: set models.m.ray.num_gpus"),
        ({"execution": "rays"}, "models.m.execution: must be one of 'thread', 'inline', "
                                "'process', 'ray', got 'rays'"),
    ],
)
def test_bad_ray_options_of_a_model_are_config_errors(model, message):
    with pytest.raises(ConfigError) as info:
        config_from_mapping({"models": {"m": {"backend": "mlp", **model}}})
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"adress": "auto"}, "ray.adress: unknown key; did you mean 'address'?"),
        ({"address": ""}, "ray.address: must be a non-empty string"),
        ({"namespace": 3}, "ray.namespace: must be a non-empty string, got 3"),
        ("auto", "ray: must be a table, got 'auto'"),
    ],
)
def test_bad_ray_tables_are_config_errors(table, message):
    with pytest.raises(ConfigError) as info:
        config_from_mapping({"models": {"m": {"backend": "echo"}}, "ray": table})
    assert str(info.value).startswith(message), str(info.value)


def test_a_cuda_device_on_ray_with_a_gpu_only_counts_a_replica():
    m = ModelConfig(
        name="m", backend="mlp", execution="ray", devices=["cuda:0", "cuda:1"],
        ray={"num_gpus": 1},
    )
    assert len(m.replica_devices) == 2
    assert m.ray.device == "cuda:0"


async def test_a_model_on_ray_without_ray_installed_is_a_config_error_at_start(monkeypatch):
    monkeypatch.setattr(trioserve._ray_connect, "ray_available", lambda: False)
    cfg = config(ModelConfig(name="m", backend="echo", execution="ray"))
    with pytest.raises(ConfigError) as info:
        async with trioserve.open_runtime(cfg):
            pass
    assert str(info.value) == (
        'models.m.execution: "ray" needs Ray, which is not installed here: '
        "pip install 'trioserve[ray]'"
    )


async def test_ray_is_not_started_when_no_model_runs_on_it(monkeypatch):
    async def refuse(cfg):
        raise AssertionError("Ray started for no model")

    monkeypatch.setattr(trioserve._runtime, "start_ray", refuse)
    cfg = config(ModelConfig(name="m", backend="echo"))
    async with trioserve.open_runtime(cfg) as rt:
        assert rt.model_ready("m")


async def test_ray_is_connected_without_its_failure_signal_handler(monkeypatch):
    """Ray's native failure-signal handler printed a stack for the SIGTERM that
    drains the server, as for a crash: it is off unless the caller chose."""
    ray = pytest.importorskip("ray")
    seen = []
    monkeypatch.delenv("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", raising=False)
    monkeypatch.setattr(trioserve._ray_connect, "_users", 0)
    monkeypatch.setattr(trioserve._ray_connect, "_owner", None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(
        ray, "init", lambda **kw: seen.append(os.environ["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"])
    )
    assert await trioserve._ray_connect.start_ray(RayConfig()) is True
    await trioserve._ray_connect.stop_ray()
    assert seen == ["1"]
    monkeypatch.setenv("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "0")
    await trioserve._ray_connect.start_ray(RayConfig())
    await trioserve._ray_connect.stop_ray()
    assert seen == ["1", "0"]


@pytest.mark.parametrize(
    ("table", "passed"),
    [
        ({}, {}),
        (
            {"address": "ray://head:10001", "namespace": "serving"},
            {"address": "ray://head:10001", "namespace": "serving"},
        ),
    ],
)
async def test_ray_is_connected_with_its_warnings_and_errors_but_not_its_info_lines(
    monkeypatch, table, passed
):
    """A local Ray started by `trioserve serve` wrote its INFO lines ("Started a local
    Ray instance", the authentication token saved) into the runtime's output: its
    logger is set to WARNING, and what else ``[ray]`` says is passed on."""
    ray = pytest.importorskip("ray")
    kwargs = []
    monkeypatch.setattr(trioserve._ray_connect, "_users", 0)
    monkeypatch.setattr(trioserve._ray_connect, "_owner", None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: kwargs.append(kw))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    assert await trioserve._ray_connect.start_ray(RayConfig(**table)) is True
    await trioserve._ray_connect.stop_ray()
    assert kwargs == [{"logging_level": logging.WARNING, **passed}]


async def test_ray_is_connected_and_disconnected_by_a_thread_that_lives_in_between(
    monkeypatch,
):
    """A local Ray's processes die with the thread that started them (Linux's
    parent-death signal is per thread): connected from one of trio's worker
    threads, they were killed when it went idle, 10 s later. ``ray.init`` and
    ``ray.shutdown`` run on one thread of the runtime's, alive in between."""
    ray = pytest.importorskip("ray")
    ran = []
    connected = [False]

    def init(**kw):
        ran.append(("init", threading.current_thread()))
        connected[0] = True

    def shutdown():
        ran.append(("shutdown", threading.current_thread()))
        connected[0] = False

    monkeypatch.setattr(trioserve._ray_connect, "_users", 0)
    monkeypatch.setattr(trioserve._ray_connect, "_owner", None)
    monkeypatch.setattr(ray, "is_initialized", lambda: connected[0])
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", shutdown)
    assert await trioserve._ray_connect.start_ray(RayConfig()) is True
    [(what, owner)] = ran
    assert what == "init"
    assert owner.name == "trioserve-ray"
    assert owner is not threading.current_thread()
    assert owner.is_alive()  # after the call that waited for it returned
    assert await trioserve._ray_connect.start_ray(RayConfig()) is True  # a second user
    await trioserve._ray_connect.stop_ray()
    assert owner.is_alive()  # the second still uses it
    await trioserve._ray_connect.stop_ray()
    assert ran == [("init", owner), ("shutdown", owner)]
    assert not owner.is_alive()
    assert trioserve._ray_connect._owner is None


async def test_a_ray_that_cannot_be_connected_leaves_no_thread_behind(monkeypatch):
    ray = pytest.importorskip("ray")
    def refuse(**kw):
        raise ConnectionError("no cluster there")

    monkeypatch.setattr(trioserve._ray_connect, "_users", 0)
    monkeypatch.setattr(trioserve._ray_connect, "_owner", None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(ConfigError, match="cannot connect to Ray at 'ray://nowhere:1'"):
        await trioserve._ray_connect.start_ray(RayConfig(address="ray://nowhere:1"))
    assert not [t for t in threading.enumerate() if t.name == "trioserve-ray"]
    assert (trioserve._ray_connect._users, trioserve._ray_connect._owner) == (0, None)


async def test_the_last_runtime_using_the_ray_it_connected_disconnects_it(monkeypatch):
    """Two runtimes of one process on the Ray the first connected: the first to
    close used to stop it under the other (its actors lost, and a new local Ray
    started by Ray's own auto-init, never stopped)."""
    ray = pytest.importorskip("ray")
    calls = []
    connected = [False]

    def init(**kw):
        calls.append("init")
        connected[0] = True

    def shutdown():
        calls.append("shutdown")
        connected[0] = False

    monkeypatch.setattr(trioserve._ray_connect, "_users", 0)
    monkeypatch.setattr(trioserve._ray_connect, "_owner", None)
    monkeypatch.setattr(ray, "is_initialized", lambda: connected[0])
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", shutdown)
    start, stop = trioserve._ray_connect.start_ray, trioserve._ray_connect.stop_ray
    assert await start(RayConfig()) is True  # connected here
    assert await start(RayConfig()) is True  # a second runtime on it: counted
    await stop()
    assert calls == ["init"]  # the second still serves on it
    await stop()
    assert calls == ["init", "shutdown"]  # the last one disconnects it
    # a Ray the process's own code connected is used and left alone
    connected[0] = True
    assert await start(RayConfig()) is False
    assert calls == ["init", "shutdown"]


@pytest.mark.parametrize(("chosen", "seen"), [(None, "1"), ("0", "0")])
def test_ray_sees_its_failure_signal_handler_off_when_first_imported(tmp_path, chosen, seen):
    """Ray reads RAY_DISABLE_FAILURE_SIGNAL_HANDLER once, when it is imported: set
    after the import (as it was), `trioserve serve` still printed a native stack
    for its SIGTERM. A stand-in ``ray`` package records what its import saw."""
    import subprocess
    import sys

    from runtime_helpers import pythonpath_with

    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text(
        "import os\n"
        "SEEN = os.environ.get('RAY_DISABLE_FAILURE_SIGNAL_HANDLER')\n"
        "def is_initialized(): return False\n"
        "def init(**kw): pass\n"
        "def shutdown(): pass\n"
    )
    script = (
        "import sys, trio\n"
        "from trioserve import RayConfig\n"
        "from trioserve._ray_connect import start_ray\n"
        "assert 'ray' not in sys.modules\n"
        "assert trio.run(start_ray, RayConfig())\n"
        "print(sys.modules['ray'].SEEN)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"}
    if chosen is not None:
        env["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"] = chosen
    env["PYTHONPATH"] = pythonpath_with(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == seen
