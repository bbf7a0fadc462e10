"""A load's configuration (docs/model-control.md): the keys of a model's
``[models.NAME]`` table that one load (``Runtime.load_model(name, config=...)``,
Triton's ``{"parameters": {"config": ...}}``) may give, laid over the table for that
load only, and why the others are refused.

Only what belongs to one loaded copy may change: its replicas, its batching, its
timers and its constructor options. What the model is (its backend, versions and
rollout), how it runs (set up when the server starts) and what carries on from copy
to copy (the result cache's rules, its objective, its autoscaler, its lanes'
counters) is the configuration's.

Sans-IO: a ModelConfig and a mapping in, a ModelConfig out, or ConfigError naming
the key, as the TOML table's errors do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ._config import ModelConfig, check_keys
from ._config_checks import _shown
from ._errors import ConfigError
from ._model import ModelBackend

#: The keys a load's config may give: each is read when a copy starts (its queue,
#: replicas, batch timer, hedging, backend), so the copy loaded runs with it.
PER_COPY = (
    "devices", "replicas", "max_batch_size", "max_batch_tokens", "max_wait_ms", "oversize",
    "timeout_ms", "torch_threads", "load_timeout_s", "adaptive_limit",
    "batch_timeout_factor", "batch_timeout_floor_ms", "batch_timeout_cap_ms",
    "poison_attempts", "slow_lane_replicas", "hedge", "hedge_after_ms", "options",
)

_RUNS = "how the model runs is set up when the server starts (worker processes, Ray)"
_CACHE = "the result cache's rules are set when the server starts, for every copy of the model"

#: The keys a load's config may not give, and why. (``name`` may be given if it is
#: the model's own: Triton's configs carry it.)
REFUSED: Mapping[str, str] = {
    "backend": "the backend is what the model is: another backend is another model",
    "versions": "the versions are the repository's, which clients and the rollout address",
    "rollout": (
        "a rollout is the configuration's: its trial and the decisions kept for it "
        "(runtime.rollout_state_file) are made for that configuration"
    ),
    "execution": _RUNS,
    "ray": _RUNS,
    "cache": _CACHE,
    "cache_ttl_s": _CACHE,
    "cache_shared": _CACHE,
    "coalesce": "in-flight coalescing is set up when the server starts, for every copy",
    "slo_ms": "the model's objective carries on from copy to copy (its counts with it)",
    "slo_target": "the model's objective carries on from copy to copy (its counts with it)",
    "autoscaling": (
        "the autoscaler's decisions carry on from copy to copy, and a reload keeps the "
        "replicas it scaled to"
    ),
    "slow_lane_cost": (
        "the lanes' flows' counters carry on lane by lane from copy to copy: a load "
        "cannot add, remove or move the slow lane"
    ),
    "load_at_start": "only the server's start reads it",
}


def with_load_config(m: ModelConfig, given: Any) -> ModelConfig:
    """``m`` (the configuration's table) with the keys of ``given`` laid over it;
    ``options`` are laid over the table's option by option. ``m`` itself when that
    changes nothing. Not a checkpoint.

    Raises ConfigError naming the key: unknown keys and bad values as the TOML
    table's errors say them, and a key a load may not change, with why.
    """
    path = m._path()
    if not isinstance(given, Mapping):
        raise ConfigError(
            f"{path}: a load's config must be a table of the model's keys (as "
            f"[models.{m.name}]), got {_shown(given)}"
        )
    if "name" in given and given["name"] != m.name:
        raise ConfigError(
            f"{path}.name: a load's config is for the model the load names "
            f"({m.name!r}), got {_shown(given['name'])}"
        )
    changes = {k: v for k, v in given.items() if k != "name"}
    check_keys(ModelConfig, changes, path, ("name",))  # as the TOML table's
    for key in changes:
        if key in REFUSED:
            raise ConfigError(f"{path}.{key}: a load's config cannot change it: {REFUSED[key]}")
    if "options" in changes:
        if isinstance(m.backend, ModelBackend):
            raise ConfigError(
                f"{path}.options: the model's backend is a ModelBackend object, made "
                "before the configuration: it takes no options (options reach a backend "
                "a factory or an import string makes)"
            )
        if isinstance(changes["options"], Mapping):
            changes["options"] = {**m.options, **changes["options"]}
    new = attrs.evolve(m, **changes)
    return m if new == m else new


def changed_keys(table: ModelConfig, m: ModelConfig) -> list[str]:
    """The keys whose values differ between ``table`` and ``m``, in the table's order."""
    return [
        f.name for f in attrs.fields(ModelConfig) if getattr(table, f.name) != getattr(m, f.name)
    ]
