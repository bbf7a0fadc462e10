"""Closed-loop load against a running server, over HTTP or the WebSocket stream.

Reuses the in-process bench's ``run_load`` so both report the same figures.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import trio
from prometheus_client.parser import text_string_to_metric_families
from trioserve import ModelError, TensorSpec
from trioserve._bench import _progress, run_load

from ._client import HttpClient
from ._request import sample_inputs
from ._stream_client import ERROR_OF_STATUS, open_stream
from ._v2 import dumps


async def _batch_counters(
    url: str, model: str, api_key: str | None = None
) -> tuple[float, float] | None:
    """(batches, items) of ``model`` from the server's /metrics, if it has them."""
    client = HttpClient(url, api_key=api_key)
    try:
        res = await client.get("/metrics")
    except OSError:
        return None
    finally:
        await client.aclose()
    if res.status != 200:
        return None
    found = {}
    for family in text_string_to_metric_families(res.body.decode()):
        for s in family.samples:
            if s.labels.get("model") == model and s.name in (
                "trioserve_batches_total",
                "trioserve_batch_items_total",
            ):
                found[s.name] = s.value
    if len(found) != 2:
        return None
    return found["trioserve_batches_total"], found["trioserve_batch_items_total"]


async def _model_metadata(url: str, model: str, api_key: str | None = None) -> dict[str, Any]:
    client = HttpClient(url, api_key=api_key)
    try:
        res = await client.get(f"/v2/models/{quote(model, safe='')}")
    finally:
        await client.aclose()
    if res.status != 200:
        # one line, as the command's other refusals: the server's own message (it
        # was the body's bytes as Python writes them, with no "trioserve:")
        try:
            res.outputs()  # raises the answer's error, with its message
        except Exception as exc:
            why = str(exc)
        else:  # pragma: no cover (outputs() raises for every status but 200)
            why = f"HTTP {res.status}"
        raise SystemExit(f"trioserve: cannot bench model {model!r} at {url}: {why}")
    return res.json()


async def bench_http(
    url: str,
    *,
    model: str,
    concurrency: int,
    duration: float,
    warmup: float,
    batch_dim: int = 1,
    stream: bool = False,
    api_key: str | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Closed-loop load on ``url``: ``concurrency`` keep-alive HTTP connections, or
    (``stream``) one WebSocket with ``concurrency`` requests in flight. Each request
    carries ``batch_dim`` items (shape [N, ...]) made from the model's metadata, and
    ``api_key`` (if given) as its bearer token, as do the metadata and /metrics reads.

    The server's batch counters (from /metrics) are read around the measured
    window, after the warm-up, for the mean batch and its fill."""
    meta = await _model_metadata(url, model, api_key)
    specs = [  # the metadata's shapes carry a leading batch dimension
        TensorSpec(name=t["name"], datatype=t["datatype"], shape=tuple(t["shape"][1:]))
        for t in meta["inputs"]
    ]
    inputs = sample_inputs(model, specs, batch_dim)
    label = f"{'ws' if stream else 'http'} {model}"
    bar, update = _progress(duration, label) if progress else (None, None)

    async def load(call: Any) -> dict[str, Any]:
        if warmup > 0:
            await run_load(call, concurrency=concurrency, duration=warmup, warmup=0)
        nonlocal before
        before = await _batch_counters(url, model, api_key)
        if bar is not None:
            bar.start()
        try:
            return await run_load(
                call, concurrency=concurrency, duration=duration, warmup=0, on_progress=update
            )
        finally:
            if bar is not None:
                bar.stop()

    before = None
    if stream:
        async with open_stream(url, api_key=api_key, max_in_flight=concurrency) as client:
            infer = client.infer

            async def call_stream() -> Any:
                return await infer(model, inputs)

            res = await load(call_stream)
    else:
        body = dumps({"inputs": inputs})
        target = f"/v2/models/{quote(model, safe='')}/infer"  # a name is any segment
        pool = [HttpClient(url, api_key=api_key) for _ in range(concurrency)]
        try:
            async with trio.open_nursery() as nursery:
                for c in pool:
                    nursery.start_soon(c.connect)

            async def call_http() -> Any:
                client = pool.pop()
                try:
                    r = await client.request("POST", target, body)
                finally:
                    pool.append(client)
                if r.status != 200:  # counted by run_load under the error's class name
                    error = ERROR_OF_STATUS.get(r.status, ModelError)
                    raise error(r.body[:200].decode(errors="replace"))

            res = await load(call_http)
        finally:
            for c in pool:
                await c.aclose()
    after = await _batch_counters(url, model, api_key)
    if before and after and after[0] > before[0]:
        res["mean_batch"] = (after[1] - before[1]) / (after[0] - before[0])
        max_batch = meta.get("parameters", {}).get("max_batch_size")
        if max_batch:
            res["fill_ratio"] = res["mean_batch"] / max_batch
    res.update(
        mode="websocket" if stream else "http",
        url=url,
        model=model,
        concurrency=concurrency,
        batch_dim=batch_dim,
        items_per_s=res["requests_per_s"] * batch_dim,
        cost_us_per_request=1e6 / res["requests_per_s"] if res["requests_per_s"] else None,
    )
    return res


__all__ = ["bench_http"]
