"""Reading a configuration: a TOML file (:func:`load_config`) or a TOML-shaped
mapping (:func:`config_from_mapping`) into a :class:`~trioserve.Config`, the built-in
default (:func:`default_config`), and the checks of what ``open_runtime`` and the
commands are given (:func:`given_config`, :func:`in_file`).

The values themselves, and the checks of each key, are in runtime/_config.py.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from os import PathLike
from typing import Any

from ._config import (
    MAX_CONFIG_BYTES,
    CacheConfig,
    ClassConfig,
    Config,
    ModelConfig,
    RuntimeLimits,
    ServerConfig,
    TenantConfig,
    _build,
    _did_you_mean,
    minilm_available,
)
from ._config_checks import _key, _shown, bare_word_hint, yaml_hint
from ._errors import ConfigError
from ._ray_config import RayConfig

_TOP_KEYS = ("models", "tenants", "classes", "runtime", "server", "cache", "ray")


def config_from_mapping(data: Mapping[str, Any]) -> Config:
    """Build a Config from a parsed TOML document (``[models.NAME]``, ``[tenants.NAME]``,
    ``[classes.NAME]`` (in priority order, highest first), ``[runtime]``, ``[server]``,
    ``[cache]``, ``[ray]``)."""
    for key in data:
        if key not in _TOP_KEYS:
            raise ConfigError(f"{key}: unknown key;{_did_you_mean(key, _TOP_KEYS)} "
                              f"expected one of {', '.join(_TOP_KEYS)}")
    models_t = data.get("models", {})
    tenants_t = data.get("tenants", None)
    if not isinstance(models_t, Mapping):
        raise ConfigError("models: must be a table of [models.NAME] tables")
    models = tuple(
        _build(ModelConfig, t, f"models.{_key(n)}", name=n) for n, t in models_t.items()
    )
    kw: dict[str, Any] = {"models": models}
    if tenants_t is not None:
        if not isinstance(tenants_t, Mapping):
            raise ConfigError("tenants: must be a table of [tenants.NAME] tables")
        kw["tenants"] = tuple(
            _build(TenantConfig, t, f"tenants.{_key(n)}", name=n) for n, t in tenants_t.items()
        )
    classes_t = data.get("classes", None)
    if classes_t is not None:
        if not isinstance(classes_t, Mapping):
            raise ConfigError("classes: must be a table of [classes.NAME] tables, highest first")
        kw["classes"] = tuple(
            _build(ClassConfig, t, f"classes.{_key(n)}", name=n) for n, t in classes_t.items()
        )
    if "runtime" in data:
        kw["runtime"] = _build(RuntimeLimits, data["runtime"], "runtime")
    if "server" in data:
        kw["server"] = _build(ServerConfig, data["server"], "server")
    if "cache" in data:
        kw["cache"] = _build(CacheConfig, data["cache"], "cache")
    if "ray" in data:
        kw["ray"] = _build(RayConfig, data["ray"], "ray")
    return Config(**kw)


def default_config() -> Config:
    """The built-in configuration: ``echo``, ``mlp`` and (when installed) ``minilm`` on
    CPU, one open demo tenant, listening on 127.0.0.1:8000."""
    models = [
        ModelConfig(
            name="mlp", backend="mlp", max_batch_size=64, max_wait_ms=1.0, execution="process"
        ),
        ModelConfig(name="echo", backend="echo", max_batch_size=64, max_wait_ms=1.0),
    ]
    if minilm_available():
        models.append(
            ModelConfig(
                name="minilm",
                backend="minilm",
                max_batch_size=32,
                max_batch_tokens=4096,
                max_wait_ms=5.0,
                oversize="split",
            )
        )
    return Config(models=tuple(models), tenants=(TenantConfig(name="demo", default=True),))


def given_config(config: Any, call: str) -> Config:
    """``config`` as ``call`` (``open_runtime``, ``serve_in_thread``) takes it: a
    Config, or None for the built-in default. Anything else (a file's path, a parsed
    TOML mapping) is a ConfigError saying how to make a Config of it."""
    if config is None:
        return load_config()
    if isinstance(config, Config):
        return config
    if isinstance(config, str | PathLike):
        how = "read a config file with trioserve.load_config(path)"
    elif isinstance(config, Mapping):
        how = "build one from a TOML-shaped mapping with trioserve.config_from_mapping(data)"
    else:
        how = ("build one with trioserve.Config(models=[...]), or read a file with "
               "trioserve.load_config(path)")
    raise ConfigError(
        f"{call} takes a trioserve.Config (or None: the built-in default), got "
        f"{type(config).__name__} {_shown(config)}: {how}"
    )


def in_file(exc: ConfigError, path: str | PathLike[str] | None) -> ConfigError:
    """``exc`` as a command reports it: the file ``path`` named first, then the key
    (``my.toml: models.mlp.max_batch_size: ...``), so that an operator with several
    files knows which one to fix. ``exc`` itself when there is no file, or when it
    names the file already (it could not be read or parsed)."""
    if path is None or str(exc).startswith(f"{path}: "):
        return exc
    return ConfigError(f"{path}: {exc}")


def load_config(path: str | PathLike[str] | None = None) -> Config:
    """Read a TOML config file, or return the built-in default when ``path`` is None.

    Raises ConfigError naming the key and the reason for any invalid value, and
    naming the file when it cannot be read or parsed.
    """
    if path is None:
        return default_config()
    try:
        with open(path, "rb") as f:
            # A config is a few KiB: read one byte past the limit to know it is over
            # (a device such as /dev/zero, or a wrong file, would be read for ever).
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{path}: not a config file: over {MAX_CONFIG_BYTES // 1024**2} MiB"
        )
    if raw.startswith(b"\xef\xbb\xbf"):
        # a byte order mark, as Windows editors save UTF-8: tomllib refused it as
        # "Invalid statement (at line 1, column 1)"
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")  # TOML is UTF-8 (what tomllib.load decodes)
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{path}: invalid TOML: not UTF-8 text (byte 0x{raw[exc.start]:02x} "
            f"on line {line})"
        ) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        hint = yaml_hint(path, text) or bare_word_hint(str(exc), text)
        raise ConfigError(f"{path}: invalid TOML: {exc}{hint}") from None
    except ValueError as exc:  # an integer of more digits than int() converts
        raise ConfigError(f"{path}: invalid TOML: {str(exc).partition(';')[0]}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid TOML: arrays or tables nested too deeply") from None
    return config_from_mapping(data)
