"""A load whose config is Triton's model configuration, as ``rt.triton_config`` (the
config endpoint's document) gives it, through ``rt.load_model(name, config=...)``: unchanged,
it reloads the table itself for every built-in model, a model whose versions have
weights of their own and a rollout, a model on several devices and an autoscaled one
(the replicas it scaled to kept); a larger max_batch_size really batches more;
instance groups start the replicas they name; a refusal loads nothing. The models
of the stand-in worker of test_model_control run in trio time."""

from __future__ import annotations

import pytest
import trio
import trioserve
from runtime_helpers import item
from test_model_control import call, control_config, workers  # noqa: F401
from test_model_control_config import batch_sizes
from test_model_control_versions import ROLLOUT, THREE, family_config, vworkers, y  # noqa: F401
from trioserve import ConfigError, ModelConfig, ServerConfig
from trioserve._config import minilm_available


def shown(rt, name: str) -> dict:
    """What the config endpoint gives of ``name`` now."""
    return rt.triton_config(name)


async def round_trip(rt, name: str) -> None:
    """Load ``name`` with its document unchanged: a reload (a new copy) of the table
    itself, whose document is the same."""
    before, old = shown(rt, name), rt.models[name]
    await rt.load_model(name, config=shown(rt, name))
    assert rt.models[name] is not old
    assert rt.model_state(name) == ("READY", "")  # no config of its own
    assert shown(rt, name) == before


BUILTINS = [
    ModelConfig(name="mlp", backend="mlp"),
    ModelConfig(name="echo", backend="echo"),
    ModelConfig(name="sleep", backend="sleep", max_wait_ms=0.25),
    *([ModelConfig(name="minilm", backend="minilm")] if minilm_available() else []),
]


@pytest.mark.parametrize("model", BUILTINS, ids=[m.name for m in BUILTINS])
async def test_each_built_in_models_document_unchanged_reloads_its_table(model):
    cfg = trioserve.Config(models=(model,), server=ServerConfig(model_control="explicit"))
    async with trioserve.open_runtime(cfg) as rt:
        await round_trip(rt, model.name)
        assert rt.models[model.name].config is rt.config.model(model.name)


async def test_a_rollouts_and_its_versions_document_unchanged_reloads_the_table(
    autojump_clock, vworkers  # noqa: F811
):
    async with trioserve.open_runtime(family_config(versions=THREE, rollout=ROLLOUT)) as rt:
        assert shown(rt, "m")["version_policy"] == {"specific": {"versions": ["1", "2", "3"]}}
        await round_trip(rt, "m")
        assert rt.rollout_state("m")["state"] == "canary"  # afresh, as on any reload
        assert await y(rt, 3.0, "3") == 3000.0
        assert len(vworkers.made) == 6  # every version's copy, twice


