"""Service-level objectives: which requests count good or bad, the burn rate over
its windows, and where it is shown (statistics, /metrics)."""

from __future__ import annotations

import attrs
import numpy as np
import orjson
import pytest
import trio
import trioserve
from http_helpers import serving, v2_input
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from runtime_helpers import callable_model, config, item
from trioserve import (
    ActorClosed,
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    ModelError,
    QuotaExceeded,
    UnknownModel,
)
from trioserve.actors import SloTracker
from trioserve.transport import open_gateway, open_http


# ---------------------------------------------------------------- the tracker alone
def test_a_result_within_the_objective_is_good_and_a_later_one_bad():
    slo = SloTracker(0.05, 0.99)
    slo.answered(1.0, 0.05)
    slo.answered(1.0, 0.0501)
    slo.failed(2.0)
    assert (slo.good, slo.bad) == (1, 2)
    assert slo.counts(2.0, 300) == (1, 2)


def test_the_burn_rate_is_the_bad_share_over_what_the_objective_allows():
    slo = SloTracker(0.05, 0.99)
    assert slo.burn_rate(0.0, 300) == 0.0  # nothing yet
    for i in range(98):
        slo.answered(float(i), 0.01)
    slo.failed(98.0)
    slo.failed(99.0)
    # 2 bad of 100 against 1% allowed
    assert slo.burn_rate(100.0, 300) == pytest.approx(2.0)


def test_a_window_forgets_what_came_before_it():
    slo = SloTracker(0.05, 0.9, bucket_s=10.0)
    for t in range(0, 600, 10):  # one bad request every 10 s for 10 minutes
        slo.failed(float(t))
    slo.answered(600.0, 0.0)
    # 5 min: the last 30 buckets, the current one among them: 29 bad (t = 310 ..
    # 590) and the good one at 600
    assert slo.counts(600.0, 300) == (1, 29)
    assert slo.counts(600.0, 3600) == (1, 60)
    assert slo.burn_rate(600.0, 300) == pytest.approx((29 / 30) / 0.1)
    # an hour and more later the buckets are empty again
    assert slo.counts(600.0 + 3600.0, 3600) == (0, 0)
    assert (slo.good, slo.bad) == (1, 60)  # the totals never forget


def test_buckets_skipped_are_emptied_and_the_ring_holds_an_hour():
    slo = SloTracker(1.0, 0.5, bucket_s=10.0)
    slo.failed(5.0)
    slo.failed(3595.0)  # 359 buckets later: the first is still in the hour
    assert slo.counts(3595.0, 3600) == (0, 2)
    slo.answered(3605.0, 0.0)  # the bucket of t=5 is reused for t=3605
    assert slo.counts(3605.0, 3600) == (1, 1)
    assert slo.counts(3605.0, 10) == (1, 0)


def test_buckets_split_at_multiples_of_their_width_below_zero_too():
    # MockClock starts at 0; trio's own clock may be any float, negative included
    slo = SloTracker(1.0, 0.5, bucket_s=10.0)
    slo.failed(-10.0)  # bucket -1 is [-10, 0)
    slo.failed(-1e-9)
    slo.answered(0.0, 0.0)  # bucket 0
    slo.answered(9.999, 0.0)
    assert slo.counts(9.999, 10) == (2, 0)
    assert slo.counts(9.999, 20) == (2, 2)
    slo.answered(10.0, 0.0)  # bucket 1
    assert slo.counts(10.0, 10) == (1, 0)
    assert slo.counts(10.0, 30) == (3, 2)
    # the window is whole buckets: 5 s is the current one, 10.001 s two
    assert slo.counts(10.0, 5) == (1, 0)
    assert slo.counts(10.0, 10.001) == (3, 0)


