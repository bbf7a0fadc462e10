"""``GET /metrics`` in OpenMetrics for a scraper that prefers it (Prometheus asks for
it first), Prometheus's text format otherwise: content negotiation by q-value."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
import trioserve
from http_helpers import config, echo_model, serving, v2_input
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text
from runtime_helpers import Recorder, callable_model
from trioserve import CacheConfig, TenantConfig
from trioserve.transport import Gateway, open_http
from trioserve.transport._metrics import exposition

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
#: What Prometheus (3.x) sends when it scrapes.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)


@pytest.mark.parametrize(
    ("accept", "openmetrics"),
    [
        (None, False),
        ("", False),
        ("*/*", False),
        ("text/plain", False),
        ("text/*", False),
        ("application/json", False),
        ("application/openmetrics-text", True),
        ("APPLICATION/OpenMetrics-Text; Version=1.0.0; charset=utf-8", True),
        ("application/*", True),
        (PROMETHEUS_ACCEPT, True),
        ("application/openmetrics-text;q=0.5, */*;q=0.1", True),
        ("text/plain;q=0.1, application/openmetrics-text;q=0.2", True),
        # by q-value, not by order (prometheus_client's choose_encoder takes the first)
        ("application/openmetrics-text;q=0.5, text/plain;q=0.9", False),
        ("application/openmetrics-text;q=0.5, text/plain;q=0.5", False),  # a tie: the default
        ("application/openmetrics-text;q=0", False),  # not acceptable
        ("application/openmetrics-text;q=0, */*", False),  # the exact range wins over */*
        ("application/openmetrics-text;q=abc", False),  # malformed: left out
        ("application/openmetrics-text;q=2", False),
    ],
)
def test_openmetrics_is_served_when_accept_prefers_it(accept, openmetrics):
    body, content_type = exposition(CollectorRegistry(auto_describe=False), accept)
    assert (content_type == OPENMETRICS) == openmetrics
    assert body.endswith(b"# EOF\n") == openmetrics
    if not openmetrics:
        assert content_type.startswith("text/plain; version=")


async def test_every_series_parses_as_openmetrics(autojump_clock):
    """With the cache on, an objective, a slow lane, a rollout with a shadow and a
    tenant with credits (the docs' table's config), the OpenMetrics answer parses
    strictly, ends in ``# EOF``, and holds the same samples as the text one."""
    cfg = trioserve.Config(
        models=(
            callable_model("a", Recorder(), slo_ms=50.0),
            callable_model("b", Recorder(), replicas=2, slow_lane_cost=4),
            callable_model("c", Recorder(), versions=["1", "2", "3"],
                           rollout={"stable": "1", "canary": "2", "shadow": "3"}),
        ),
        tenants=(TenantConfig(name="t", default=True, credit_rate=1000.0),),
        cache=CacheConfig(capacity_bytes=1 << 20),
    )
    async with trioserve.open_runtime(cfg) as rt:
        client = Gateway(rt).app.test_client()
        data = orjson.dumps({"inputs": [v2_input([1.0])]})
        assert (await client.post("/v2/models/a/infer", data=data)).status_code == 200
        om = await client.get("/metrics", headers={"Accept": PROMETHEUS_ACCEPT})
        text = await client.get("/metrics")
        om_body = (await om.get_data()).decode()
        text_body = (await text.get_data()).decode()
    assert om.status_code == 200
    assert om.headers["Content-Type"] == OPENMETRICS
    assert om.headers["Vary"] == "Accept"
    assert text.headers["Content-Type"].startswith("text/plain; version=")
    assert om_body.endswith("# EOF\n")
    assert "# EOF" not in text_body

    def samples(families):
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in families for s in f.samples
        }

    om_samples = samples(parse_openmetrics(om_body))
    text_samples = samples(parse_text(text_body))
    assert len(om_samples) > 100
    # NaN != NaN: compare what each holds, and the values that are numbers
    assert om_samples.keys() == text_samples.keys()
    assert {k: v for k, v in om_samples.items() if v == v} == {
        k: v for k, v in text_samples.items() if v == v
    }


async def test_metrics_over_http_follow_accept():
    """Through the h11 front end: the request's Accept reaches the app."""
    async with serving(config(echo_model())) as gw, open_http(gw.url) as http:
        res = await http.infer("echo", {"x": np.ones((1, 1), np.float32)})
        assert res.status == 200
        om = await http.request("GET", "/metrics", headers=[("Accept", PROMETHEUS_ACCEPT)])
        text = await http.get("/metrics")
    assert om.status == 200
    assert om.headers["content-type"] == OPENMETRICS
    assert om.headers["vary"] == "Accept"
    families = {f.name: f for f in parse_openmetrics(om.body.decode())}
    [sample] = families["trioserve_requests"].samples
    assert (sample.name, sample.value) == ("trioserve_requests_total", 1.0)
    assert sample.labels == {"model": "echo", "tenant": "t", "status": "200"}
    assert text.headers["content-type"].startswith("text/plain; version=")
    assert not text.body.endswith(b"# EOF\n")
