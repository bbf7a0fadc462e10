import re
from pathlib import Path

import numpy as np
import orjson
import trio
import trio.testing
import trioserve
from hdrh.histogram import HdrHistogram
from http_helpers import v2_input
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from runtime_helpers import Recorder, callable_model, item
from trioserve import CacheConfig, TenantConfig
from trioserve.actors import Latency, values_at
from trioserve.transport import Gateway


@given(values=st.lists(st.integers(min_value=0, max_value=10**13), max_size=300))
def test_bulk_fold_equals_per_value_recording(values):
    lat = Latency()
    ref = HdrHistogram(1, 3_600_000_000, 2)
    overflow = 0
    for us in values:
        lat.record(us / 1e6)
        overflow += not ref.record_value(max(int(us / 1e6 * 1e6), 1))
    lat.fold()
    assert np.array_equal(np.ctypeslib.as_array(lat.hist.counts), np.ctypeslib.as_array(ref.counts))
    assert lat.hist.total_count == ref.total_count
    assert lat.overflow == overflow
    if ref.total_count:
        assert lat.hist.min_value == ref.min_value
        assert lat.hist.max_value == ref.max_value
    # the exact count and sum, overflow included (values below 1 µs count as 1)
    assert lat.totals() == (len(values), sum(max(int(us / 1e6 * 1e6), 1) for us in values))
    if lat.hist.total_count:  # the summary's mean is the exact one, overflow included
        count, total = lat.totals()
        assert lat.summary().mean_ms == total / count / 1e3


@given(us=st.integers(min_value=1, max_value=3_600_000_000))
def test_quantiles_are_at_most_one_percent_above_the_value(us):
    # docs/gateway.md (/metrics): latencies are whole µs in a histogram of two
    # significant digits, and a quantile is its bucket's highest value, so it never
    # reads below the latency measured and at most 1% above it (2^-7, precisely).
    lat = Latency()
    lat.record(us / 1e6)
    _, recorded = lat.totals()
    for value in lat.hist.get_percentile_to_value_dict([50, 90, 99, 99.9]).values():
        assert recorded <= value <= recorded * (1 + 2**-7)
    assert recorded <= round(lat.percentile_s(99) * 1e6) <= recorded * (1 + 2**-7)


def test_summary_reads_buffered_values():
    lat = Latency()
    for ms in (1, 2, 3, 4, 100):
        lat.record(ms / 1e3)
    s = lat.summary()
    assert s.count == 5
    assert 2.9 <= s.p50_ms <= 3.1
    assert 99 <= s.max_ms <= 101
    assert s.mean_ms == 22.0  # exact, from the exact sum (hdrh's own walked every bucket)
    lat.record(0.5)  # still buffered: totals() folds it
    assert lat.totals() == (6, 1_000 + 2_000 + 3_000 + 4_000 + 100_000 + 500_000)
    lat.reset()
    assert lat.summary().count == 0
    assert lat.totals() == (0, 0)


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


async def test_cache_expirations_and_invalidations_are_counted_on_metrics_by_model(
    autojump_clock,
):
    """The result cache's TTL expirations and invalidations are on ``/metrics`` as
    ``trioserve_cache_{expirations,invalidations}_total{model}``: they were only in
    ``rt.cache_statistics()``. Each request keeps two entries of its model: the
    edge's encoded answer and the item's result."""
    ttl, plain = Recorder(), Recorder()
    cfg = trioserve.Config(
        models=(
            callable_model("ttl", ttl, cache_ttl_s=10.0),
            callable_model("plain", plain),
        ),
        tenants=(TenantConfig(name="t", default=True),),
        cache=CacheConfig(capacity_bytes=1 << 20),
    )
    async with trioserve.open_runtime(cfg) as rt:
        gw = Gateway(rt)
        client = gw.app.test_client()

        async def post(model: str) -> None:
            data = orjson.dumps({"inputs": [v2_input([1.0])]})
            res = await client.post(f"/v2/models/{model}/infer", data=data)
            assert res.status_code == 200

        await post("ttl")
        await post("plain")
        before = _samples((await (await client.get("/metrics")).get_data()).decode())
        await trio.sleep(10.5)  # past the TTL: the cache actor drops both entries
        await trio.testing.wait_all_tasks_blocked()
        await post("ttl")  # computed again
        assert rt.invalidate_cache("plain") == 2
        after = _samples((await (await client.get("/metrics")).get_data()).decode())
        stats = rt.cache_statistics()
    assert len(ttl.batches) == 2
    assert len(plain.batches) == 1
    for name in ("expirations", "invalidations"):
        for model in ("ttl", "plain"):
            assert before[f"trioserve_cache_{name}_total", (("model", model),)] == 0
    assert after["trioserve_cache_expirations_total", (("model", "ttl"),)] == 2
    assert after["trioserve_cache_expirations_total", (("model", "plain"),)] == 0
    assert after["trioserve_cache_invalidations_total", (("model", "plain"),)] == 2
    assert after["trioserve_cache_invalidations_total", (("model", "ttl"),)] == 0
    assert (stats["expirations"], stats["invalidations"]) == (2, 2)
    # the unlabelled series are unchanged
    assert after["trioserve_cache_misses_total", ()] == stats["misses"]


