"""The configuration of replicas on Ray (``execution = "ray"``, docs/configuration.md).

``[ray]`` says which Ray the runtime joins: ``address`` (None: a local Ray started in
this process; ``"auto"`` or ``"ray://host:port"``: a cluster's), ``namespace``, and
how long connecting may take (``start_timeout_s``).
A model's ``ray = { num_cpus, num_gpus, resources, runtime_env }`` are the options of
each of its replicas' Ray actors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ._config_checks import _did_you_mean, _field, _finite, _number, _shown, _str
from ._errors import ConfigError


def _optional_str(v: Any) -> None:
    if v is not None:
        _str(v)


def _whole_above_one(v: Any) -> None:
    # Ray's own rule for an amount of a resource: a fraction of one unit, or whole units
    if _finite(v) and v > 1 and v != int(v):
        raise ValueError(f"must be at most 1 or a whole number (Ray's rule), got {_shown(v)}")


def _gpus(v: Any) -> None:
    _number(0.0)(v)
    _whole_above_one(v)


def _resources(v: Any) -> None:
    if not isinstance(v, Mapping):
        raise ValueError(f"must be a table of resource name -> amount, got {_shown(v)}")
    for name, amount in v.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"a resource's name must be a non-empty string, got {_shown(name)}")
        if name in ("CPU", "GPU"):
            raise ValueError(
                f"{name!r} is not set here: use num_{name.lower()}s (Ray refuses it)"
            )
        try:
            _number(0.0)(amount)
            _whole_above_one(amount)
        except ValueError as exc:
            raise ValueError(f"{name!r}: {exc}") from None


def _runtime_env(v: Any) -> None:
    if v is not None and not isinstance(v, Mapping):
        raise ValueError(f"must be a table (Ray's runtime_env), got {_shown(v)}")


#: How long ``ray.init`` may take (``ray.start_timeout_s``) unless configured: a local
#: Ray's head processes start in seconds, and joining a cluster takes a round of Ray's
#: own connection retries; two minutes allows a loaded machine either, and a wrong or
#: unreachable address still fails the start instead of holding it forever.
DEFAULT_RAY_START_TIMEOUT_S = 120.0
#: An hour: a ``ray.init`` that has not returned by then is stuck, not slow.
MAX_RAY_START_TIMEOUT_S = 3600.0


@attrs.frozen(kw_only=True)
class RayConfig:
    """Which Ray the runtime joins (``[ray]``), when a model's ``execution`` is
    ``"ray"``: ``address`` None starts a local Ray in this process (and stops it
    when the runtime closes); ``"auto"`` or ``"ray://host:port"`` joins a running
    cluster. ``namespace`` (None: Ray's, anonymous) holds the replicas' actors.
    ``start_timeout_s`` bounds ``ray.init``: past it the start fails (ConfigError). A
    Ray already initialised in this process is used as it is, and left running."""

    address: str | None = _field(_optional_str, None)
    namespace: str | None = _field(_optional_str, None)
    start_timeout_s: float = _field(
        _number(0.0, strict=True, maximum=MAX_RAY_START_TIMEOUT_S), DEFAULT_RAY_START_TIMEOUT_S
    )

    def _path(self) -> str:
        return "ray"


@attrs.frozen(kw_only=True)
class RayReplicaConfig:
    """The Ray actor options of each replica of a model (``models.NAME.ray``):
    ``num_cpus``, ``num_gpus`` (above 0: the replica loads its model on ``cuda:0``,
    the GPU Ray gave it), custom ``resources`` and a ``runtime_env``."""

    num_cpus: float = _field(_number(0.0), 1.0)
    num_gpus: float = _field(_gpus, 0.0)
    resources: Mapping[str, float] = _field(_resources, attrs.Factory(dict))
    runtime_env: Mapping[str, Any] | None = _field(_runtime_env, None)

    def _path(self) -> str:
        return "ray"

    @property
    def device(self) -> str:
        """Where a replica loads its model in its actor: Ray sets CUDA_VISIBLE_DEVICES
        to the GPU it gave, which torch then sees as ``cuda:0``."""
        return "cuda:0" if self.num_gpus > 0 else "cpu"

    def asked(self) -> dict[str, float]:
        """The resources each actor asks for, by Ray's names (``CPU``, ``GPU``, the
        custom ones), those of amount 0 left out."""
        asked = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {name: float(amount) for name, amount in asked.items() if amount > 0}

    def actor_options(self) -> dict[str, Any]:
        """The options of ``ActorClass.options(...)``."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            options["resources"] = dict(self.resources)
        if self.runtime_env is not None:
            options["runtime_env"] = dict(self.runtime_env)
        return options


def amounts(resources: Mapping[str, float], names: Any = None) -> str:
    """``resources`` (or those of ``names``, 0 when absent) as ``CPU 0.5, GPU 1``."""
    names = resources.keys() if names is None else names
    return ", ".join(f"{name} {resources.get(name, 0.0):g}" for name in names)


def unplaceable(asked: Mapping[str, float], nodes: list[Mapping[str, float]]) -> str | None:
    """Why an actor asking for ``asked`` fits on none of ``nodes`` (each node's
    total resources, as Ray counts them), or None when one of them has it all."""
    if any(all(node.get(name, 0.0) >= amount for name, amount in asked.items())
           for node in nodes):
        return None
    if not nodes:
        return "the Ray has no live node"
    has = "; ".join(amounts(node, asked) for node in nodes)
    node_has = "its node has" if len(nodes) == 1 else "its nodes have"
    return f"it asks for {amounts(asked)}, more than any node of the Ray has ({node_has} {has})"


def ray_replica(value: Any, path: str) -> Any:
    """A model's ``ray`` table (or a mapping from Python) as a RayReplicaConfig, its
    errors naming the model's key; anything else is returned for the validator."""
    if not isinstance(value, Mapping):
        return value
    names = [f.name for f in attrs.fields(RayReplicaConfig)]
    for key in value:
        if key not in names:
            raise ConfigError(
                f"{path}.ray.{key}: unknown key;{_did_you_mean(key, names)} "
                f"expected one of {', '.join(names)}"
            )
    try:
        return RayReplicaConfig(**value)
    except ConfigError as exc:
        raise ConfigError(f"{path}.{exc}") from None


def ray_config(value: Any) -> Any:
    """The ``[ray]`` table (or a mapping from Python) as a RayConfig."""
    if not isinstance(value, Mapping):
        return value
    names = [f.name for f in attrs.fields(RayConfig)]
    for key in value:
        if key not in names:
            raise ConfigError(f"ray.{key}: unknown key;{_did_you_mean(key, names)} "
                              f"expected one of {', '.join(names)}")
    return RayConfig(**value)