@pytest.mark.parametrize("start", [0.0, -5_000.0, 1.5e5, 1e15])
@pytest.mark.parametrize("gap", [3590.0, 3600.0, 1e6, 1e12])
def test_a_gap_past_the_horizon_empties_every_bucket(start, gap):
    slo = SloTracker(1.0, 0.5, bucket_s=10.0)
    slo.failed(start)
    slo.answered(start + gap, 0.0)
    # each start is a multiple of 10 s: 3590 s later is 359 buckets on, in the hour
    assert slo.counts(start + gap, 3600) == (1, 1 if gap < 3600.0 else 0)
    assert slo.counts(start + gap, 1e9) == slo.counts(start + gap, 3600)  # the horizon
    assert (slo.good, slo.bad) == (1, 1)


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.floats(0, 900), st.sampled_from(["good", "bad", "read"])),
        max_size=60,
    ),
    start=st.floats(-1e6, 1e6),
)
def test_reading_the_counts_changes_none_of_them(events, start):
    """statistics() and /metrics read counts at scrape times between requests: a
    tracker read so counts what a tracker never read does."""
    read, unread = SloTracker(0.05, 0.99), SloTracker(0.05, 0.99)
    now = start
    for gap, what in events:
        now += gap
        if what == "read":
            read.statistics(now)
            continue
        for slo in (read, unread):
            if what == "good":
                slo.answered(now, 0.01)
            else:
                slo.failed(now)
    for later in (0.0, 299.0, 3599.0):
        for window in (10.0, 300.0, 3600.0):
            assert read.counts(now + later, window) == unread.counts(now + later, window)
    assert read.statistics(now) == unread.statistics(now)


@pytest.mark.parametrize("target", [0.0, 1.0, -0.5, 2.0])
def test_a_target_must_lie_between_0_and_1(target):
    with pytest.raises(ValueError, match="target must be above 0 and below 1"):
        SloTracker(0.05, target)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("slo_ms", 0, "models.m.slo_ms: must be a finite number > 0.0, got 0"),
        ("slo_target", 1.0, "models.m.slo_target: must be a number above 0 and below 1, got 1.0"),
        ("slo_target", 0, "models.m.slo_target: must be a number above 0 and below 1, got 0"),
        ("slo_target", "high", "models.m.slo_target: must be a number above 0 and below 1"),
        ("slo_target", 0.95, "models.m.slo_target: an objective needs slo_ms, the latency "
         "its share of requests is to be answered within; set slo_ms too, or leave "
         "slo_target out"),
    ],
)
def test_the_objective_is_checked_in_the_config(tmp_path, field, value, message):
    path = tmp_path / "c.toml"
    path.write_text(f'[models.m]\nbackend = "echo"\n{field} = {value!r}\n'.replace("'", '"'))
    with pytest.raises(ConfigError) as info:
        trioserve.load_config(path)
    assert message in str(info.value)


# ---------------------------------------------------------------- through the runtime
def raising_on_7(items):
    if any(float(it["x"][0]) == 7.0 for it in items):
        raise RuntimeError("seven")
    return [{"y": it["x"]} for it in items]


def slo_config(**cfg):
    return config(callable_model(
        "m", raising_on_7, slo_ms=50, slo_target=0.9, max_wait_ms=0, **cfg
    ))


async def test_results_and_server_failures_count_client_errors_do_not(autojump_clock):
    async with trioserve.open_runtime(slo_config(versions=["1"])) as rt:
        await rt.infer("m", item(1))  # at once: good
        with pytest.raises(ModelError):
            await rt.infer("m", item(7))  # the model raised: bad
        with pytest.raises(InvalidInput):
            await rt.infer("m", {"x": np.zeros((2, 2), np.float32)})  # the client's
        with pytest.raises(UnknownModel):
            await rt.infer("m", item(1), version="9")  # the client's
        with trio.move_on_after(0):  # the caller left: neither
            await rt.infer("m", item(2))
        await rt.infer_batch("m", [item(3), item(4)])  # one call: one good
        stats = rt.statistics()["m"]["slo"]
    assert (stats["good"], stats["bad"]) == (2, 1)
    assert stats["slo_ms"] == 50
    assert stats["target"] == 0.9
    assert stats["burn_rate"] == {"5m": pytest.approx((1 / 3) / 0.1),
                                  "1h": pytest.approx((1 / 3) / 0.1)}


async def test_a_result_later_than_the_objective_is_bad(autojump_clock):
    # one request, batches closing after 80 ms of waiting for company
    cfg = config(callable_model("m", raising_on_7, slo_ms=50, max_wait_ms=80,
                                max_batch_size=8))
    async with trioserve.open_runtime(cfg) as rt:
        await rt.infer("m", item(1))
        stats = rt.statistics()["m"]["slo"]
    assert (stats["good"], stats["bad"]) == (0, 1)
    assert stats["target"] == 0.99  # slo_target not set: the default


