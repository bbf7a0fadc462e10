"""Triton's model configuration of a served model (``GET /v2/models/NAME/config``,
``tritonclient``'s ``get_model_config``), and a load's config given in that shape
(Triton's ``load_model(name, config=...)``) read back into keys of the model's table
(docs/model-control.md), so that a configuration fetched, edited and sent back loads
what was edited and nothing else.

What the document says of the model is either a key of one copy (max_batch_size,
the batch timeout, the instance groups, the ``parameters`` map), read back into the
table's key, or what the model is here (its name, platform, backend, versions,
tensors and the rest of its batching), which a load's config may repeat but not
change.

Sans-IO: a served model (``Runtime.models[name]``) and a mapping in, a mapping out,
or ConfigError naming the key.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ._config import MAX_REPLICAS, ModelConfig
from ._config_checks import _shown
from ._errors import ConfigError
from ._load_config import PER_COPY, REFUSED
from ._model import TensorSpec

#: v2 datatype -> Triton's model-configuration data type.
TRITON_TYPES: Mapping[str, str] = {
    "BOOL": "TYPE_BOOL", "UINT8": "TYPE_UINT8", "UINT16": "TYPE_UINT16",
    "UINT32": "TYPE_UINT32", "UINT64": "TYPE_UINT64", "INT8": "TYPE_INT8",
    "INT16": "TYPE_INT16", "INT32": "TYPE_INT32", "INT64": "TYPE_INT64",
    "FP16": "TYPE_FP16", "FP32": "TYPE_FP32", "FP64": "TYPE_FP64", "BYTES": "TYPE_STRING",
}

#: The keys of the model's table the document gives in ``parameters`` (Triton's
#: string map: its schema has no field for them), and the type each is read back as.
PARAMETERS: Mapping[str, type] = {
    "execution": str, "oversize": str, "max_batch_tokens": int, "timeout_ms": float,
    "cache": bool,
}

#: The keys of Triton's ModelConfig that the table has no key of the same name for:
#: a load's config with any of them is in Triton's shape.
TRITON_KEYS = frozenset({
    "platform", "runtime", "version_policy", "input", "output", "batch_input",
    "batch_output", "optimization", "dynamic_batching", "sequence_batching",
    "ensemble_scheduling", "instance_group", "default_model_filename",
    "cc_model_filenames", "metric_tags", "parameters", "model_warmup", "model_operations",
    "model_transaction_policy", "model_repository_agents", "response_cache",
})

#: The table's key each of Triton's keys is read back into (for the hint of an
#: error that names a table's key in a config of Triton's shape).
_TRITON_OF = {
    "devices": "instance_group", "replicas": "instance_group",
    "max_wait_ms": "dynamic_batching.max_queue_delay_microseconds",
    **{key: f"parameters.{key}" for key in PARAMETERS},
}

#: Why a key that says what the model is cannot be changed by a load.
_FIXED = {
    "platform": "the platform is the backend's (pytorch for a torch module, python else)",
    "backend": REFUSED["backend"],
    "version_policy": REFUSED["versions"],
    "input": "the model's inputs are its backend's (its options may change them)",
    "output": "the model's outputs are its backend's (its options may change them)",
    "dynamic_batching.preferred_batch_size": (
        "batches close at max_batch_size, max_batch_tokens or the queue delay: there "
        "are no preferred sizes"
    ),
    "dynamic_batching.preserve_ordering": (
        "each answer goes to its own caller, whatever the order batches end in"
    ),
    "dynamic_batching.priority_levels": (
        "the priority levels are the server's request classes ([[classes]]), one each"
    ),
    "dynamic_batching.default_priority_level": (
        "level 0 is a request's tenant's default class"
    ),
}


def triton_platform(backend: Any) -> str:
    """The platform Triton's documents name for a model's backend."""
    return "pytorch" if type(backend).__name__ == "TorchBackend" else "python"


def triton_config(served: Any, platform: str, classes: Sequence[str]) -> dict[str, Any]:
    """The model's configuration as Triton's ``ModelConfig`` (a JSON document).

    Tensor ``dims`` leave out the batch dimension (``max_batch_size`` > 0, as for
    every model here); ``dynamic_batching`` gives the batch timeout, and a priority
    level per request class (1 = ``classes[0]``, 0 = the tenant's default);
    ``instance_group`` the replicas by device; ``parameters`` (Triton's string map)
    the keys of :data:`PARAMETERS`, those that are set.
    """
    cfg = served.config
    backend = cfg.backend
    params = {key: getattr(cfg, key) for key in PARAMETERS}
    params["execution"] = cfg.execution or served.backend.default_execution
    return {
        "name": cfg.name,
        "platform": platform,
        "backend": backend if isinstance(backend, str) else type(backend).__name__,
        "version_policy": {"specific": {"versions": list(cfg.versions)}},
        "max_batch_size": cfg.max_batch_size,
        "input": [_tensor(s, output=False) for s in served.backend.inputs],
        "output": [_tensor(s, output=True) for s in served.backend.outputs],
        "dynamic_batching": {
            "preferred_batch_size": [],
            "max_queue_delay_microseconds": round(cfg.max_wait_ms * 1000),
            "preserve_ordering": False,
            "priority_levels": len(classes),
            "default_priority_level": 0,
        },
        "instance_group": _groups(cfg.name, [str(b.device) for b in served.batchers]),
        "parameters": {
            k: {"string_value": _text(v)} for k, v in params.items() if v is not None
        },
    }


def _groups(model: str, devices: Sequence[str]) -> list[dict[str, Any]]:
    """Triton's instance groups of replicas on ``devices`` (one device each): a
    group per device, in the order they first come, named ``MODEL_i``."""
    groups = []
    for i, (device, count) in enumerate(collections.Counter(devices).items()):
        kind, _, index = device.partition(":")
        group: dict[str, Any] = {"name": f"{model}_{i}", "count": count}
        if kind == "cuda":
            group["kind"] = "KIND_GPU"
            group["gpus"] = [int(index or 0)]
        else:
            group["kind"] = "KIND_CPU"
        groups.append(group)
    return groups


def _tensor(spec: TensorSpec, *, output: bool) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": spec.name,
        "data_type": TRITON_TYPES[spec.datatype],
        "dims": list(spec.shape),
    }
    if not output:
        doc["format"] = "FORMAT_NONE"
        doc["optional"] = False
    return doc


def _text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


# ------------------------------------------------------------------ read back


def triton_shaped(given: Any) -> bool:
    """Whether a load's config is Triton's model configuration (any of its keys
    that the table has no key of the same name for)."""
    return isinstance(given, Mapping) and any(key in TRITON_KEYS for key in given)


def from_triton(
    given: Mapping[str, Any], served: Any, table: ModelConfig, classes: Sequence[str]
) -> dict[str, Any]:
    """A load's config of Triton's shape as keys of the model's table, for
    ``with_load_config(table, ...)``: what ``given`` says of one copy, read back.
    ``served`` is the model as it serves now (what its document describes: the
    version its unversioned requests go to, ``Runtime._probed``): a value
    equal to what its document gives reads back as the serving copy's own value
    (the batch timeout is in whole microseconds there; its instance groups count
    the replicas an autoscaler scaled to), so an unchanged document loads what
    serves (the table's, unless a load gave another). Not a checkpoint.

    Raises ConfigError naming the key (as ``models.NAME.<Triton's key>``): a key
    that says what the model is, changed; a key the document does not give; a
    value of the wrong shape or a parameter's string that does not parse.
    """
    path = table._path()
    now = triton_config(served, triton_platform(served.backend), classes)
    cur = served.config
    out: dict[str, Any] = {}
    for key, value in given.items():
        where = f"{path}.{key}"
        if key == "name":
            out["name"] = value  # with_load_config: the model's own, or refused
        elif key == "max_batch_size":
            out["max_batch_size"] = value
        elif key == "dynamic_batching":
            out.update(_batching(value, now[key], cur, where))
        elif key == "instance_group":
            live = list(dict.fromkeys(str(b.device) for b in served.batchers))
            out.update(_instances(value, now[key], live, cur, table, where))
        elif key == "parameters":
            out.update(_parameters(value, now[key], cur, where))
        elif key in now:
            _fixed(value, now[key], where, key)
        else:
            raise ConfigError(f"{where}: {_not_given(key, now)}")
    return out


def _not_given(key: str, now: Mapping[str, Any]) -> str:
    text = (
        "not a key of the model's configuration in Triton's shape (a load's config "
        "is either Triton's, with the keys GET /v2/models/NAME/config gives: "
        f"{', '.join(now)}; or keys of the model's [models.NAME] table, not both)"
    )
    if key in _TRITON_OF:
        text += f"; Triton's shape gives it as {_TRITON_OF[key]}"
    return text


def _fixed(value: Any, rendered: Any, where: str, key: str) -> None:
    """``value`` must be what the document gives now: it is what the model is."""
    value = _plain(value)
    if not _same(value, rendered):
        at, theirs, ours = _difference(value, rendered, where)
        detail = "" if at == where else f"{at}: "

        def shown(v: Any) -> str:
            return "none" if v is ... else _shown(v)

        raise ConfigError(
            f"{where}: {_FIXED[key]}: a load cannot change it ({detail}the model's: "
            f"{shown(ours)}, got {shown(theirs)})"
        )


def _difference(a: Any, b: Any, where: str) -> tuple[str, Any, Any]:
    """Where ``a`` and ``b`` (not the same) first differ, and what each has there
    (``...``: nothing)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in [*b, *(k for k in a if k not in b)]:
            if k not in a or k not in b or not _same(a[k], b[k]):
                return _difference(a.get(k, ...), b.get(k, ...), f"{where}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if not _same(x, y):
                return _difference(x, y, f"{where}[{i}]")
    return where, a, b


def _batching(
    value: Any, rendered: Mapping[str, Any], cur: ModelConfig, where: str
) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: must be an object (Triton's dynamic batching), got "
                          f"{_shown(value)}")
    out: dict[str, Any] = {}
    for key, v in value.items():
        at = f"{where}.{key}"
        if key == "max_queue_delay_microseconds":
            if _same(v, rendered[key]):
                out["max_wait_ms"] = cur.max_wait_ms  # exact, not rounded to a µs
            else:
                out["max_wait_ms"] = _microseconds(v, at) / 1000
        elif key in rendered:
            _fixed(v, rendered[key], at, f"dynamic_batching.{key}")
        else:
            raise ConfigError(
                f"{at}: not one the model's dynamic batching has (it gives "
                f"{', '.join(rendered)})"
            )
    return out


def _microseconds(v: Any, where: str) -> int:
    # Triton's uint64: a number, or (protobuf's JSON) a string of digits
    if isinstance(v, str) and v.isascii() and v.isdigit():
        return int(v)
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    raise ConfigError(f"{where}: must be a whole number of microseconds >= 0, got "
                      f"{_shown(v)}")


def _instances(
    value: Any, rendered: list[dict[str, Any]], live: list[str], cur: ModelConfig,
    table: ModelConfig, where: str,
) -> dict[str, Any]:
    """``instance_group`` as ``devices`` and ``replicas``: each group's replicas on
    its device (KIND_CPU: cpu; KIND_GPU: cuda:N, ``count`` on each of its ``gpus``,
    as Triton's). ``rendered``: the groups the document gives now, one per device
    of ``live`` (the serving replicas' devices, in the same order)."""
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{where}: must be a list of instance groups, got {_shown(value)}")
    if not value:  # Triton's default: the table's
        return {}
    if _same(_plain(value), rendered):  # as it serves (an autoscaler's count too)
        return {"devices": cur.devices, "replicas": cur.replicas}
    # a group named as one the document gives, of the same kind and GPUs, is on
    # its device ("cpu:1", "cuda" as well as "cpu", "cuda:N")
    named = {
        g["name"]: (g["kind"], g.get("gpus"), device)
        for g, device in zip(rendered, live, strict=True)
    }
    wanted: list[tuple[str, int]] = []  # (device, count)
    names: set[str] = set()
    for i, group in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(group, Mapping):
            raise ConfigError(f"{at}: must be an object (an instance group), got "
                              f"{_shown(group)}")
        extra = [k for k in group if k not in ("name", "kind", "count", "gpus")]
        if extra:
            raise ConfigError(f"{at}.{extra[0]}: not one the model's instance groups have "
                              "(they give name, kind, count and gpus)")
        name = group.get("name")
        own = f"{table.name}_{i}"
        if name is not None and (name in names or (name != own and name not in named)):
            raise ConfigError(
                f"{at}.name: a group's name is the model's, not a load's to give: one "
                f"its groups have now ({', '.join(map(repr, named)) or 'none'}) or, for "
                f"a group added, {own!r} (by its place), each once; or leave it out, got "
                f"{_shown(name)}"
            )
        names.add(name)
        count = group.get("count", 1)  # Triton's default
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ConfigError(f"{at}.count: must be an integer >= 1, got {_shown(count)}")
        gpus = group.get("gpus")
        kind = group.get("kind", "KIND_GPU" if gpus is not None else None)
        if kind == "KIND_CPU":
            if gpus is not None:
                raise ConfigError(f"{at}.gpus: a KIND_CPU group has no gpus, got "
                                  f"{_shown(gpus)}")
            devices = ["cpu"]
        elif kind == "KIND_GPU":
            ok = (
                isinstance(gpus, list | tuple) and gpus
                and all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus)
            )
            if not ok:
                raise ConfigError(
                    f"{at}.gpus: a KIND_GPU group names its GPUs, a list of indices >= 0 "
                    f"(cuda:N), got {_shown(gpus)}"
                )
            devices = [f"cuda:{g}" for g in dict.fromkeys(gpus)]
        else:
            raise ConfigError(
                f"{at}.kind: must be KIND_CPU or KIND_GPU (with gpus), got {_shown(kind)}"
            )
        if name in named and named[name][:2] == (kind, _plain(gpus)):
            devices = [named[name][2]]
        wanted.extend((d, count) for d in devices)
    counts: collections.Counter[str] = collections.Counter()
    for device, n in wanted:
        counts[device] += n
    total = sum(counts.values())
    if total > MAX_REPLICAS:
        raise ConfigError(f"{where}: at most {MAX_REPLICAS} instances in all (the model's "
                          f"replicas), got {_shown(total)}")
    for m in (table, cur):  # the same replicas: as the table (or the copy) says them
        if collections.Counter(m.replica_devices) == counts:
            return {"devices": m.devices, "replicas": m.replicas}
    order = list(counts)
    spread = collections.Counter(order[i % len(order)] for i in range(total))
    if spread == counts:  # round-robin over the devices puts them so
        return {"devices": tuple(order), "replicas": total}
    return {"devices": tuple(d for d in order for _ in range(counts[d])), "replicas": total}



def _parameters(
    value: Any, rendered: Mapping[str, Any], cur: ModelConfig, where: str
) -> dict[str, Any]:
    """Triton's string map: each key of :data:`PARAMETERS` read back from its
    ``string_value``; one equal to what the document gives is the copy's own."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: must be an object (Triton's parameters), got "
                          f"{_shown(value)}")
    out: dict[str, Any] = {}
    for key, entry in value.items():
        at = f"{where}.{key}"
        if key not in PARAMETERS:
            raise ConfigError(
                f"{at}: not one the model's parameters have (they give "
                f"{', '.join(PARAMETERS)})"
            )
        text = entry.get("string_value") if isinstance(entry, Mapping) else None
        if not isinstance(text, str) or set(entry) != {"string_value"}:
            raise ConfigError(
                f'{at}: must be {{"string_value": "..."}} (Triton\'s parameter), got '
                f"{_shown(entry)}"
            )
        if key in rendered and _same(_plain(entry), rendered[key]):
            if key in PER_COPY:  # (a key a load may not change: as the table's)
                out[key] = getattr(cur, key)
            continue
        out[key] = _parse(text, PARAMETERS[key], f"{at}.string_value")
    return out


_INTEGER = re.compile(r"[+-]?[0-9]+")
_NUMBER = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _parse(text: str, kind: type, where: str) -> Any:
    """A parameter's string as the table's key's type: ConfigError if it is not."""
    if kind is bool:
        if text in ("true", "false"):
            return text == "true"
        expected = '"true" or "false"'
    elif kind is int:
        if _INTEGER.fullmatch(text):
            return int(text)
        expected = "an integer"
    elif kind is float:
        if _NUMBER.fullmatch(text) and math.isfinite(float(text)):
            return float(text)
        expected = "a number"
    else:
        return text
    raise ConfigError(f"{where}: must be {expected} (as a string), got {_shown(text)}")


def _plain(v: Any) -> Any:
    """``v`` as JSON has it: mappings as dicts, sequences (but strings) as lists."""
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    return v


def _same(a: Any, b: Any) -> bool:
    """JSON equality: true and 1 differ, 1 and 1.0 do not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict | list) or isinstance(b, dict | list):
        return False
    return a == b