@pytest.fixture
def two_gpus(monkeypatch):
    """torch sees two CUDA devices (the stand-in workers never touch them)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


async def test_a_model_on_several_devices_round_trips_and_its_groups_start_the_replicas(
    autojump_clock, workers, two_gpus  # noqa: F811
):
    cfg = control_config(devices=["cuda:0", "cuda:1"], replicas=3)
    async with trioserve.open_runtime(cfg) as rt:
        doc = shown(rt, "m")
        assert doc["instance_group"] == [
            {"name": "m_0", "count": 2, "kind": "KIND_GPU", "gpus": [0]},
            {"name": "m_1", "count": 1, "kind": "KIND_GPU", "gpus": [1]},
        ]
        await round_trip(rt, "m")
        assert rt.models["m"].config is rt.config.model("m")

        doc["instance_group"][1]["count"] = 2
        doc["instance_group"].append({"kind": "KIND_CPU"})
        made = len(workers.made)
        await rt.load_model("m", config=doc)
        assert rt.model_state("m") == (
            "READY", "runs the configuration its load gave (changed: devices, replicas)"
        )
        assert sorted(w.device for w in workers.made[made:]) == [
            "cpu", "cuda:0", "cuda:0", "cuda:1", "cuda:1"
        ]
        assert shown(rt, "m")["instance_group"] == [
            *doc["instance_group"][:2], {"name": "m_2", "count": 1, "kind": "KIND_CPU"}
        ]
        assert (await rt.infer("m", item(2.0)))["y"][0] == 2.0


async def test_an_autoscaled_models_document_unchanged_keeps_the_replicas_it_scaled_to(
    autojump_clock, workers  # noqa: F811
):
    cfg = control_config(replicas=1, autoscaling=trioserve.AutoscalingConfig(
        min_replicas=1, max_replicas=3, upscale_delay_s=0, interval_s=0.5,
    ))
    answers: dict = {}
    async with trioserve.open_runtime(cfg) as rt:
        t0 = trio.current_time()
        async with trio.open_nursery() as callers:
            for x in range(1, 31):
                callers.start_soon(call, rt, float(x), answers)
            await trio.sleep_until(t0 + 1.0)  # the first look (at 0.5 s) scaled up
            doc = shown(rt, "m")
            assert doc["instance_group"] == [{"name": "m_0", "count": 3, "kind": "KIND_CPU"}]
            await rt.load_model("m", config=doc)
            assert rt.model_state("m") == ("READY", "")  # the table: replicas = 1
            assert len(rt.models["m"].batchers) == 3
        assert answers == {float(x): [float(x)] for x in range(1, 31)}


async def test_a_larger_max_batch_size_in_the_document_batches_more(
    autojump_clock, workers  # noqa: F811
):
    answers: dict = {}

    async def eight(rt, base):
        async with trio.open_nursery() as callers:
            for x in range(8):
                callers.start_soon(call, rt, float(base + x), answers)

    async with trioserve.open_runtime(control_config(max_wait_ms=50)) as rt:
        await eight(rt, 0)
        assert batch_sizes() == [2, 2, 2, 2]
        doc = shown(rt, "m")
        doc["max_batch_size"] = 4
        await rt.load_model("m", config=doc)
        assert rt.model_state("m") == (
            "READY", "runs the configuration its load gave (changed: max_batch_size)"
        )
        assert shown(rt, "m")["max_batch_size"] == 4
        done = len(workers.ran)
        await eight(rt, 10)
        assert batch_sizes(done) == [4, 4]
        # the copy's own document, unchanged: that copy's configuration again
        await rt.load_model("m", config=shown(rt, "m"))
        assert rt.models["m"].config.max_batch_size == 4
        assert answers == {float(x): [float(x)] for b in (0, 10) for x in range(b, b + 8)}


async def test_a_refused_document_loads_nothing_and_the_copy_serves_on(
    autojump_clock, workers  # noqa: F811
):
    async with trioserve.open_runtime(control_config()) as rt:
        old = rt.models["m"]
        doc = shown(rt, "m")
        doc["input"][0]["data_type"] = "TYPE_INT64"
        with pytest.raises(ConfigError, match=r"^models\.m\.input: the model's inputs are "
                           r"its backend's .*\(models\.m\.input\[0\]\.data_type: the "
                           r"model's: 'TYPE_FP32', got 'TYPE_INT64'\)$"):
            await rt.load_model("m", config=doc)
        assert rt.models["m"] is old
        assert len(workers.made) == 1
        assert (await rt.infer("m", item(5.0)))["y"][0] == 5.0


async def test_a_promoted_canarys_document_unchanged_reloads_the_table(autojump_clock):
    """Once its canary is promoted the model's document is the canary's (it takes
    every unversioned request), and a load's config in that shape is read against
    the same copy: unchanged, it loads the table itself, not the canary's execution
    as a change of the model's."""
    from test_rollout_runtime import adder

    m = ModelConfig(
        name="m", backend=adder(1), max_wait_ms=0.0,
        versions={"1": {}, "2": {"backend": adder(2, execution="thread")}},
        rollout={"stable": "1", "canary": "2", "min_requests": 1000},
    )
    cfg = trioserve.Config(models=(m,), server=ServerConfig(model_control="explicit"))
    async with trioserve.open_runtime(cfg) as rt:
        rt.promote("m")
        doc = shown(rt, "m")
        assert doc == rt.triton_config("m", "2") != rt.triton_config("m", "1")
        assert doc["parameters"]["execution"] == {"string_value": "thread"}
        await rt.load_model("m", config=doc)
        assert rt.model_state("m") == ("READY", "")  # no config of its own
        assert rt.models["m"].config.execution is None
