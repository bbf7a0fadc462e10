"""Triton's statistics extension to the v2 protocol, which its tools call (``GET
/v2/models/stats``, ``GET /v2/models/{name}/stats``), in the document Triton answers
with, so that ``tritonclient``'s ``get_inference_statistics`` (and the scripts built
on it) work unchanged. (Its model configuration, ``GET /v2/models/{name}/config``, is
the runtime's: ``Runtime.triton_config``.)

Sans-IO: a served model (``Runtime.models[name]``) in, JSON bytes out.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson
import trio


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
    share the model's measurements); so does ``all_versions``' entry, once.
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


def all_versions(versions: Sequence[str]) -> str:
    """The version an entry of all of a model's ``versions`` names, as a request
    without a version asks (Triton answers it with every version's statistics):
    the one there is, or, with several, none (``""``: the figures are the model's,
    all its versions together, not kept per version; one entry a version would
    count each request as many times). Not a checkpoint."""
    return versions[0] if len(versions) == 1 else ""


def _duration(count: int, ns: int) -> dict[str, int]:
    return {"count": count, "ns": ns}


__all__ = ["all_versions", "model_statistics"]
