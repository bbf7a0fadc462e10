"""The configuration of a model's versions and of their rollout.

``versions`` is a list of names (one backend serves them all), or a table of name ->
a table of overrides (``backend``, ``options``), in document order: a version with an
override gets a backend of its own. ``[models.NAME.rollout]`` names the ``stable``
version, an optional ``canary`` under trial (its share of unversioned requests grows
by ``steps``, and it is promoted or rolled back by its figures) and an optional
``shadow`` that gets a copy of stable's requests (docs/rollout.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import attrs

from ._config_checks import (
    _did_you_mean,
    _field,
    _int,
    _key,
    _mapping,
    _number,
    _segment,
    _shown,
    _str,
)
from ._errors import ConfigError
from ._model import ModelBackend

#: The canary's shares of unversioned requests, step by step, when ``steps`` is not set.
DEFAULT_STEPS = (0.05, 0.25, 0.5)
#: The most copies ``shadow_queue`` may hold waiting for the shadow.
MAX_SHADOW_QUEUE = 65_536


class VersionList(tuple):
    """A model's version names, in order (the last is the latest), as a tuple of
    strings; ``tables`` holds each version's :class:`VersionConfig` when the config
    gave a table of versions (None: a plain list, one backend serves them all)."""

    tables: Mapping[str, VersionConfig] | None

    def __new__(cls, names: Any, tables: Mapping[str, VersionConfig] | None = None) -> Any:
        self = super().__new__(cls, names)
        self.tables = tables
        return self

    def __eq__(self, other: object) -> bool:
        if isinstance(other, VersionList) and self.tables != other.tables:
            return False
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return tuple.__hash__(self)

    def __repr__(self) -> str:
        if self.tables is None:
            return tuple.__repr__(self)
        return repr(dict(self.tables))

    def own(self, version: str) -> bool:
        """Whether ``version`` has a backend of its own (an override)."""
        t = self.tables.get(version) if self.tables is not None else None
        return t is not None and t.overrides


@attrs.frozen(kw_only=True)
class VersionConfig:
    """One version's overrides (``[models.NAME.versions.V]``): ``backend`` (None:
    the model's) and ``options``, merged over the model's. A version with either
    gets its own backend instance, queue and replicas; an empty table is served by
    the model's backend, as a bare name in a list is."""

    name: str = _field(_segment)
    backend: Any = attrs.field(default=None)
    options: Mapping[str, Any] | None = _field(
        lambda v: v is None or _mapping(v), None
    )

    @property
    def overrides(self) -> bool:
        return self.backend is not None or self.options is not None

    def _path(self) -> str:
        return f"versions.{_key(self.name)}"


def _steps(v: Any) -> None:
    if not isinstance(v, tuple) or not v:
        raise ValueError(f"must be a non-empty list of shares in (0, 1], got {_shown(v)}")
    for s in v:
        ok = isinstance(s, int | float) and not isinstance(s, bool) and 0.0 < s <= 1.0
        if not ok:
            raise ValueError(f"each share must be a number in (0, 1], got {_shown(s)}")
    if any(b <= a for a, b in itertools.pairwise(v)):
        raise ValueError(f"must be increasing, got {list(v)!r}")


def _opt_str(v: Any) -> None:
    if v is not None:
        _str(v)