DOCS = Path(__file__).resolve().parent.parent / "docs"


def _documented_series() -> set[str]:
    """Every series the docs (and README) name, ``{a,b}`` alternatives expanded; a
    name ending in ``_`` or ``*`` is a prefix, not a series."""
    text = "\n".join(p.read_text() for p in [*DOCS.glob("*.md"), DOCS.parent / "README.md"])
    names = set()
    for found in re.findall(r"trioserve_[a-z_]*(?:(?<=_)\{[a-z_,]+\}[a-z_]*)?", text):
        head, brace, rest = found.partition("{")
        alternatives, _, tail = rest.partition("}")
        names |= {head + a + tail for a in alternatives.split(",")} if brace else {found}
    return {n for n in names if not n.endswith("_")}


def _metrics_table() -> dict[str, tuple[set[str], str]]:
    """docs/gateway.md's /metrics table: series -> (its labels, what it says)."""
    text = (DOCS / "gateway.md").read_text().split("## `/metrics`", 1)[1]
    rows = {}
    for line in text.splitlines():
        if not line.startswith("| `trioserve_"):
            continue
        series, labels, what = (c.strip() for c in line.strip().strip("|").split("|"))
        for name in re.findall(r"`(trioserve_\w+)`", series):
            rows[name] = ({lab for lab in labels.split(", ") if lab}, what)
    return rows


async def test_every_metrics_series_is_documented_with_its_labels(autojump_clock, tmp_path):
    """What ``/metrics`` exposes, with the cache on, three models (one with a slow
    lane, one with a rollout, a shadow and a state file) and a tenant with credits,
    is what the docs name, and no more: each series in docs/gateway.md's table
    (summaries said to be summaries, counters ending in ``_total``) with its labels,
    and the outcomes it lists."""
    cfg = trioserve.Config(
        models=(
            callable_model("a", Recorder(), slo_ms=50.0),
            callable_model("b", Recorder(), replicas=2, slow_lane_cost=4),
            callable_model("c", Recorder(), versions=["1", "2", "3"],
                           rollout={"stable": "1", "canary": "2", "shadow": "3"}),
        ),
        tenants=(TenantConfig(name="t", default=True, credit_rate=1000.0),),
        cache=CacheConfig(capacity_bytes=1 << 20),
        runtime=trioserve.RuntimeLimits(rollout_state_file=str(tmp_path / "rollout.json")),
    )
    async with trioserve.open_runtime(cfg) as rt:
        client = Gateway(rt).app.test_client()
        data = orjson.dumps({"inputs": [v2_input([1.0])]})
        assert (await client.post("/v2/models/a/infer", data=data)).status_code == 200
        text = (await (await client.get("/metrics")).get_data()).decode()
    scraped: dict[str, tuple[str, set[str]]] = {}
    values: dict[tuple[str, str], set[str]] = {}
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {lab for s in family.samples for lab in s.labels}
        scraped[name] = (family.type, labels)
        for s in family.samples:
            for lab, v in s.labels.items():
                values.setdefault((name, lab), set()).add(v)
    assert set(scraped) == _documented_series()
    table = _metrics_table()
    for name, (kind, labels) in scraped.items():
        if name.startswith("trioserve_cache_"):
            continue  # one row, `trioserve_cache_*`, for docs/cache.md's list
        documented, what = table[name]
        assert labels == documented, name
        assert (kind == "summary") == what.startswith("summary"), name
    for name, label in (
        ("trioserve_batcher_outcomes_total", "outcome"),
        ("trioserve_flow_requests_total", "outcome"),
        ("trioserve_latency_seconds", "stage"),
    ):
        listed = set(re.findall(r"`(\w+)`", table[name][1])) - {name}
        assert values[name, label] <= listed, name
        assert listed <= values[name, label], name


