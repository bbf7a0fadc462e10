"""Built-in models for demos, tests and benchmarks, and backend resolution."""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._config import ModelConfig
from ._config_checks import _did_you_mean, _finite, _shown
from ._errors import ConfigError, InvalidInput
from ._model import CallableBackend, Item, ModelBackend, Runner, TensorSpec, TorchBackend

MLP_IN, MLP_HIDDEN, MLP_OUT = 256, 1024, 16


def _options(
    cfg: ModelConfig,
    allowed: Mapping[str, Any],
    minimum: Mapping[str, float] | None = None,
    maximum: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The backend's options: ``allowed`` (name -> default) overridden by the
    config's, each of its default's type (an integer where the default is one; a
    float option takes integers too, if a float holds them) and at least
    ``minimum[name]``, at most ``maximum[name]``, where given."""
    out = dict(allowed)
    for k, v in cfg.options.items():
        if k not in allowed:
            raise ConfigError(
                f"models.{cfg.name}.options.{k}: unknown option for backend "
                f"{cfg.backend!r};{_did_you_mean(k, list(allowed))} expected one of "
                f"{', '.join(allowed) or 'none'}"
            )
        want = allowed[k]
        if isinstance(want, bool):
            ok = isinstance(v, bool)
        elif isinstance(want, int):
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif isinstance(want, float):
            ok = _finite(v)
        else:
            ok = isinstance(v, type(want))
        if not ok:
            kind = "number" if isinstance(want, float) else type(want).__name__
            raise ConfigError(f"models.{cfg.name}.options.{k}: expected {kind}, got {_shown(v)}")
        low = (minimum or {}).get(k)
        if low is not None and v < low:
            raise ConfigError(
                f"models.{cfg.name}.options.{k}: must be >= {_bound(low)}, got {_shown(v)}"
            )
        high = (maximum or {}).get(k)
        if high is not None and v > high:
            raise ConfigError(
                f"models.{cfg.name}.options.{k}: must be <= {_bound(high)}, got {_shown(v)}"
            )
        out[k] = v
    return out


def _bound(v: float) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


#: What torch.Generator.manual_seed takes.
SEED_RANGE = (-(2**63), 2**64 - 1)
#: all-MiniLM-L6-v2's position embeddings: a longer input has no position to take.
MINILM_MAX_LENGTH = 512


def mlp_module(seed: int = 0) -> Any:
    """The deterministic seeded MLP 256→1024→1024→16 with ReLU, float32, eval mode."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    layers = [
        torch.nn.Linear(MLP_IN, MLP_HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(MLP_HIDDEN, MLP_HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(MLP_HIDDEN, MLP_OUT),
    ]
    with torch.no_grad():
        for layer in layers:
            if isinstance(layer, torch.nn.Linear):
                bound = 1.0 / layer.in_features**0.5
                layer.weight.uniform_(-bound, bound, generator=gen)
                layer.bias.uniform_(-bound, bound, generator=gen)
    return torch.nn.Sequential(*layers).eval()


def mlp_backend(seed: int = 0) -> TorchBackend:
    return TorchBackend(
        functools.partial(mlp_module, seed),
        inputs=[TensorSpec(name="x", datatype="FP32", shape=(MLP_IN,))],
        outputs=[TensorSpec(name="y", datatype="FP32", shape=(MLP_OUT,))],
    )


def _echo(items: list[Item]) -> list[Item]:
    return items


def echo_backend() -> CallableBackend:
    """Returns its inputs unchanged; any names and dtypes."""
    return CallableBackend(
        _echo,
        inputs=[TensorSpec(name="x", datatype="FP32", shape=(-1,))],
        outputs=[TensorSpec(name="x", datatype="FP32", shape=(-1,))],
        open_inputs=True,
        execution="inline",
    )


class SleepBackend(ModelBackend):
    """Sleeps per batch and per item (to make stragglers); echoes ``x``.

    The batch sleeps ``delay_per_batch_ms + delay_per_item_ms × items`` plus the largest
    ``x[0]`` (in ms) of its items, so one slow item holds back its whole batch.
    """

    inputs = (TensorSpec(name="x", datatype="FP32", shape=(-1,)),)
    outputs = (TensorSpec(name="y", datatype="FP32", shape=(-1,)),)

    def __init__(self, *, delay_per_batch_ms: float = 0.0, delay_per_item_ms: float = 0.0):
        self._per_batch = delay_per_batch_ms / 1e3
        self._per_item = delay_per_item_ms / 1e3

    def load(self, device: str, *, torch_threads: int = 1) -> Runner:
        def run(items: list[Item]) -> list[dict[str, np.ndarray]]:
            extra = max((float(it["x"][0]) for it in items if it["x"].size), default=0.0)
            delay = self._per_batch + self._per_item * len(items) + max(extra, 0.0) / 1e3
            if delay > 0:
                threading.Event().wait(delay)  # model work: blocks its worker thread only
            return [{"y": it["x"]} for it in items]

        return run


def imported(name: str) -> Any:
    """The object an import string ``'module:attr'`` names (imported, not called).
    Raises ConfigError saying why it cannot be imported."""
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as exc:  # not found, or the module failed while importing
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name is not None and (
            module == exc.name or module.startswith(exc.name + ".")
        ):
            hint = f" (put the directory that holds {exc.name!r} on PYTHONPATH, or install it)"
        raise ConfigError(
            f"cannot import {name!r}: {type(exc).__name__}: {exc}{hint}"
        ) from exc


def resolve_backend(cfg: ModelConfig) -> ModelBackend:
    """The ModelBackend a model config names. Raises ConfigError naming the key."""
    b = cfg.backend
    if isinstance(b, ModelBackend):
        return b
    if b == "mlp":
        low, high = SEED_RANGE
        return mlp_backend(
            **_options(cfg, {"seed": 0}, minimum={"seed": low}, maximum={"seed": high})
        )
    if b == "echo":
        _options(cfg, {})
        return echo_backend()
    if b == "sleep":
        delays = {"delay_per_batch_ms": 0.0, "delay_per_item_ms": 0.0}
        return SleepBackend(**_options(cfg, delays, minimum=delays))
    if b == "minilm":
        from ._minilm import MiniLMBackend

        # at least the two special tokens and one of the text
        return MiniLMBackend(
            **_options(
                cfg,
                {"max_length": 256},
                minimum={"max_length": 3},
                maximum={"max_length": MINILM_MAX_LENGTH},
            )
        )
    if callable(b):
        # a factory given from Python: called as one named in TOML is
        obj = _made(cfg, b, _name(b))
    else:
        try:
            obj = imported(str(b))
        except ConfigError as exc:
            raise ConfigError(f"models.{cfg.name}.backend: {exc}") from exc.__cause__
        if not isinstance(obj, ModelBackend) and callable(obj):
            obj = _made(cfg, obj, repr(b))
    if not isinstance(obj, ModelBackend):
        shown = repr(b) if isinstance(b, str) else f"{_name(b)}()"
        raise ConfigError(
            f"models.{cfg.name}.backend: {shown} is not a ModelBackend "
            f"(got {type(obj).__name__}; {_EXPECTED})"
        )
    return obj


def _name(factory: Any) -> str:
    return getattr(factory, "__qualname__", type(factory).__qualname__)


def _made(cfg: ModelConfig, factory: Any, shown: str) -> Any:
    """What the backend factory ``factory`` returns, called with the model's options
    as keywords; its failure is a ConfigError naming the key (``shown``: the factory
    as the message names it)."""
    try:
        return factory(**cfg.options)
    except Exception as exc:  # a factory's options or its own failure
        # A TypeError: options it does not take, or not a factory at all (the
        # model's own function named instead of a backend built around it).
        hint = f" ({_EXPECTED})" if isinstance(exc, TypeError) else ""
        raise ConfigError(
            f"models.{cfg.name}.backend: {shown} failed with its options "
            f"{dict(cfg.options)!r}: {type(exc).__name__}: {exc}{hint}"
        ) from exc


#: What a backend named by an import string must be.
_EXPECTED = (
    "name a ModelBackend, such as trioserve.CallableBackend(fn, inputs=..., outputs=...) "
    "or trioserve.TorchBackend(factory, inputs=..., outputs=...), or a function that "
    "takes the model's options as keywords and returns one"
)


def warm_imports(models: Sequence[ModelConfig]) -> None:
    """Import the libraries the built-in backends of ``models`` need (torch and
    transformers for ``minilm``: seconds), and torch for a model on a GPU.

    Meant for a worker thread before the runtime starts: an import blocks the thread
    that runs it, and on the event loop it kept a signal unheard until it ended.
    A user's own backend module is not imported here (its import may need the main
    thread); resolve_backend imports it, as before.
    """
    if any(isinstance(m.backend, str) and m.backend == "minilm" for m in models):
        from transformers import AutoTokenizer  # noqa: F401

        from ._minilm import _model_dir

        _model_dir()
    if any(d.startswith("cuda") for m in models for d in m.devices):
        import torch  # noqa: F401


__all__ = [
    "InvalidInput",
    "SleepBackend",
    "echo_backend",
    "imported",
    "mlp_backend",
    "resolve_backend",
    "warm_imports",
]
