"""Tenancy and request classes over HTTP: the tenant comes only from the API key,
the class from ``parameters``; 403 for a class the tenant may not use, 429 with a
Retry-After computed from the credit refill; per-flow figures in /metrics."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
import trioserve
from http_helpers import config, echo_model, serving, v2_input
from trioserve import TenantConfig
from trioserve.transport import open_http

TENANTS = (
    TenantConfig(name="A", api_keys=("key-a",)),
    TenantConfig(name="B", api_keys=("key-b",)),
    TenantConfig(name="nightly", api_keys=("key-n",), classes=("batch",)),
    TenantConfig(name="metered", api_keys=("key-m",), credit_rate=1.0, credit_burst=1.0),
)


def body(**params):
    doc = {"inputs": [v2_input(np.ones(3, np.float32))]}
    if params:
        doc["parameters"] = params
    return orjson.dumps(doc)


@pytest.fixture
async def gw():
    async with serving(config(echo_model(), tenants=TENANTS)) as gw:
        yield gw


async def post(gw, key, **params):
    async with open_http(gw.url) as http:
        return await http.request(
            "POST", "/v2/models/echo/infer", body(**params),
            headers=[("authorization", f"Bearer {key}")],
        )


def flows(gw):
    stats = gw.runtime.models["echo"].scheduler.policy.stats
    return {k: (f.admitted, f.dispatched) for k, f in stats.items()}


async def test_the_tenant_is_the_api_keys_never_the_bodys(gw):
    res = await post(gw, "key-a", tenant="B")
    assert res.status == 200
    assert flows(gw) == {("A", "realtime"): (1, 1)}
    assert gw.requests[("echo", "A", 200)] == 1
    assert ("echo", "B", 200) not in gw.requests


@pytest.mark.parametrize(
    ("params", "cls"),
    [
        ({}, "realtime"),
        ({"class": "batch"}, "batch"),
        ({"priority": "batch"}, "batch"),
        ({"priority": 1}, "realtime"),
        ({"priority": 2}, "batch"),
        ({"priority": 9}, "realtime"),  # past the last level: the default, as Triton
        ({"priority": 0}, "realtime"),  # the tenant's default
        ({"priority": "9" * 5000}, "realtime"),  # past the last, however long
        # Both sent: the level is read as the class it names before they are compared.
        ({"priority": 1, "class": "realtime"}, "realtime"),
        ({"priority": 2, "class": "batch"}, "batch"),
        ({"priority": "02", "class": "batch"}, "batch"),
        ({"priority": "batch", "class": "batch"}, "batch"),
        # A level naming no class (0: Triton's unset; past the last) leaves it to class.
        ({"priority": 0, "class": "batch"}, "batch"),
        ({"priority": 9, "class": "batch"}, "batch"),
    ],
)
async def test_the_class_comes_from_parameters(gw, params, cls):
    res = await post(gw, "key-a", **params)
    assert res.status == 200, res.body
    assert flows(gw) == {("A", cls): (1, 1)}


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"class": "gold"}, "unknown request class 'gold'; classes: realtime, batch"),
        ({"priority": -1}, "parameters.priority must be a class name or a level >= 0"),
        ({"class": "batch", "priority": "realtime"}, "disagree"),
        (
            {"class": "batch", "priority": 1},
            'parameters.class "batch" and parameters.priority 1 (class \'realtime\') '
            "disagree; send one of them",
        ),
        ({"class": "realtime", "priority": "2"}, "(class 'batch') disagree"),
        ({"class": 3}, "parameters.class must be a class name"),
        ({"priority": "\u00b2"}, "unknown request class '\u00b2'"),  # isdigit(), no level
    ],
)
async def test_a_bad_class_is_400_naming_the_problem(gw, params, message):
    res = await post(gw, "key-a", **params)
    assert res.status == 400
    assert message in res.json()["error"]
    assert flows(gw) == {}


async def test_a_class_the_tenant_may_not_use_is_403(gw):
    res = await post(gw, "key-n", **{"class": "realtime"})
    assert res.status == 403
    assert res.json()["error"] == (
        "tenant 'nightly' may not use request class 'realtime'; allowed: batch"
    )
    ok = await post(gw, "key-n")  # no class: its first allowed one
    assert ok.status == 200
    assert flows(gw) == {("nightly", "batch"): (1, 1)}


async def test_a_level_and_a_class_naming_a_class_the_tenant_may_not_use_is_403(gw):
    res = await post(gw, "key-n", **{"class": "realtime", "priority": 1})
    assert res.status == 403
    ok = await post(gw, "key-n", **{"class": "batch", "priority": 2})
    assert ok.status == 200
    assert flows(gw) == {("nightly", "batch"): (1, 1)}


async def test_tritons_timeout_0_is_no_timeout_of_the_requests_own(gw):
    # Triton's default for ``timeout`` (µs) is 0, "no timeout": it was refused with 400.
    res = await post(gw, "key-a", timeout=0, priority=0)
    assert res.status == 200, res.body
    assert flows(gw) == {("A", "realtime"): (1, 1)}
    refused = await post(gw, "key-a", timeout_ms=0)
    assert refused.status == 400
    assert "parameters.timeout_ms must be a positive number, got 0" in refused.json()["error"]
    # 0.0 is the same 0 (it was a 400); a huge timeout is a deadline far off
    for timeout in (0.0, 1e300, 2**64 - 1):
        res = await post(gw, "key-a", timeout=timeout)
        assert res.status == 200, (timeout, res.body)
    for timeout in (True, -0.5):
        refused = await post(gw, "key-a", timeout=timeout)
        assert refused.status == 400
        assert refused.json()["error"] == (
            f"parameters.timeout must be a positive number, got {orjson.dumps(timeout).decode()}"
        )


async def test_over_quota_realtime_is_429_with_retry_after_from_the_refill(gw):
    first = await post(gw, "key-m")
    assert first.status == 200
    second = await post(gw, "key-m")
    assert second.status == 429
    # 1 credit per second, bucket of 1, just emptied: back in (just under) 1 s.
    assert second.headers["retry-after"] == "1"
    assert "tenant 'metered' is over its credit rate (1/s, burst 1)" in second.json()["error"]
    assert gw.runtime.credits_used["metered"] == 1


async def test_metrics_expose_flows_and_credits(gw):
    assert (await post(gw, "key-a", **{"class": "batch"})).status == 200
    assert (await post(gw, "key-m")).status == 200
    async with open_http(gw.url) as http:
        text = (await http.get("/metrics")).body.decode()
    flow = 'class="batch",model="echo"'
    for line in (
        f'trioserve_flow_requests_total{{{flow},outcome="admitted",tenant="A"}} 1.0',
        f'trioserve_flow_requests_total{{{flow},outcome="dispatched",tenant="A"}} 1.0',
        f'trioserve_flow_served_cost_total{{{flow},tenant="A"}} 1.0',
        f'trioserve_flow_queue_depth{{{flow},tenant="A"}} 0.0',
        'trioserve_credits_used_total{tenant="metered"} 1.0',
        'trioserve_credits_refunded_total{tenant="metered"} 0.0',
        'trioserve_credit_waits_total{tenant="metered"} 0.0',  # its class refuses
        'trioserve_credit_wait_seconds_total{tenant="metered"} 0.0',
        'trioserve_admission_limit{model="echo"}',
    ):
        assert line in text, line
    assert f'trioserve_flow_wait_seconds{{{flow},quantile="0.99",tenant="A"}}' in text
    assert 'trioserve_credits_available{tenant="metered"}' in text


def test_tenant_classes_must_be_configured_classes():
    with pytest.raises(trioserve.ConfigError, match=r"^tenants\.x\.classes: unknown class 'gold'"):
        config(echo_model(), tenants=(TenantConfig(name="x", classes=("gold",)),))


async def metrics_text(gw) -> str:
    async with open_http(gw.url) as http:
        return (await http.get("/metrics")).body.decode()


async def test_every_configured_tenant_and_class_has_its_flow_series_from_the_start(gw):
    """A flow's series existed only once it had seen a request, so a dashboard or an
    alert on a tenant that had sent nothing yet found no series at all (and a rate()
    over its first requests missed them). Now every configured tenant and class has
    them at zero from the start."""
    text = await metrics_text(gw)
    for tenant in ("A", "B", "nightly", "metered"):
        for cls in ("realtime", "batch"):
            flow = f'class="{cls}",model="echo"'
            assert f'trioserve_flow_queue_depth{{{flow},tenant="{tenant}"}} 0.0' in text
            for outcome in (
                "admitted", "shed", "expired", "dispatched", "hedged", "withdrawn", "closed",
                "pushed_out", "expired_running",
            ):
                line = (
                    f'trioserve_flow_requests_total{{{flow},outcome="{outcome}",'
                    f'tenant="{tenant}"}} 0.0'
                )
                assert line in text, line
            assert f'trioserve_flow_served_cost_total{{{flow},tenant="{tenant}"}} 0.0' in text
            assert f'trioserve_flow_wait_seconds_count{{{flow},tenant="{tenant}"}} 0.0' in text
            for q in ("0.5", "0.99"):
                assert (
                    f'trioserve_flow_wait_seconds{{{flow},quantile="{q}",tenant="{tenant}"}} NaN'
                ) in text
    # and the figures move from zero once requests come
    assert (await post(gw, "key-n")).status == 200
    text = await metrics_text(gw)
    flow = 'class="batch",model="echo"'
    admitted = f'trioserve_flow_requests_total{{{flow},outcome="admitted",tenant="nightly"}}'
    assert f"{admitted} 1.0" in text
    assert f'trioserve_flow_wait_seconds_count{{{flow},tenant="nightly"}} 1.0' in text


class _Lengths(trioserve.ModelBackend):
    """Echoes ``x`` as ``y``; an item costs its length (inline)."""

    inputs = (trioserve.TensorSpec(name="x", datatype="FP32", shape=(-1,)),)
    outputs = (trioserve.TensorSpec(name="y", datatype="FP32", shape=(-1,)),)
    default_execution = "inline"

    def prepare(self, name, inputs):
        item, _ = super().prepare(name, inputs)
        return item, int(item["x"].shape[0])

    def load(self, device, *, torch_threads=1):
        return lambda items: [{"y": it["x"]} for it in items]


async def test_the_slow_lanes_flows_are_in_the_metrics():
    """A model with a slow lane keeps a second queue; its flows were left out of
    /metrics (only the first lane's were read), so a tenant's long requests were
    admitted, served and waited for without a trace there. Now a flow's series count
    both lanes."""
    model = trioserve.ModelConfig(
        name="m", backend=_Lengths(), replicas=2, slow_lane_cost=10, max_wait_ms=0.0
    )
    async with serving(config(model, tenants=TENANTS)) as gw, open_http(gw.url) as http:
        for n in (3, 20, 30):  # one short request, two long ones
            doc = {"inputs": [v2_input(np.ones(n, np.float32))]}
            res = await http.request(
                "POST", "/v2/models/m/infer", orjson.dumps(doc),
                headers=[("authorization", "Bearer key-a")],
            )
            assert res.status == 200, res.body
        text = (await http.get("/metrics")).body.decode()
    flow = 'class="realtime",model="m"'
    for line in (
        f'trioserve_flow_requests_total{{{flow},outcome="admitted",tenant="A"}} 3.0',
        f'trioserve_flow_requests_total{{{flow},outcome="dispatched",tenant="A"}} 3.0',
        f'trioserve_flow_served_cost_total{{{flow},tenant="A"}} 53.0',
        f'trioserve_flow_wait_seconds_count{{{flow},tenant="A"}} 3.0',
        f'trioserve_flow_queue_depth{{{flow},tenant="A"}} 0.0',
    ):
        assert line in text, line
    assert f'trioserve_flow_wait_seconds{{{flow},quantile="0.99",tenant="A"}} NaN' not in text


@pytest.mark.parametrize("close", [False, True], ids=["keep-alive", "connection-close"])
async def test_two_authorization_headers_authenticate_nobody(gw, close):
    """A request with two Authorization field lines was served as the tenant of the
    last key (and the control plane's route took the first): a proxy that checks one
    of them and the server that uses the other disagree on who is asking. A
    singleton field sent twice is refused (401), whichever keys they hold."""
    extra = [("connection", "close")] if close else []
    for keys in (("key-a", "key-b"), ("key-a", "key-a"), ("nope", "key-a")):
        async with open_http(gw.url) as http:
            res = await http.request(
                "POST", "/v2/models/echo/infer", body(),
                headers=[("authorization", f"Bearer {k}") for k in keys] + extra,
            )
        assert res.status == 401, (keys, res.body)
        assert res.headers["www-authenticate"] == 'Bearer realm="trioserve"'
        assert res.json()["error"] == (
            "more than one Authorization header: send one 'Bearer <api key>'"
        )
    assert flows(gw) == {}
    assert dict(gw.requests) == {("echo", "-", 401): 3}


async def test_two_authorization_headers_are_refused_in_process_too(gw):
    answer = await gw.infer(
        "echo", None, body(), authorization=(b"Bearer key-a", b"Bearer key-b")
    )
    assert answer[0] == 401
