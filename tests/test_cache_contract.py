"""The result cache checked against its contract from outside, as a client sees it:
over HTTP (v2 JSON and binary, several tenants with their keys, the stream) and
in-process (``Runtime``): isolation, byte bounds, TTL boundaries, opt-out, version
invalidation, metrics, the LRU option, errors never kept."""

from __future__ import annotations

import orjson
import pytest
import trio
import trio.testing
import trioserve
from http_helpers import v2_input
from runtime_helpers import Recorder, callable_model
from trioserve import CacheConfig, TenantConfig
from trioserve.transport import Gateway

TENANTS = (
    TenantConfig(name="A", api_keys=("key-a",)),
    TenantConfig(name="B", api_keys=("key-b",)),
)


def cfg(*models: trioserve.ModelConfig, **cache) -> trioserve.Config:
    cache.setdefault("capacity_bytes", 1 << 20)
    return trioserve.Config(models=models, tenants=TENANTS, cache=CacheConfig(**cache))


def body(*rows: float, request_id: str | None = None) -> bytes:
    shape = [1] if len(rows) == 1 else [len(rows), 1]
    doc: dict = {"inputs": [v2_input(list(rows))]}
    doc["inputs"][0]["shape"] = shape
    if request_id is not None:
        doc["id"] = request_id
    return orjson.dumps(doc)


async def post(client, data: bytes, key: str = "key-a", model: str = "m") -> list:
    res = await client.post(
        f"/v2/models/{model}/infer", data=data, headers={"authorization": f"Bearer {key}"}
    )
    assert res.status_code == 200, await res.get_data()
    return orjson.loads(await res.get_data())["outputs"][0]["data"]


@pytest.mark.parametrize("batch", [False, True])
async def test_an_edge_answer_built_from_a_cached_item_expires_with_the_item(
    autojump_clock, batch
):
    """Another body for an item already cached is answered from the item cache and its
    encoded answer is kept at the edge: for no longer than the item's TTL has left, or
    a result computed at 0 with a TTL of 10 s was still served at 15 s."""
    model = Recorder()
    async with trioserve.open_runtime(cfg(callable_model("m", model, cache_ttl_s=10.0,
                                                         max_wait_ms=0))) as rt:
        client = Gateway(rt).app.test_client()
        start = trio.current_time()
        assert await post(client, body(2.0, request_id="r1")) == [5.0]
        await trio.sleep(9.0)
        later = body(2.0, 3.0) if batch else body(2.0, request_id="r2")
        want = [5.0, 7.0] if batch else [5.0]
        assert await post(client, later) == want  # 2.0: an item hit
        assert model.seen == [2.0, 3.0] if batch else [2.0]
        await trio.sleep(start + 10.0 - trio.current_time() - 1e-6)
        await trio.testing.wait_all_tasks_blocked()
        assert rt.cache_statistics()["expirations"] == 0
        await trio.sleep(1e-6)  # the item's TTL has passed: its answers go with it
        await trio.testing.wait_all_tasks_blocked()
        stats = rt.cache_statistics()
        assert stats["expirations"] == 3  # the item, the two answers at the edge
        assert await post(client, later) == want
        assert model.seen == ([2.0, 3.0, 2.0] if batch else [2.0, 2.0])  # computed again