def _tuple(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


@attrs.frozen(kw_only=True)
class RolloutConfig:
    """``[models.NAME.rollout]``: which version unversioned requests go to, and the
    trial of a canary and a shadow (docs/rollout.md)."""

    stable: str = _field(_str)
    canary: str | None = _field(_opt_str, None)
    steps: tuple[float, ...] = _field(_steps, DEFAULT_STEPS, converter=_tuple)
    step_s: float = _field(_number(0.0, strict=True), 60.0)
    min_requests: int = _field(_int(1), 100)
    max_error_rate: float = _field(_number(0.0, maximum=1.0), 0.01)
    max_latency_ratio: float = _field(_number(0.0, strict=True), 1.5)
    shadow: str | None = _field(_opt_str, None)
    shadow_share: float = _field(
        lambda v: _number(0.0, strict=True, maximum=1.0)(v), 1.0
    )
    shadow_rtol: float = _field(_number(0.0), 1e-5)
    shadow_atol: float = _field(_number(0.0), 1e-6)
    #: copies waiting for the shadow at most; past it a copy is dropped (counted).
    #: Bounded: a channel of millions of places is no bound on memory at all.
    shadow_queue: int = _field(_int(1, MAX_SHADOW_QUEUE), 64)

    def _path(self) -> str:
        return "rollout"


def _prefixed(exc: ConfigError, inner: str, path: str) -> ConfigError:
    text = str(exc)
    if text.startswith(inner):
        return ConfigError(f"{path}.{text}")
    return exc


def version_list(value: Any, path: str) -> Any:
    """``versions`` as given (a list of names, or a table of name -> overrides) as a
    VersionList; anything else is returned for the validator to refuse."""
    if isinstance(value, VersionList):
        return value
    if isinstance(value, list | tuple):
        return VersionList(value)
    if not isinstance(value, Mapping):
        return value
    if not value:
        raise ConfigError(f"{path}.versions: must not be empty")
    tables: dict[str, VersionConfig] = {}
    for name, table in value.items():
        where = f"{path}.versions.{_key(name)}"
        try:
            _segment(name)
        except ValueError as exc:
            raise ConfigError(f"{where}: the name {exc}") from None
        if isinstance(table, VersionConfig):
            if table.name != name:
                raise ConfigError(f"{where}: names version {table.name!r}")
            tables[name] = table
            continue
        if not isinstance(table, Mapping):
            raise ConfigError(
                f"{where}: must be a table of overrides (backend, options), got {_shown(table)}"
            )
        for key in table:
            if key not in ("backend", "options"):
                raise ConfigError(
                    f"{where}.{key}: unknown key;{_did_you_mean(key, ('backend', 'options'))} "
                    "a version may override backend, options"
                )
        try:
            tables[name] = VersionConfig(name=name, **table)
        except ConfigError as exc:
            raise _prefixed(exc, "versions.", path) from None
    return VersionList(tuple(tables), tables)


def rollout_config(value: Any, path: str) -> Any:
    """A ``rollout`` table (or a mapping from Python) as a RolloutConfig."""
    if not isinstance(value, Mapping):
        return value
    names = [f.name for f in attrs.fields(RolloutConfig)]
    for key in value:
        if key not in names:
            raise ConfigError(
                f"{path}.rollout.{key}: unknown key;{_did_you_mean(key, names)} "
                f"expected one of {', '.join(names)}"
            )
    if "stable" not in value:
        raise ConfigError(f"{path}.rollout.stable: is required")
    try:
        return RolloutConfig(**value)
    except ConfigError as exc:
        raise _prefixed(exc, "rollout.", path) from None


def check_versions(model: Any) -> None:
    """The checks of a model's versions and rollout that need the whole model."""
    path = model._path()
    versions = model.versions
    if versions.tables is not None:
        for v, t in versions.tables.items():
            backend = t.backend
            if backend is None:
                continue
            if isinstance(backend, str):
                from ._config import BUILTIN_BACKENDS, _import_string

                if backend not in BUILTIN_BACKENDS and not _import_string(backend):
                    raise ConfigError(
                        f"{path}.versions.{_key(v)}.backend: {_shown(backend)} is neither "
                        f"a built-in backend ({', '.join(BUILTIN_BACKENDS)}) nor an import "
                        "string 'module:attr'"
                    )
            elif not callable(backend) and not isinstance(backend, ModelBackend):
                raise ConfigError(
                    f"{path}.versions.{_key(v)}.backend: must be a built-in backend's name, "
                    "an import string 'module:attr', a ModelBackend or a callable "
                    f"returning one, got {_shown(backend)}"
                )
    r = model.rollout
    if r is None:
        return
    if not isinstance(r, RolloutConfig):
        raise ConfigError(f"{path}.rollout: must be a table (a RolloutConfig), got {_shown(r)}")
    listed = ", ".join(versions)
    for role in ("stable", "canary", "shadow"):
        v = getattr(r, role)
        if v is not None and v not in versions:
            raise ConfigError(
                f"{path}.rollout.{role}: {v!r} is not one of the model's versions ({listed})"
            )
    if r.canary is not None and r.canary == r.stable:
        raise ConfigError(f"{path}.rollout.canary: must differ from stable ({r.stable!r})")
    if r.shadow is not None and r.shadow in (r.stable, r.canary):
        which = "stable" if r.shadow == r.stable else "the canary"
        raise ConfigError(
            f"{path}.rollout.shadow: must be another version than {which} ({r.shadow!r})"
        )