async def test_a_deadline_of_the_model_is_bad_and_a_cache_hit_good(autojump_clock):
    cfg = config(
        callable_model("m", raising_on_7, slo_ms=50, max_wait_ms=0),
        callable_model("slow", raising_on_7, slo_ms=50, max_wait_ms=500, max_batch_size=8,
                       timeout_ms=100),
    )
    cfg = trioserve.Config(
        models=cfg.models, tenants=cfg.tenants, runtime=cfg.runtime,
        cache=trioserve.CacheConfig(capacity_bytes=1 << 20),
    )
    async with trioserve.open_runtime(cfg) as rt:
        with pytest.raises(DeadlineExceeded):
            await rt.infer("slow", item(1))  # queued past its 100 ms
        await rt.infer("m", item(1))
        await rt.infer("m", item(1))  # a hit
        stats = rt.statistics()
    assert (stats["slow"]["slo"]["good"], stats["slow"]["slo"]["bad"]) == (0, 1)
    assert (stats["m"]["slo"]["good"], stats["m"]["slo"]["bad"]) == (2, 0)
    assert rt.cache_statistics()["hits"] == 1


async def test_a_model_without_an_objective_has_none():
    cfg = config(callable_model("m", raising_on_7))
    async with trioserve.open_runtime(cfg) as rt:
        await rt.infer("m", item(1))
        assert rt.statistics()["m"]["slo"] is None
        assert rt.models["m"].slo is None


async def test_the_objective_is_on_metrics_for_http_requests():
    async with serving(slo_config()) as gw, open_http(gw.url) as http:
        body = {"inputs": [v2_input([1.0])]}
        ok = await http.request("POST", "/v2/models/m/infer", orjson.dumps(body))
        bad = await http.request(
            "POST", "/v2/models/m/infer", orjson.dumps({"inputs": [v2_input([7.0])]}))
        wrong = await http.request("POST", "/v2/models/m/infer", b"{")
        text = (await http.request("GET", "/metrics")).body.decode()
    assert (ok.status, bad.status, wrong.status) == (200, 500, 400)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text) for s in f.samples
    }
    assert samples[("trioserve_slo_requests_total", (("model", "m"), ("outcome", "good")))] == 1
    assert samples[("trioserve_slo_requests_total", (("model", "m"), ("outcome", "bad")))] == 1
    assert samples[("trioserve_slo_target", (("model", "m"),))] == 0.9
    for window in ("5m", "1h"):
        assert samples[("trioserve_slo_burn_rate", (("model", "m"), ("window", window)))] == (
            pytest.approx(0.5 / 0.1))


# ---------------------------------------------------------------- every path, counted once
def slo_counts(rt, model="m"):
    slo = rt.models[model].slo
    return slo.good, slo.bad


def held_config(runtime=None, **cfg):
    """A model whose lone request waits 500 ms for company before its batch closes."""
    return config(callable_model(
        "m", raising_on_7, slo_ms=50, max_wait_ms=500, max_batch_size=8, **cfg
    ), **(runtime or {}))


def infer_body(x, **parameters):
    body = {"inputs": [v2_input(x)]}
    if parameters:
        body["parameters"] = parameters
    return orjson.dumps(body)


async def test_a_caller_that_leaves_after_the_objective_counts_bad_before_it_neither(
    autojump_clock,
):
    async with trioserve.open_runtime(held_config()) as rt:
        with trio.move_on_after(0.05):  # left at the objective, not past it
            await rt.infer("m", item(1))
        assert slo_counts(rt) == (0, 0)
        with trio.move_on_after(0.2):  # the objective missed, whoever leaves after
            await rt.infer("m", item(1))
        assert slo_counts(rt) == (0, 1)
        with trio.move_on_after(0.2):
            await rt.infer_batch("m", [item(1), item(2)])
        assert slo_counts(rt) == (0, 2)