async def test_requests_pushed_out_are_exposed_apart_from_those_refused(autojump_clock):
    """A flow's ``shed`` counted both the requests refused at admission and those
    admitted, then pushed out of a full queue, so its counts could not show how many
    of its admitted requests were pushed out, nor add up. ``pushed_out`` counts
    those (still in ``shed`` too): in ``rt.statistics()`` and on /metrics."""
    cfg = trioserve.Config(
        models=(
            callable_model(
                "m", Recorder(), max_batch_size=8, max_wait_ms=1000, adaptive_limit=False
            ),
        ),
        tenants=(TenantConfig(name="a", default=True), TenantConfig(name="b")),
        runtime=trioserve.RuntimeLimits(queue_bound=2),
    )
    refused: list[trioserve.Overloaded] = []

    async def call(tenant: str, v: float) -> None:
        try:
            await rt.infer("m", item(v), tenant=tenant)
        except trioserve.Overloaded as exc:
            refused.append(exc)

    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        for v in (1.0, 2.0):
            nursery.start_soon(call, "a", v)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(call, "b", 3.0)  # under its share: pushes out a's newest
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(call, "a", 4.0)  # a at its share of a full queue: refused
        await trio.testing.wait_all_tasks_blocked()
        assert ["pushed out" in str(e) for e in refused] == [True, False]
        flows = rt.statistics()["m"]["flows"]
        text = (
            await (await Gateway(rt).app.test_client().get("/metrics")).get_data()
        ).decode()
    a, b = flows["a/realtime"], flows["b/realtime"]
    assert (a["admitted"], a["shed"], a["pushed_out"], a["queued"]) == (2, 2, 1, 1)
    assert (b["admitted"], b["shed"], b["pushed_out"], b["queued"]) == (1, 0, 0, 1)
    for f in (a, b):  # each admitted request queued or counted once more
        assert f["admitted"] == (
            f["dispatched"] + f["expired"] + f["withdrawn"] + f["closed"]
            + f["pushed_out"] + f["queued"]
        )
    for tenant, outcome, n in (
        ("a", "admitted", 2), ("a", "shed", 2), ("a", "pushed_out", 1),
        ("b", "admitted", 1), ("b", "shed", 0), ("b", "pushed_out", 0),
    ):
        line = (
            'trioserve_flow_requests_total{class="realtime",model="m",'
            f'outcome="{outcome}",tenant="{tenant}"}} {n}.0'
        )
        assert line in text, line


async def test_what_each_series_counts_for_a_request_with_a_batch_dimension(autojump_clock):
    """docs/gateway.md's /metrics section says what one v2 request of shape [N, ...]
    counts in each series: one answer in trioserve_requests_total and one
    end_to_end latency, but N items everywhere the scheduler sees them (queue wait,
    flow outcomes, cost, credits, batch items), as ``rt.statistics()`` has them."""
    cfg = trioserve.Config(
        models=(callable_model("m", Recorder(), max_batch_size=2, max_wait_ms=0.0),),
        tenants=(TenantConfig(name="t", default=True),),
    )
    async with trioserve.open_runtime(cfg) as rt:
        client = Gateway(rt).app.test_client()
        data = orjson.dumps({"inputs": [v2_input(np.ones((3, 1), np.float32))]})
        assert (await client.post("/v2/models/m/infer", data=data)).status_code == 200
        text = (await (await client.get("/metrics")).get_data()).decode()
        stats = rt.statistics()["m"]
        credits = rt.tenant_statistics()["t"]["credits_used"]
    got = _samples(text)
    flow = (("class", "realtime"), ("model", "m"), ("tenant", "t"))

    def outcome(name: str) -> float:
        return got["trioserve_flow_requests_total", (*flow[:2], ("outcome", name), flow[2])]

    answered = (("model", "m"), ("status", "200"), ("tenant", "t"))
    assert got["trioserve_requests_total", answered] == 1
    assert got["trioserve_latency_seconds_count", (("model", "m"), ("stage", "end_to_end"))] == 1
    assert stats["end_to_end"].count == 1
    assert got["trioserve_latency_seconds_count", (("model", "m"), ("stage", "queue_wait"))] == 3
    assert stats["queue_wait"].count == 3
    assert outcome("admitted") == outcome("dispatched") == 3
    assert stats["flows"]["t/realtime"]["admitted"] == 3
    assert got["trioserve_flow_served_cost_total", flow] == 3
    assert got["trioserve_flow_wait_seconds_count", flow] == 3
    assert got["trioserve_credits_used_total", (("tenant", "t"),)] == credits == 3
    assert got["trioserve_batch_items_total", (("model", "m"),)] == stats["items"] == 3
    assert got["trioserve_batches_total", (("model", "m"),)] == stats["batches"] == 2
    assert got["trioserve_latency_seconds_count", (("model", "m"), ("stage", "batch_exec"))] == 2


