"""The result cache checked against its contract from outside, as a client sees it:
over HTTP (v2 JSON and binary, several tenants with their keys, the stream) and
in-process (``Runtime``): isolation, byte bounds, TTL boundaries, opt-out, version
invalidation, metrics, the LRU option, errors never kept."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
import trio
import trio.testing
import trioserve
from http_helpers import v2_input
from runtime_helpers import Recorder, callable_model, item
from test_cache_runtime import Counting
from test_metrics import _samples
from trioserve import CacheConfig, TenantConfig
from trioserve.transport import Gateway, open_gateway, open_stream

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


async def test_a_ttl_ends_exactly_ttl_seconds_after_the_result_was_kept(autojump_clock):
    model = Recorder()
    async with trioserve.open_runtime(cfg(callable_model("m", model, cache_ttl_s=4.0,
                                                         max_wait_ms=0))) as rt:
        await rt.infer("m", item(1), tenant="A")
        kept = trio.current_time()
        await trio.sleep(4.0 - 1e-6)
        await rt.infer("m", item(1), tenant="A")  # still within the TTL: a hit
        assert model.seen == [1.0]
        await trio.sleep(kept + 4.0 - trio.current_time())
        await rt.infer("m", item(1), tenant="A")  # at the TTL: gone
        assert model.seen == [1.0, 1.0]
        assert rt.cache_statistics()["expirations"] == 1


async def test_the_lru_policy_is_chosen_in_the_configuration_file(tmp_path, autojump_clock):
    path = tmp_path / "trioserve.toml"
    # one echo answer of a float32 is 1024 + 4 bytes: two fit
    path.write_text(
        '[cache]\ncapacity_bytes = 2400\npolicy = "lru"\n\n'
        '[models.echo]\nbackend = "echo"\nmax_wait_ms = 0\n\n'
        '[tenants.t]\ndefault = true\n'
    )
    async with trioserve.open_runtime(trioserve.load_config(path)) as rt:
        assert rt.cache_statistics()["policy"] == "lru"

        async def ask(v: float) -> None:
            await rt.infer("echo", {"x": np.array([v], np.float32)})

        for v in (1.0, 2.0, 1.0, 3.0):  # 3.0 pushes out the least recent: 2.0
            await ask(v)
        before = rt.cache_statistics()
        await ask(1.0)
        await ask(2.0)
        after = rt.cache_statistics()
    assert (before["hits"], before["misses"], before["evictions"]) == (1, 3, 1)
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (1, 1)


async def test_tenants_do_not_share_results_over_the_stream(autojump_clock):
    """/v2/stream authenticates its tenant once; each message is cached in its
    namespace."""
    private, shared = Recorder(timed=False), Recorder(timed=False)
    config = cfg(callable_model("m", private, max_wait_ms=0),
                 callable_model("s", shared, max_wait_ms=0, cache_shared=True))
    async with trioserve.open_runtime(config) as rt, open_gateway(
        rt, host="127.0.0.1", port=0
    ) as gw:
        for key in ("key-a", "key-b", "key-a"):
            async with open_stream(gw.url, api_key=key) as stream:
                for model in ("m", "s"):
                    out = await stream.infer(model, {"x": np.array([3.0], np.float32)})
                    assert out["y"].tolist() == [7.0]
    assert private.seen == [3.0, 3.0]  # once per tenant
    assert shared.seen == [3.0]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
async def test_rows_of_a_batch_are_never_answered_across_tenants(autojump_clock, binary):
    model = Recorder()
    async with trioserve.open_runtime(cfg(callable_model("m", model, max_wait_ms=0))) as rt:
        client = Gateway(rt).app.test_client()

        async def send(rows, key):
            data, headers = body(*rows), {"authorization": f"Bearer {key}"}
            if binary:
                head = orjson.dumps({"inputs": [{
                    "name": "x", "shape": [len(rows), 1], "datatype": "FP32",
                    "parameters": {"binary_data_size": 4 * len(rows)}}]})
                data = head + np.array(rows, np.float32).tobytes()
                headers["inference-header-content-length"] = str(len(head))
            res = await client.post("/v2/models/m/infer", data=data, headers=headers)
            assert res.status_code == 200, await res.get_data()
            return orjson.loads(await res.get_data())["outputs"][0]["data"]

        assert await send([1.0, 2.0], "key-a") == [3.0, 5.0]
        assert await send([2.0, 1.0], "key-b") == [5.0, 3.0]  # B's own, computed
        assert await send([1.0, 2.0], "key-b") == [3.0, 5.0]  # B's rows: hits
        assert await send([2.0, 9.0], "key-a") == [5.0, 19.0]
    assert sorted(model.seen) == [1.0, 1.0, 2.0, 2.0, 9.0]


async def test_a_tenants_quota_and_the_capacity_hold_after_every_request(autojump_clock):
    """Edge answers and item results of one tenant stay within its quota (its own
    least recent go first), the cache within its capacity; another tenant's entries
    are not touched."""
    model = Recorder()
    config = cfg(callable_model("m", model, max_wait_ms=0), capacity_bytes=20_000,
                 policy="lru", tenant_quota_bytes=4_000)
    async with trioserve.open_runtime(config) as rt:
        client = Gateway(rt).app.test_client()
        cache = rt.cache.cache
        assert await post(client, body(0.5), key="key-b") == [2.0]
        b_bytes = cache.tenant_bytes("B")
        assert b_bytes > 0
        for i in range(40):
            assert await post(client, body(float(i))) == [2.0 * i + 1]
            assert cache.tenant_bytes("A") <= 4_000
            assert cache.policy.bytes_used <= 20_000
        assert cache.tenant_bytes("B") == b_bytes
        evictions = rt.cache_statistics()["evictions"]
        assert evictions > 0
        assert await post(client, body(0.5), key="key-b") == [2.0]  # B's: still a hit
    assert model.seen.count(0.5) == 1


async def test_an_opted_out_model_is_neither_kept_nor_coalesced():
    model = Counting(gated=True)
    config = cfg(
        callable_model("m", model, execution="thread", cache=False, max_wait_ms=0),
        callable_model("other", Recorder(timed=False)),  # keeps the cache actor up
    )
    try:
        async with trioserve.open_runtime(config) as rt:
            async with trio.open_nursery() as nursery:
                for _ in range(2):  # identical and in flight at once
                    nursery.start_soon(lambda: rt.infer("m", item(5), tenant="A"))
                await trio.testing.wait_all_tasks_blocked()
                model.release.set()
            await rt.infer("m", item(5), tenant="A")
            client = Gateway(rt).app.test_client()
            for _ in range(2):
                assert await post(client, body(5.0)) == [10.0]
            stats = rt.cache_statistics()
    finally:
        model.release.set()
    assert model.seen == [5.0] * 5
    assert (stats["hits"], stats["misses"], stats["entries"]) == (0, 0, 0)
    assert (stats["coalesced"], stats["computations"]) == (0, 0)


async def test_invalidating_one_version_leaves_the_others_cached(autojump_clock):
    model = Recorder()
    async with trioserve.open_runtime(
        cfg(callable_model("m", model, versions=["1", "2"], max_wait_ms=0))
    ) as rt:
        client = Gateway(rt).app.test_client()

        async def ask(version):
            path = "/v2/models/m" + (f"/versions/{version}" if version else "") + "/infer"
            res = await client.post(path, data=body(4.0),
                                    headers={"authorization": "Bearer key-a"})
            assert res.status_code == 200
            await rt.infer("m", item(4), tenant="A", version=version)

        for version in ("1", "2", None):  # None: the default, the last
            await ask(version)
        assert model.seen == [4.0, 4.0]
        assert rt.invalidate_cache("m", "1") == 2  # its edge answer and its item
        for version in ("1", "2", None):
            await ask(version)
        assert model.seen == [4.0, 4.0, 4.0]  # only version 1 again


async def test_the_cache_counters_on_metrics_move_as_documented(autojump_clock):
    """hits, misses, evictions, admissions rejected, coalesced, bytes and entries on
    /metrics, as rt.cache_statistics() counts them."""
    gated = Counting(gated=True)
    model = Recorder()
    config = cfg(
        callable_model("m", model, max_wait_ms=0),
        callable_model("g", gated, execution="thread", max_wait_ms=0),
        capacity_bytes=4_000, policy="lru",
    )
    try:
        async with trioserve.open_runtime(config) as rt:
            client = Gateway(rt).app.test_client()

            async def metrics():
                res = await client.get("/metrics")
                text = (await res.get_data()).decode()
                return {n: v for (n, labels), v in _samples(text).items()
                        if n.startswith("trioserve_cache_") and not labels}

            zero = await metrics()
            for v in (1.0, 1.0, 2.0, 3.0, 4.0):  # one hit; 4 answers of 1,028 bytes
                await rt.infer("m", item(v), tenant="A")
            await rt.infer("m", item(0.0, n=1000), tenant="A")  # 5,024 bytes: refused
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(lambda: rt.infer("g", item(1), tenant="A"))
                await trio.testing.wait_all_tasks_blocked()
                gated.release.set()
            after = await metrics()
            stats = rt.cache_statistics()
    finally:
        gated.release.set()
    assert all(zero[f"trioserve_cache_{n}_total"] == 0 for n in (
        "hits", "misses", "evictions", "admissions_rejected", "coalesced", "reruns",
        "late_answers"))
    assert after["trioserve_cache_hits_total"] == stats["hits"] == 1
    # every caller of a flight looked the key up first: three misses for g
    assert after["trioserve_cache_misses_total"] == stats["misses"] == 8
    # 4.0 pushed out 1.0; g's answer pushed out 2.0
    assert after["trioserve_cache_evictions_total"] == stats["evictions"] == 2
    assert after["trioserve_cache_admissions_rejected_total"] == stats["admissions_rejected"] == 1
    assert after["trioserve_cache_coalesced_total"] == stats["coalesced"] == 2
    assert after["trioserve_cache_reruns_total"] == stats["reruns"] == 0
    assert after["trioserve_cache_late_answers_total"] == stats["late_answers"] == 0
    assert after["trioserve_cache_entries"] == stats["entries"] == 3
    assert after["trioserve_cache_bytes_used"] == stats["bytes_used"] == 3 * 1028
    assert after["trioserve_cache_hit_rate"] == 1 / 9


async def test_an_edge_answer_whose_item_was_not_kept_is_dropped_when_its_ttl_passes(
    autojump_clock,
):
    """The cache actor's timer drops an answer kept at the edge when its TTL passes,
    also when the item it was made of was not kept (here a 8 KiB result over the 4 KB
    capacity, asked for as its top class): the timer was armed only by the item
    cache, so the expired answer stayed counted in bytes and entries until a lookup."""

    def wide(items):
        return [{"y": np.arange(2000, dtype=np.float32) + it["x"][0]} for it in items]

    config = cfg(callable_model("m", wide, cache_ttl_s=10.0, max_wait_ms=0),
                 capacity_bytes=4_000)
    doc = {"inputs": [v2_input([1.0])],
           "outputs": [{"name": "y", "parameters": {"classification": 1}}]}
    async with trioserve.open_runtime(config) as rt:
        client = Gateway(rt).app.test_client()
        res = await client.post("/v2/models/m/infer", data=orjson.dumps(doc),
                                headers={"authorization": "Bearer key-a"})
        assert res.status_code == 200, await res.get_data()
        kept = trio.current_time()
        stats = rt.cache_statistics()
        assert (stats["entries"], stats["admissions_rejected"]) == (1, 1)  # the edge's
        await trio.sleep(kept + 10.0 - trio.current_time())
        await trio.testing.wait_all_tasks_blocked()
        stats = rt.cache_statistics()
    assert (stats["entries"], stats["bytes_used"], stats["expirations"]) == (0, 0, 1)


@pytest.mark.parametrize("coalesce", [False, True])
async def test_with_the_cache_off_only_coalescing_is_counted_and_only_when_a_model_coalesces(
    autojump_clock, coalesce
):
    """With ``capacity_bytes = 0``, ``rt.cache_statistics()`` is ``{}`` and /metrics has
    no ``trioserve_cache_*`` series, unless a model has ``coalesce = true``: then both
    hold the coalescing counters alone (the docs said ``{}`` and "with the result cache
    on" whatever the models)."""
    gated = Counting(gated=True)
    config = cfg(
        callable_model("g", gated, execution="thread", max_wait_ms=0, coalesce=coalesce),
        capacity_bytes=0,
    )
    try:
        async with trioserve.open_runtime(config) as rt:
            client = Gateway(rt).app.test_client()
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(lambda: rt.infer("g", item(1), tenant="A"))
                await trio.testing.wait_all_tasks_blocked()
                gated.release.set()
            stats = rt.cache_statistics()
            res = await client.get("/metrics")
            series = {n for (n, _), _ in _samples((await res.get_data()).decode()).items()
                      if n.startswith("trioserve_cache_")}
    finally:
        gated.release.set()
    if not coalesce:
        assert gated.seen == [1.0, 1.0, 1.0]
        assert stats == {}
        assert series == set()
        return
    assert gated.seen == [1.0]
    assert stats == {"coalesced": 2, "computations": 1, "reruns": 0, "late_answers": 0,
                     "in_flight": 0}
    assert series == {"trioserve_cache_coalesced_total", "trioserve_cache_reruns_total",
                      "trioserve_cache_late_answers_total"}