async def test_a_request_timeout_over_http_is_bad_past_the_objective(autojump_clock):
    async with trioserve.open_runtime(held_config()) as rt, open_gateway(
        rt, host="127.0.0.1", port=0
    ) as gw:
        short = await gw.infer("m", None, infer_body([1.0], timeout_ms=20))
        assert slo_counts(rt) == (0, 0)  # the client's choice, within the objective
        long = await gw.infer("m", None, infer_body([1.0], timeout_ms=200))
        assert slo_counts(rt) == (0, 1)
    assert (short[0], long[0]) == (504, 504)


async def test_an_edge_cache_hit_over_http_counts_good_as_an_in_process_hit(autojump_clock):
    cfg = config(callable_model("m", raising_on_7, slo_ms=50, max_wait_ms=0))
    cfg = attrs.evolve(cfg, cache=trioserve.CacheConfig(capacity_bytes=1 << 20))
    async with trioserve.open_runtime(cfg) as rt, open_gateway(
        rt, host="127.0.0.1", port=0
    ) as gw:
        body = infer_body([1.0])
        first = await gw.infer("m", None, body)
        again = await gw.infer("m", None, body)  # the whole answer, from the edge
        assert (first[0], again[0]) == (200, 200)
        assert first[2] == again[2]
        assert rt.cache_statistics()["hits"] == 1
        assert slo_counts(rt) == (2, 0)


async def test_an_idempotent_replay_is_not_a_new_request(autojump_clock):
    async with trioserve.open_runtime(slo_config()) as rt, open_gateway(
        rt, host="127.0.0.1", port=0
    ) as gw:
        ok = [await gw.infer("m", None, infer_body([1.0]), idempotency_key="a")
              for _ in range(3)]
        assert [a[0] for a in ok] == [200, 200, 200]
        assert slo_counts(rt) == (1, 0)  # two replays of the first answer
        # A 5xx is not kept (a retry is worth it): each retry runs, a request again.
        bad = [await gw.infer("m", None, infer_body([7.0]), idempotency_key="b")
               for _ in range(2)]
        assert [a[0] for a in bad] == [500, 500]
        assert slo_counts(rt) == (1, 2)


async def test_a_batch_dimension_over_http_is_one_request(autojump_clock):
    async with trioserve.open_runtime(slo_config()) as rt, open_gateway(
        rt, host="127.0.0.1", port=0
    ) as gw:
        ok = await gw.infer("m", None, infer_body([[1.0], [2.0], [3.0]]))
        bad = await gw.infer("m", None, infer_body([[1.0], [7.0]]))
        assert (ok[0], bad[0]) == (200, 500)
        assert slo_counts(rt) == (1, 1)


async def test_coalesced_callers_count_one_each(autojump_clock):
    async with trioserve.open_runtime(held_config(coalesce=True)) as rt:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(rt.infer, "m", item(1, 2))
        # one run of 500 ms, three callers: three requests, each late
        assert slo_counts(rt) == (0, 3)


async def test_over_quota_is_not_counted_and_shed_is_bad(autojump_clock):
    cfg = trioserve.Config(
        models=(callable_model("m", raising_on_7, slo_ms=50, max_wait_ms=0),),
        tenants=(trioserve.TenantConfig(name="t", default=True, credit_rate=1.0,
                                        credit_burst=1.0),),
    )
    async with trioserve.open_runtime(cfg) as rt:
        await rt.infer("m", item(1))
        with pytest.raises(QuotaExceeded):
            await rt.infer("m", item(1))  # the tenant's own quota: 429
        assert slo_counts(rt) == (1, 0)


async def test_shutdown_fails_requests_in_flight_and_refuses_new_ones_bad(autojump_clock):
    errors = []

    async def call(rt):
        try:
            await rt.infer("m", item(1))
        except ActorClosed as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        async with trioserve.open_runtime(
            held_config({"graceful_timeout_s": 0.01})
        ) as rt:
            nursery.start_soon(call, rt)
            await trio.testing.wait_all_tasks_blocked()
    assert len(errors) == 1  # cut at the end of the grace
    assert slo_counts(rt) == (0, 1)
    with pytest.raises(ActorClosed):
        await rt.infer("m", item(1))  # refused: the runtime is shut down
    with pytest.raises(ActorClosed):
        await rt.infer_batch("m", [item(1), item(2)])
    assert slo_counts(rt) == (0, 3)