@given(
    lanes=st.lists(
        st.lists(st.integers(min_value=0, max_value=10**10), max_size=60),
        min_size=1, max_size=3,
    ),
)
def test_values_at_percentiles_are_hdrhs_of_the_histograms_together(lanes):
    # /metrics reads a summary's quantiles with values_at (numpy over the counts),
    # a flow's over its lanes' histograms together: the values hdrh's own walk gives
    # for one histogram holding every value, None for none.
    lats = []
    for values in lanes:
        lat = Latency()
        for us in values:
            lat.record(us / 1e6)
        lat.fold()
        lats.append(lat)
    together = HdrHistogram(1, 3_600_000_000, 2)
    for lat in lats:
        together.add(lat.hist)
    for percentiles in ((50, 90, 99, 99.9), (50, 99)):
        got = values_at([lat.hist for lat in lats], percentiles)
        if not together.get_total_count():
            assert got is None
            continue
        expected = together.get_percentile_to_value_dict(list(percentiles))
        assert got == [expected[p] for p in percentiles]


async def test_a_scrape_does_not_walk_the_histograms_bucket_by_bucket(
    autojump_clock, monkeypatch
):
    """A scrape runs on the event loop: hdrh's percentile walk (Python, a loop over
    ~3,300 buckets: 0.25 to 0.5 ms a histogram, the most for an empty one) made
    half of a scrape's collection; the quantiles are the same read with numpy."""
    cfg = trioserve.Config(
        models=(callable_model("a", Recorder()), callable_model("idle", Recorder())),
        tenants=(TenantConfig(name="t", default=True), TenantConfig(name="u")),
    )
    async with trioserve.open_runtime(cfg) as rt:
        client = Gateway(rt).app.test_client()
        for x in range(5):
            data = orjson.dumps({"inputs": [v2_input([float(x)])]})
            assert (await client.post("/v2/models/a/infer", data=data)).status_code == 200
        await trio.testing.wait_all_tasks_blocked()
        walk = HdrHistogram.get_percentile_to_value_dict
        metrics = rt.models["a"].metrics
        metrics.end_to_end.fold()
        expected = walk(metrics.end_to_end.hist, [50, 90, 99, 99.9])

        def refused(*args, **kwargs):
            raise AssertionError("a scrape walked an hdrhistogram in Python")

        monkeypatch.setattr(HdrHistogram, "get_percentile_to_value_dict", refused)
        monkeypatch.setattr(HdrHistogram, "get_value_at_percentile", refused)
        res = await client.get("/metrics")
        assert res.status_code == 200
        samples = _samples((await res.get_data()).decode())
    for q, p in ((0.5, 50), (0.9, 90), (0.99, 99), (0.999, 99.9)):
        key = (("model", "a"), ("quantile", str(q)), ("stage", "end_to_end"))
        assert samples["trioserve_latency_seconds", key] == expected[p] / 1e6
        idle = (("model", "idle"), ("quantile", str(q)), ("stage", "end_to_end"))
        assert np.isnan(samples["trioserve_latency_seconds", idle])
    wait = (("class", "realtime"), ("model", "a"), ("quantile", "0.5"), ("tenant", "t"))
    assert samples["trioserve_flow_wait_seconds", wait] >= 0
    assert np.isnan(samples["trioserve_flow_wait_seconds", (*wait[:3], ("tenant", "u"))])
