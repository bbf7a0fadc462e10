"""A load's config in Triton's shape (runtime/_triton_config.py), sans-IO: the
document the config endpoint gives (``triton_config``) read back into keys of the
model's table (``from_triton``) and laid over it as any load's config
(``with_load_config``). Unchanged, it is the table itself, whatever the table says;
each key of one copy reads back into the table's; what the model is may be repeated
but not changed; a value of the wrong shape is refused naming the key."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import attrs
import orjson
import pytest
from runtime_helpers import X, Y
from trioserve import CallableBackend, ConfigError, ModelConfig
from trioserve._load_config import changed_keys, with_load_config
from trioserve._triton_config import (
    _FIXED,
    PARAMETERS,
    TRITON_KEYS,
    from_triton,
    triton_config,
    triton_shaped,
)

CLASSES = ["realtime", "batch"]


def served(table: ModelConfig | None = None, *, live: Any = None, **cfg: Any) -> Any:
    """A served model as triton_config reads it: its config, backend and replicas
    (one per ``live`` device; default: the config's)."""
    m = table if table is not None else ModelConfig(name="m", backend="echo", **cfg)
    backend = CallableBackend(lambda items: items, inputs=[X], outputs=[Y])
    devices = m.replica_devices if live is None else live
    return SimpleNamespace(
        config=m, backend=backend, batchers=[SimpleNamespace(device=d) for d in devices]
    )


def doc(s: Any) -> dict[str, Any]:
    """The config endpoint's document of ``s``, as a client reads it off the wire."""
    return orjson.loads(orjson.dumps(triton_config(s, "python", CLASSES)))


def load(s: Any, given: Any, table: ModelConfig | None = None) -> ModelConfig:
    """What a load of ``given`` runs, ``s`` serving and ``table`` the configuration's."""
    table = table if table is not None else s.config
    return with_load_config(table, from_triton(given, s, table, CLASSES))


TABLES = {
    "defaults": {},
    "sub-microsecond-wait": {"max_wait_ms": 2.0005},
    "cpu-devices": {"devices": ["cpu:0", "cpu:1"], "replicas": 3},
    "gpus": {"devices": ["cuda:0", "cuda:1"], "replicas": 3},
    "gpu-without-index": {"devices": ["cuda", "cpu"]},
    "repeated-device": {"devices": ["cpu", "cuda:1", "cuda:1"], "replicas": 3},
    "parameters": {"max_batch_tokens": 512, "timeout_ms": 1.5, "oversize": "split",
                   "execution": "process", "cache": False},
    "no-timeout": {"timeout_ms": None},
    "versions-and-rollout": {
        "versions": {"1": {}, "2": {"options": {"tag": "2"}}},
        "rollout": {"stable": "1", "canary": "2"},
    },
    "autoscaled": {"replicas": 1, "autoscaling": {"min_replicas": 1, "max_replicas": 4}},
}


@pytest.mark.parametrize("table", TABLES.values(), ids=TABLES.keys())
def test_the_unchanged_document_reads_back_as_the_table_itself(table):
    s = served(**table)
    assert load(s, doc(s)) is s.config
    assert load(s, copy.deepcopy(triton_config(s, "python", CLASSES))) is s.config  # in-process


def test_an_autoscaled_models_groups_read_back_as_its_table_whatever_it_scaled_to():
    s = served(replicas=1, autoscaling={"min_replicas": 1, "max_replicas": 4},
               live=["cpu"] * 3)
    d = doc(s)
    assert d["instance_group"] == [{"name": "m_0", "count": 3, "kind": "KIND_CPU"}]
    assert load(s, d) is s.config  # a reload keeps the three it scaled to
    d["max_batch_size"] = 8
    assert changed_keys(s.config, load(s, d)) == ["max_batch_size"]


def test_a_copy_with_a_config_of_its_own_reads_back_as_that_copy():
    table = ModelConfig(name="m", backend="echo")
    own = with_load_config(table, {"max_wait_ms": 0.0004, "devices": ["cpu:1"],
                                   "timeout_ms": 10.25})
    s = served(own)
    assert load(s, doc(s), table) == own
    # the model's not loaded (its stand-in: the table, no replica): a document kept
    # from the copy that served loads what it says (in whole microseconds; a group
    # of KIND_CPU on cpu)
    stand_in = served(table, live=[])
    assert doc(stand_in)["instance_group"] == []
    m = load(stand_in, doc(s), table)
    assert changed_keys(table, m) == ["max_wait_ms", "timeout_ms"]
    assert (m.max_wait_ms, m.timeout_ms, m.devices) == (0.0, 10.25, ("cpu",))


def edit(path: str, value: Any) -> Any:
    """A change to the document: ``value`` at ``path`` (dotted; ``[i]`` an item)."""

    def apply(d: dict[str, Any]) -> None:
        *parents, last = path.replace("[", ".[").split(".")
        node: Any = d
        for p in parents:
            node = node[int(p[1:-1])] if p.startswith("[") else node[p]
        if last.startswith("["):
            node[int(last[1:-1])] = value
        else:
            node[last] = value

    return apply


CHANGES = {
    "max_batch_size": (edit("max_batch_size", 32), {"max_batch_size": 32}),
    "queue-delay": (
        edit("dynamic_batching.max_queue_delay_microseconds", 500), {"max_wait_ms": 0.5}
    ),
    "queue-delay-as-protobuf-json": (
        edit("dynamic_batching.max_queue_delay_microseconds", "7000"), {"max_wait_ms": 7.0}
    ),
    "count": (edit("instance_group[0].count", 3), {"replicas": 3}),
    "to-gpus": (
        edit("instance_group", [{"kind": "KIND_GPU", "gpus": [0, 1]}]),
        {"devices": ("cuda:0", "cuda:1"), "replicas": 2},
    ),
    "gpu-group-added": (
        lambda d: d["instance_group"].append(
            {"name": "m_1", "count": 2, "kind": "KIND_GPU", "gpus": [0, 1]}
        ),
        # five replicas, 1 + 2 + 2: round-robin over three devices would be 2 + 2 + 1
        {"devices": ("cpu", "cuda:0", "cuda:0", "cuda:1", "cuda:1"), "replicas": 5},
    ),
    "oversize": (edit("parameters.oversize", {"string_value": "split"}),
                 {"oversize": "split"}),
    "max_batch_tokens": (edit("parameters.max_batch_tokens", {"string_value": "512"}),
                         {"max_batch_tokens": 512}),
    "timeout_ms": (edit("parameters.timeout_ms", {"string_value": "1500.5"}),
                   {"timeout_ms": 1500.5}),
}


@pytest.mark.parametrize(("change", "wanted"), CHANGES.values(), ids=CHANGES.keys())
def test_each_key_of_one_copy_reads_back_into_the_tables(change, wanted):
    s = served()
    d = doc(s)
    change(d)
    m = load(s, d)
    assert set(changed_keys(s.config, m)) == set(wanted)
    assert {k: getattr(m, k) for k in wanted} == wanted


def test_a_gpu_group_unchanged_keeps_its_device_and_a_cpu_one_its_index():
    s = served(devices=["cuda", "cpu:1"], replicas=2)
    d = doc(s)
    assert d["instance_group"] == [
        {"name": "m_0", "count": 1, "kind": "KIND_GPU", "gpus": [0]},
        {"name": "m_1", "count": 1, "kind": "KIND_CPU"},
    ]
    d["instance_group"][1]["count"] = 2
    m = load(s, d)
    assert (m.devices, m.replicas) == (("cuda", "cpu:1", "cpu:1"), 3)


@pytest.mark.parametrize(
    ("key", "value"),
    [("execution", "process"), ("cache", "false")],
)
def test_a_parameter_a_load_may_not_change_is_refused_as_in_the_table_but_repeated_is_taken(
    key, value
):
    s = served()
    d = doc(s)
    assert load(s, d) is s.config  # repeated (execution as the backend's default)
    d["parameters"][key] = {"string_value": value}
    with pytest.raises(ConfigError, match=rf"^models\.m\.{key}: a load's config cannot "
                       "change it: "):
        load(s, d)


REFUSED = {
    "name": ("name", "other",
             "models.m.name: a load's config is for the model the load names ('m'), got "
             "'other'"),
    "platform": ("platform", "pytorch",
                 "models.m.platform: the platform is the backend's (pytorch for a torch "
                 "module, python else): a load cannot change it (the model's: 'python', "
                 "got 'pytorch')"),
    "backend": ("backend", "mlp",
                "models.m.backend: the backend is what the model is: another backend is "
                "another model: a load cannot change it (the model's: 'echo', got 'mlp')"),
    "version_policy": ("version_policy", {"latest": {"num_versions": 1}},
                       "models.m.version_policy: the versions are the repository's, "
                       "which clients and the rollout address: a load cannot change it "
                       "(models.m.version_policy.specific: the model's: {'versions': "
                       "['1']}, got none)"),
    "input": ("input[0].dims", [4],
              "models.m.input: the model's inputs are its backend's (its options may "
              "change them): a load cannot change it (models.m.input[0].dims[0]: the "
              "model's: -1, got 4)"),
    "output": ("output", [],
               "models.m.output: the model's outputs are its backend's"),
    "priority_levels": ("dynamic_batching.priority_levels", 3,
                        "models.m.dynamic_batching.priority_levels: the priority levels "
                        "are the server's request classes ([[classes]]), one each: a load "
                        "cannot change it (the model's: 2, got 3)"),
    "preferred_batch_size": ("dynamic_batching.preferred_batch_size", [4, 8],
                             "models.m.dynamic_batching.preferred_batch_size: batches "
                             "close at max_batch_size"),
    "preserve_ordering": ("dynamic_batching.preserve_ordering", True,
                          "models.m.dynamic_batching.preserve_ordering: each answer goes "
                          "to its own caller"),
    "default_priority_level": ("dynamic_batching.default_priority_level", 1,
                               "models.m.dynamic_batching.default_priority_level: level 0 "
                               "is a request's tenant's default class"),
    "preserve_ordering-as-0": ("dynamic_batching.preserve_ordering", 0,
                               "models.m.dynamic_batching.preserve_ordering: "),
    "group-name": ("instance_group[0].name", "gpu_pool",
                   "models.m.instance_group[0].name: a group's name is the model's, not "
                   "a load's to give: one its groups have now ('m_0') or, for a group "
                   "added, 'm_0' (by its place), each once; or leave it out, got "
                   "'gpu_pool'"),
    "queue-policy": ("dynamic_batching.default_queue_policy", {},
                     "models.m.dynamic_batching.default_queue_policy: not one the model's "
                     "dynamic batching has (it gives preferred_batch_size, "
                     "max_queue_delay_microseconds, preserve_ordering, priority_levels, "
                     "default_priority_level)"),
    "optimization": ("optimization", {},
                     "models.m.optimization: not a key of the model's configuration in "
                     "Triton's shape (a load's config is either Triton's, with the keys "
                     "GET /v2/models/NAME/config gives: name, platform, backend, "
                     "version_policy, max_batch_size, input, output, dynamic_batching, "
                     "instance_group, parameters; or keys of the model's [models.NAME] "
                     "table, not both)"),
    "a-tables-key": ("replicas", 2,
                     "models.m.replicas: not a key of the model's configuration in "
                     "Triton's shape"),
    "a-tables-key-hint": ("max_wait_ms", 2,
                          "; Triton's shape gives it as "
                          "dynamic_batching.max_queue_delay_microseconds"),
    "parameter": ("parameters.slo_ms", {"string_value": "5"},
                  "models.m.parameters.slo_ms: not one the model's parameters have (they "
                  "give execution, oversize, max_batch_tokens, timeout_ms, cache)"),
}


@pytest.mark.parametrize(("path", "value", "error"), REFUSED.values(), ids=REFUSED.keys())
def test_a_changed_key_that_says_what_the_model_is_is_refused_naming_it(path, value, error):
    s = served()
    d = doc(s)
    edit(path, value)(d)
    with pytest.raises(ConfigError) as exc:
        load(s, d)
    assert error in str(exc.value)


BAD = {
    "timeout-word": ("parameters.timeout_ms", {"string_value": "soon"},
                     "models.m.parameters.timeout_ms.string_value: must be a number (as a "
                     "string), got 'soon'"),
    "timeout-inf": ("parameters.timeout_ms", {"string_value": "1e999"}, "must be a number"),
    "timeout-space": ("parameters.timeout_ms", {"string_value": " 5"}, "must be a number"),
    "timeout-underscore": ("parameters.timeout_ms", {"string_value": "1_000"},
                           "must be a number"),
    "timeout-negative": ("parameters.timeout_ms", {"string_value": "-5"},
                         "models.m.timeout_ms: "),  # parsed, then the table's own check
    "tokens-fraction": ("parameters.max_batch_tokens", {"string_value": "1.5"},
                        "models.m.parameters.max_batch_tokens.string_value: must be an "
                        "integer (as a string), got '1.5'"),
    "cache-yes": ("parameters.cache", {"string_value": "yes"},
                  "models.m.parameters.cache.string_value: must be \"true\" or \"false\" "
                  "(as a string), got 'yes'"),
    "oversize-unknown": ("parameters.oversize", {"string_value": "drop"},
                         "models.m.oversize: "),
    "parameter-not-a-string": ("parameters.timeout_ms", {"string_value": 5},
                               "models.m.parameters.timeout_ms: must be {\"string_value\": "
                               "\"...\"} (Triton's parameter), got {'string_value': 5}"),
    "parameter-other-field": ("parameters.timeout_ms", {"int64_value": 5},
                              "models.m.parameters.timeout_ms: must be {\"string_value\""),
    "parameters-not-a-map": ("parameters", [], "models.m.parameters: must be an object"),
    "batching-not-a-map": ("dynamic_batching", 5,
                           "models.m.dynamic_batching: must be an object"),
    "delay-negative": ("dynamic_batching.max_queue_delay_microseconds", -1,
                       "models.m.dynamic_batching.max_queue_delay_microseconds: must be a "
                       "whole number of microseconds >= 0, got -1"),
    "delay-fraction": ("dynamic_batching.max_queue_delay_microseconds", 1.5,
                       "whole number of microseconds"),
    "delay-bool": ("dynamic_batching.max_queue_delay_microseconds", True,
                   "whole number of microseconds"),
    "groups-not-a-list": ("instance_group", {"count": 2},
                          "models.m.instance_group: must be a list of instance groups"),
    "group-not-a-map": ("instance_group[0]", 2,
                        "models.m.instance_group[0]: must be an object (an instance group)"),
    "count-zero": ("instance_group[0].count", 0,
                   "models.m.instance_group[0].count: must be an integer >= 1, got 0"),
    "count-bool": ("instance_group[0].count", True, "must be an integer >= 1, got True"),
    "count-huge": ("instance_group[0].count", 10**12,
                   "models.m.instance_group: at most 256 instances in all (the model's "
                   "replicas), got 1000000000001"),
    "kind-auto": ("instance_group[0].kind", "KIND_AUTO",
                  "models.m.instance_group[0].kind: must be KIND_CPU or KIND_GPU (with "
                  "gpus), got 'KIND_AUTO'"),
    "gpu-without-gpus": ("instance_group[0].kind", "KIND_GPU",
                         "models.m.instance_group[0].gpus: a KIND_GPU group names its GPUs, "
                         "a list of indices >= 0 (cuda:N), got None"),
    "gpus-negative": ("instance_group[0]", {"kind": "KIND_GPU", "gpus": [-1]},
                      "models.m.instance_group[0].gpus: a KIND_GPU group names its GPUs"),
    "cpu-with-gpus": ("instance_group[0].gpus", [0],
                      "models.m.instance_group[0].gpus: a KIND_CPU group has no gpus, got "
                      "[0]"),
    "group-profile": ("instance_group[0].profile", ["p"],
                      "models.m.instance_group[0].profile: not one the model's instance "
                      "groups have (they give name, kind, count and gpus)"),
    "group-name-twice": ("instance_group[1]", {"name": "m_0", "kind": "KIND_CPU"},
                         "models.m.instance_group[1].name: a group's name is the model's, "
                         "not a load's to give: one its groups have now ('m_0') or, for a "
                         "group added, 'm_1' (by its place), each once"),
    "max_batch_size-zero": ("max_batch_size", 0,
                            "models.m.max_batch_size: must be an integer >= 1, got 0"),
}


@pytest.mark.parametrize(("path", "value", "error"), BAD.values(), ids=BAD.keys())
def test_a_value_of_the_wrong_shape_is_refused_naming_the_key(path, value, error):
    s = served()
    d = doc(s)
    d["instance_group"].append({"kind": "KIND_CPU"})  # (for an edit of the second)
    edit(path, value)(d)
    with pytest.raises(ConfigError) as exc:
        load(s, d)
    assert error in str(exc.value)


def test_a_config_is_in_tritons_shape_when_it_has_any_of_tritons_own_keys():
    assert triton_shaped({"input": []})
    assert triton_shaped({"name": "m", "max_batch_size": 4, "parameters": {}})
    assert not triton_shaped({"name": "m", "max_batch_size": 4})  # the table's too
    assert not triton_shaped({"backend": "echo"})
    assert not triton_shaped(None)
    assert not triton_shaped(["input"])
    assert TRITON_KEYS.isdisjoint(attrs.fields_dict(ModelConfig))


def test_every_key_the_document_gives_is_read_back_or_fixed():
    """A key added to the document must be decided on: read back, or fixed (why)."""
    d = doc(served(max_batch_tokens=4))
    read_back = {"name", "max_batch_size", "dynamic_batching", "instance_group",
                 "parameters"}
    assert set(d) == read_back | {k for k in _FIXED if "." not in k}
    assert set(d["dynamic_batching"]) == {"max_queue_delay_microseconds"} | {
        k.partition(".")[2] for k in _FIXED if k.startswith("dynamic_batching.")
    }
    assert set(d["parameters"]) == set(PARAMETERS)
    assert set(PARAMETERS) <= set(attrs.fields_dict(ModelConfig))
