"""Triton's extensions to the v2 protocol that its tools call: the model configuration
(``GET /v2/models/{name}/config``) and statistics (``GET /v2/models/stats``,
``GET /v2/models/{name}/stats``), in the documents Triton answers with, so that
``tritonclient``'s ``get_model_config`` and ``get_inference_statistics`` (and the
scripts built on them) work unchanged.

Sans-IO: a served model (``Runtime.models[name]``) in, JSON bytes out.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson
import trio
from trioserve import TensorSpec

#: v2 datatype -> Triton's model-configuration data type.
TRITON_TYPES: Mapping[str, str] = {
    "BOOL": "TYPE_BOOL", "UINT8": "TYPE_UINT8", "UINT16": "TYPE_UINT16",
    "UINT32": "TYPE_UINT32", "UINT64": "TYPE_UINT64", "INT8": "TYPE_INT8",
    "INT16": "TYPE_INT16", "INT32": "TYPE_INT32", "INT64": "TYPE_INT64",
    "FP16": "TYPE_FP16", "FP32": "TYPE_FP32", "FP64": "TYPE_FP64", "BYTES": "TYPE_STRING",
}


def model_config(served: Any, platform: str, classes: Sequence[str]) -> bytes:
    """The model's configuration as Triton's ``ModelConfig`` in JSON.

    Tensor ``dims`` leave out the batch dimension (``max_batch_size`` > 0, as for
    every model here); ``dynamic_batching`` gives the batch timeout, and a priority
    level per request class (1 = ``classes[0]``, 0 = the tenant's default);
    ``instance_group`` the replicas by device; ``parameters`` (Triton's string map)
    what Triton's schema has no field for.
    """
    cfg = served.config
    backend = cfg.backend
    instance_group = []
    replicas = collections.Counter(str(b.device) for b in served.batchers)
    for i, (device, count) in enumerate(replicas.items()):
        kind, _, index = device.partition(":")
        group: dict[str, Any] = {"name": f"{cfg.name}_{i}", "count": count}
        if kind == "cuda":
            group["kind"] = "KIND_GPU"
            group["gpus"] = [int(index or 0)]
        else:
            group["kind"] = "KIND_CPU"
        instance_group.append(group)
    params = {
        "execution": cfg.execution or served.backend.default_execution,
        "oversize": cfg.oversize,
        "max_batch_tokens": cfg.max_batch_tokens,
        "timeout_ms": cfg.timeout_ms,
        "cache": cfg.cache,
    }
    doc = {
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
        "instance_group": instance_group,
        "parameters": {
            k: {"string_value": _text(v)} for k, v in params.items() if v is not None
        },
    }
    return orjson.dumps(doc)


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


def model_statistics(
    entries: Iterable[tuple[Any, str]], failures: Mapping[str, int]
) -> bytes:
    """Triton's statistics document for ``(served model, version)`` pairs.

    Counts and cumulative nanoseconds, from the model's own measurements, as
    Triton's statistics extension defines them: ``inference_stats`` count requests
    (one per HTTP or stream request, or ``infer`` / ``infer_batch`` call, whatever
    its batch dimension), ``inference_count`` items and ``execution_count`` batches.

    - ``success``: requests the model's queue answered with a result, end to end;
      cache hits are not among them (``/metrics`` counts those);
    - ``fail``: infer requests answered with a 5xx status, that is, failed inside
      the server (``failures``, by model; not timed); a client's error (4xx, 429
      included) is not the model's failure;
    - ``queue``: the requests of ``success``, each with its wait from arrival to
      the first execution that ran one of its items;
    - ``compute_infer``: the same requests, each with the whole time of the
      executions that ran its items (a batch's time for every request in it, as
      Triton counts);
    - ``execution_count``: batches run; ``inference_count``: items run;
    - ``last_inference``: when the last batch finished, in ms since the epoch (0:
      none yet).

    Each version of a model reports the model's figures, all versions together
    (versions with weights of their own run on their own queues and replicas, but
    share the model's measurements).
    """
    now_wall, now = time.time(), trio.current_time()
    out = []
    for served, version in entries:
        m = served.metrics
        ok, ok_us = m.end_to_end.totals()
        end = m.last_batch_end
        out.append({
            "name": served.config.name,
            "version": version,
            "last_inference": 0 if end is None else round((now_wall - (now - end)) * 1000),
            "inference_count": m.items,
            "execution_count": m.batches,
            "inference_stats": {
                "success": _duration(ok, ok_us * 1000),
                "fail": _duration(failures.get(served.config.name, 0), 0),
                "queue": _duration(m.requests_run, m.request_queue_us * 1000),
                "compute_input": _duration(0, 0),
                "compute_infer": _duration(m.requests_run, m.request_compute_us * 1000),
                "compute_output": _duration(0, 0),
            },
            "batch_stats": [],
            "memory_usage": [],
        })
    return orjson.dumps({"model_stats": out})


def _duration(count: int, ns: int) -> dict[str, int]:
    return {"count": count, "ns": ns}


__all__ = ["TRITON_TYPES", "model_config", "model_statistics"]
