"""``GET /metrics``: the runtime's and the gateway's figures in Prometheus text format,
or in OpenMetrics for a scraper that prefers it (:func:`exposition`).

A custom Collector on a private CollectorRegistry reads everything at scrape time:
nothing on the request path touches prometheus_client. Latency quantiles come from
the runtime's hdrhistograms (integer microseconds) as summaries; their ``_count`` and
``_sum`` are the exact count and sum (``Latency.totals()``, values past the
histogram's range included), the figures the statistics extension reports too. A
summary with nothing in its histogram has NaN quantiles, as Prometheus's own clients
give: there is no latency to report, and 0 would claim one.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.openmetrics.exposition import (
    CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE,
)
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.registry import Collector
from trioserve.actors import OUTCOMES, REPLICA_HEALTH, SLO_WINDOWS, values_at

from ._idempotency import ENTRY_OVERHEAD
from ._rollout_metrics import rollout_metrics

if TYPE_CHECKING:
    from ._gateway import Gateway

QUANTILES = (0.5, 0.9, 0.99, 0.999)
PERCENTILES = (50, 90, 99, 99.9)
STAGES = ("queue_wait", "batch_exec", "end_to_end")


class GatewayCollector(Collector):
    """Collects a gateway's request counts and its runtime's per-model figures."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    @staticmethod
    def _slo(gw: Gateway) -> Iterator[Metric]:
        """The models' service-level objectives (``slo_ms``): a sample for each model
        that has one (docs/gateway.md's metrics table)."""
        counted = CounterMetricFamily(
            "trioserve_slo_requests",
            "Requests counted against the model's objective (slo_ms, slo_target): good "
            "(a result within slo_ms) or bad (later, a 5xx failure, or a caller that left "
            "after slo_ms); in process and over HTTP and the stream alike.",
            labels=["model", "outcome"],
        )
        target = GaugeMetricFamily(
            "trioserve_slo_target",
            "The share of requests the objective promises good (slo_target).",
            labels=["model"],
        )
        burn = GaugeMetricFamily(
            "trioserve_slo_burn_rate",
            "The share of bad requests over the last window over the share the objective "
            "allows (1 - slo_target): 1 spends the error budget exactly over the "
            "objective's period, 14.4 a 30-day budget in two days.",
            labels=["model", "window"],
        )
        now = trio.current_time()
        for name, served in sorted(gw.runtime.models.items()):
            slo = served.slo
            if slo is None:
                continue
            counted.add_metric([name, "good"], slo.good)
            counted.add_metric([name, "bad"], slo.bad)
            target.add_metric([name], slo.target)
            for window, seconds in SLO_WINDOWS:
                burn.add_metric([name, window], slo.burn_rate(now, seconds))
        yield from (counted, target, burn)

    @staticmethod
    def _autoscaling(gw: Gateway) -> Iterator[Metric]:
        """The replicas and decisions of autoscaled models (``[models.NAME.autoscaling]``),
        all versions' together, and by version for a model whose versions have
        replicas of their own; nothing at all when no model is autoscaled (the series
        of a runtime without autoscaling are what they were)."""
        rt = gw.runtime
        scaled = [(n, s) for n, s in sorted(rt.models.items()) if s.scaler is not None]
        if not scaled:
            return
        replicas = GaugeMetricFamily(
            "trioserve_autoscale_replicas",
            "An autoscaled model's replicas (starting, serving or being retired), all "
            "its versions'.",
            labels=["model"],
        )
        decisions = CounterMetricFamily(
            "trioserve_autoscale_decisions",
            "Changes of an autoscaled model's replica count, up or down, all its "
            "versions'.",
            labels=["model", "direction"],
        )
        by_version = GaugeMetricFamily(
            "trioserve_autoscale_version_replicas",
            "The replicas of a version of an autoscaled model whose versions have "
            "replicas of their own (those of the model's backend shared by the versions "
            "it serves).",
            labels=["model", "version"],
        )
        version_decisions = CounterMetricFamily(
            "trioserve_autoscale_version_decisions",
            "Changes of a version's replica count, up or down, for an autoscaled model "
            "whose versions have replicas of their own.",
            labels=["model", "version", "direction"],
        )
        versioned = False
        for name, _ in scaled:
            groups = [g for g in rt._groups_of(name) if g.scaler is not None]
            replicas.add_metric([name], sum(len(g.batchers) for g in groups))
            for direction in sorted(groups[0].scaler.scaler.decisions):
                decisions.add_metric(
                    [name, direction],
                    sum(g.scaler.scaler.decisions[direction] for g in groups),
                )
            family = rt._families.get(name)
            if family is None or len(family.groups) < 2:
                continue
            versioned = True
            for version, served in family.by_version.items():
                by_version.add_metric([name, version], len(served.batchers))
                for direction, n in sorted(served.scaler.scaler.decisions.items()):
                    version_decisions.add_metric([name, version, direction], n)
        yield from (replicas, decisions)
        if versioned:
            yield from (by_version, version_decisions)

    def collect(self) -> Iterator[Metric]:
        gw = self._gateway
        requests = CounterMetricFamily(
            "trioserve_requests",
            "Infer requests answered by the gateway, by model, tenant and HTTP status.",
            labels=["model", "tenant", "status"],
        )
        for (model, tenant, status), n in sorted(gw.requests.items()):
            requests.add_metric([model, tenant, str(status)], n)
        yield requests

        latency = SummaryMetricFamily(
            "trioserve_latency_seconds",
            "Request latency by stage (queue wait, batch execution, end to end), "
            "from hdrhistograms.",
            labels=["model", "stage"],
        )
        batches = CounterMetricFamily(
            "trioserve_batches", "Batches executed.", labels=["model"]
        )
        items = CounterMetricFamily(
            "trioserve_batch_items", "Items executed in batches.", labels=["model"]
        )
        fill = GaugeMetricFamily(
            "trioserve_batch_fill_ratio",
            "Mean batch fill: each batch's items over the max_batch_size of the "
            "copy that ran it, averaged over the batches.",
            labels=["model"],
        )
        depth = GaugeMetricFamily(
            "trioserve_queue_depth", "Requests waiting in the model's scheduler.", labels=["model"]
        )
        outcomes = CounterMetricFamily(
            "trioserve_batcher_outcomes",
            "Abnormal batch outcomes: items retried or answered model_error, "
            "invalid_input items refused by their replica (too large for its worker's "
            "pipe), poison requests, straggler batches cut, worker_lost workers.",
            labels=["model", "outcome"],
        )
        replicas = GaugeMetricFamily(
            "trioserve_replicas",
            "The model's replicas (all its versions') by health: ready, half_open (its "
            "circuit breaker's trial: pulling work on probation), open (its breaker "
            "open: pulling nothing), degraded, replacing, retiring, lost, or the "
            "replica's actor state when it is not running.",
            labels=["model", "health"],
        )
        for name, served in sorted(gw.runtime.models.items()):
            m = served.metrics
            for stage in STAGES:
                lat = getattr(m, stage)
                count, total_us = lat.totals()  # folds the buffered values first
                values = values_at([lat.hist], PERCENTILES)
                for i, q in enumerate(QUANTILES):
                    latency.add_sample(
                        "trioserve_latency_seconds",
                        {"model": name, "stage": stage, "quantile": str(q)},
                        values[i] / 1e6 if values is not None else math.nan,
                    )
                latency.add_metric([name, stage], count_value=count, sum_value=total_us / 1e6)
            batches.add_metric([name], m.batches)
            items.add_metric([name], m.items)
            fill.add_metric([name], m.fill_ratio)
            # (all its versions' queues, for a model whose versions have their own)
            depth.add_metric([name], sum(q.queue_depth() for q in gw.runtime._lanes_of(name)))
            # every outcome from the start, at 0 until it happens
            for outcome in sorted(set(OUTCOMES) | set(m.statuses)):
                outcomes.add_metric([name, str(outcome)], m.statuses[outcome])
            # every health from the start, at 0 when no replica has it
            health = collections.Counter(
                getattr(b, "health", b.state.value)
                for g in gw.runtime._groups_of(name) for b in g.batchers
            )
            for h in (*REPLICA_HEALTH, *sorted(set(health) - set(REPLICA_HEALTH))):
                replicas.add_metric([name, h], health[h])
        yield from (latency, batches, items, fill, depth, outcomes, replicas)
        yield from self._autoscaling(gw)
        yield from rollout_metrics(gw.runtime)
        yield from self._slo(gw)
        yield from self._flows(gw)

        stats = gw.statistics()
        for metric, doc, value in (
            ("trioserve_connections", "Open client connections (HTTP and WebSocket).",
             stats.connections),
            ("trioserve_stream_connections", "Open /v2/stream WebSocket connections.",
             stats.streams),
            ("trioserve_requests_in_flight", "HTTP infer requests being answered.",
             stats.requests_in_flight),
            ("trioserve_connections_limit",
             "The most client connections open at once (server.max_connections).",
             gw.server_config.max_connections),
        ):
            yield GaugeMetricFamily(metric, doc, value=value)
        yield CounterMetricFamily(
            "trioserve_http_client_gone",
            "HTTP infer requests given up because the client closed its connection "
            "while they waited (withdrawn if queued, their answer dropped if running; "
            "not in trioserve_requests).",
            value=stats.clients_gone,
        )
        yield CounterMetricFamily(
            "trioserve_stream_write_timeouts",
            "/v2/stream connections closed (1008) because the client took none of its "
            "answers for its write timeout (server.stream_write_timeout_s, else "
            "server.write_timeout_s; its requests in flight withdrawn).",
            value=stats.stream_write_timeouts,
        )
        yield CounterMetricFamily(
            "trioserve_stream_ping_timeouts",
            "/v2/stream connections closed (1011) because the client sent nothing, "
            "not even a pong, for twice server.stream_ping_interval_s (its requests in "
            "flight withdrawn).",
            value=stats.stream_ping_timeouts,
        )
        yield CounterMetricFamily(
            "trioserve_stream_byte_budget_waits",
            "Times a /v2/stream stopped reading because its messages in flight and its "
            "answers not yet written held server.stream_in_flight_bytes (with fewer "
            "than server.stream_in_flight requests in flight).",
            value=stats.stream_byte_budget_waits,
        )
        yield CounterMetricFamily(
            "trioserve_http_write_timeouts",
            "HTTP connections closed because the client took no byte of an answer for "
            "server.write_timeout_s (requests it pipelined behind it never admitted).",
            value=stats.http_write_timeouts,
        )
        yield CounterMetricFamily(
            "trioserve_http_connections_refused",
            "Connections (HTTP or WebSocket) answered 503 and closed because "
            "server.max_connections were open and none of them was idle.",
            value=stats.connections_refused,
        )
        yield CounterMetricFamily(
            "trioserve_http_connections_evicted",
            "Idle keep-alive HTTP connections closed to make room for a new one at "
            "server.max_connections.",
            value=stats.connections_evicted,
        )
        yield from GatewayCollector._idempotency(gw)

    @staticmethod
    def _idempotency(gw: Gateway) -> Iterator[Metric]:
        """The Idempotency-Key store: what it holds and why answers left it early."""
        idem = gw.idempotency.statistics()
        for metric, doc, value in (
            ("trioserve_idempotency_keys",
             "Answers the Idempotency-Key store keeps (server.idempotency_max_keys at most).",
             idem.keys),
            ("trioserve_idempotency_running",
             "Requests with an Idempotency-Key running: their keys are held, never evicted.",
             idem.running),
            ("trioserve_idempotency_bytes",
             "Bytes the Idempotency-Key store holds, as counted: answers' bodies, keys, "
             f"and {ENTRY_OVERHEAD} bytes an entry besides (running keys too).",
             idem.bytes),
            ("trioserve_idempotency_bytes_limit",
             "The most bytes the Idempotency-Key store holds (server.idempotency_max_bytes).",
             idem.max_bytes),
        ):
            yield GaugeMetricFamily(metric, doc, value=value)
        yield CounterMetricFamily(
            "trioserve_idempotency_replays",
            "Repeats of a request with an Idempotency-Key answered with the first's answer.",
            value=idem.replayed,
        )
        evictions = CounterMetricFamily(
            "trioserve_idempotency_evictions",
            "Answers the Idempotency-Key store dropped before their window to stay within "
            "server.idempotency_max_keys (bound=keys) or server.idempotency_max_bytes "
            "(bound=bytes): a retry with their key runs again.",
            labels=["bound"],
        )
        evictions.add_metric(["keys"], idem.evicted_keys)
        evictions.add_metric(["bytes"], idem.evicted_bytes)
        yield evictions
        yield CounterMetricFamily(
            "trioserve_idempotency_too_large",
            "Answers not kept by the Idempotency-Key store because one alone costs more "
            "than server.idempotency_max_bytes: a retry with their key runs again.",
            value=idem.too_large,
        )
        yield CounterMetricFamily(
            "trioserve_idempotency_expirations",
            "Answers the Idempotency-Key store forgot at the end of their window "
            "(server.idempotency_window_s).",
            value=idem.expired,
        )


    @staticmethod
    def _flows(gw: Gateway) -> Iterator[Metric]:
        """Per (model, tenant, class): queue depth, admission outcomes, cost served,
        wait before dispatch; per model: the admission limit and service rate; per
        tenant: credits."""
        labels = ["model", "tenant", "class"]
        depth = GaugeMetricFamily(
            "trioserve_flow_queue_depth", "Requests queued, by tenant and class.", labels=labels
        )
        outcomes = CounterMetricFamily(
            "trioserve_flow_requests",
            "Requests by admission outcome (admitted, shed, expired, dispatched; shed: "
            "refused at admission, or pushed out of a full queue; pushed_out: the part "
            "of shed that had been admitted, pushed out of a full queue, never run; "
            "hedged: copies of hedged requests queued, counted apart from admitted; "
            "withdrawn: left by their caller while queued, never run; closed: failed "
            "while queued, never run, because the queue closed: shutdown, or no replica "
            "left to serve it; superseded: a hedged request or its copy withdrawn while "
            "queued, never run, because its twin answered first; gave_way: hedge copies "
            "that gave their room in a full queue to a new request, never run; "
            "expired_running: the part of dispatched answered DeadlineExceeded while "
            "its batch ran).",
            labels=[*labels, "outcome"],
        )
        cost = CounterMetricFamily(
            "trioserve_flow_served_cost",
            "Cost units (items or tokens) dispatched, by tenant and class.",
            labels=labels,
        )
        wait = SummaryMetricFamily(
            "trioserve_flow_wait_seconds",
            "Wait before dispatch, by tenant and class, from hdrhistograms.",
            labels=labels,
        )
        limit = GaugeMetricFamily(
            "trioserve_admission_limit",
            "Requests the model's queue admits now (the adaptive limit).",
            labels=["model"],
        )
        rate = GaugeMetricFamily(
            "trioserve_service_rate",
            "Measured service rate while backlogged (cost units per second).",
            labels=["model"],
        )
        config = gw.runtime.config
        # Every configured tenant and class has its series from the start (zeros, NaN
        # quantiles), so a flow that has seen nothing yet is there to alert on.
        configured = [(t.name, c.name) for t in config.tenants for c in config.classes]
        for name in sorted(gw.runtime.models):
            # A flow's figures over the model's lanes (a slow lane is a second queue;
            # a version with weights of its own has its own).
            flows: dict[tuple[str, str], list[tuple[Any, int]]] = {k: [] for k in configured}
            for lane in gw.runtime._lanes_of(name):
                lane_policy = lane.policy
                live = (
                    lane_policy.queued_by_flow() if hasattr(lane_policy, "queued_by_flow")
                    else {}
                )
                for flow, f in getattr(lane_policy, "stats", {}).items():
                    flows.setdefault(flow, []).append((f, live.get(flow, 0)))
            for (tenant, cls), parts in sorted(flows.items()):
                key = [name, tenant, cls]
                depth.add_metric(key, sum(n for _, n in parts))
                for outcome in (
                    "admitted", "shed", "expired", "dispatched", "hedged", "withdrawn",
                    "closed", "pushed_out", "superseded", "gave_way", "expired_running",
                ):
                    outcomes.add_metric(
                        [*key, outcome], sum(getattr(f, outcome) for f, _ in parts)
                    )
                cost.add_metric(key, sum(f.served_cost for f, _ in parts))
                count = total_us = 0
                for f, _ in parts:
                    n, us = f.wait.totals()
                    count += n
                    total_us += us
                # (the lanes' histograms together; each is folded by totals() above)
                values = values_at([f.wait.hist for f, _ in parts], (50, 99)) if parts else None
                for i, q in enumerate((0.5, 0.99)):
                    wait.add_sample(
                        "trioserve_flow_wait_seconds",
                        {"model": name, "tenant": tenant, "class": cls, "quantile": str(q)},
                        values[i] / 1e6 if values is not None else math.nan,
                    )
                wait.add_metric(key, count_value=count, sum_value=total_us / 1e6)
            mains = [g.scheduler.policy for g in gw.runtime._groups_of(name)]
            lims = [p.limit.value for p in mains if getattr(p, "limit", None) is not None]
            if lims:
                limit.add_metric([name], sum(lims))
            rate.add_metric([name], sum(getattr(p, "rate", 0.0) for p in mains))
        yield from (depth, outcomes, cost, wait, limit, rate)
        # Counters only rise: what was charged, and apart what was given back (for
        # requests that never ran); the net use is the first less the second.
        used = CounterMetricFamily(
            "trioserve_credits_used",
            "Cost units charged per tenant (refunds not subtracted).",
            labels=["tenant"],
        )
        refunded = CounterMetricFamily(
            "trioserve_credits_refunded",
            "Cost units given back per tenant, for requests that never ran.",
            labels=["tenant"],
        )
        avail = GaugeMetricFamily(
            "trioserve_credits_available",
            "Credits in the tenant's bucket now (tenants with a credit rate).",
            labels=["tenant"],
        )
        waits = CounterMetricFamily(
            "trioserve_credit_waits",
            "Requests (takes of credits) that waited for the tenant's bucket to refill "
            "before they were queued (classes with over_quota = wait).",
            labels=["tenant"],
        )
        waited = CounterMetricFamily(
            "trioserve_credit_wait_seconds",
            "Seconds requests waited for the tenant's bucket to refill, in all (a wait "
            "before the queue, not in trioserve_flow_wait_seconds).",
            labels=["tenant"],
        )
        for tenant, t in sorted(gw.runtime.tenant_statistics().items()):
            used.add_metric([tenant], t["credits_used"] + t["credits_refunded"])
            refunded.add_metric([tenant], t["credits_refunded"])
            if t["credits_available"] is not None:
                avail.add_metric([tenant], t["credits_available"])
                waits.add_metric([tenant], t["credit_waits"])
                waited.add_metric([tenant], t["credit_wait_seconds"])
        yield from (used, refunded, avail, waits, waited)
        cache = gw.runtime.cache_statistics()
        if cache:
            for key, kind, doc in (
                ("hits", "counter", "Result cache hits."),
                ("misses", "counter", "Result cache misses."),
                ("evictions", "counter", "Cached results evicted to make room."),
                ("admissions_rejected", "counter", "Results the cache declined to keep."),
                ("coalesced", "counter", "Requests that joined an identical one in flight."),
                ("reruns", "counter", "Computations in flight run again for joined requests "
                 "whose own deadline outlived the one that failed."),
                ("late_answers", "counter", "Joined requests answered by the batch still "
                 "running when the deadline of the request it ran for passed (instead of "
                 "a rerun): one per such batch answer."),
                ("bytes_used", "gauge", "Bytes the result cache holds."),
                ("entries", "gauge", "Results the cache holds."),
                ("hit_rate", "gauge", "Hits over lookups since start."),
            ):
                if key not in cache:
                    continue
                family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                yield family(f"trioserve_cache_{key}", doc, value=cache[key])
            if "expirations_by_model" in cache:
                yield from GatewayCollector._cache_removals(gw, cache)

    @staticmethod
    def _cache_removals(gw: Gateway, cache: dict) -> Iterator[Metric]:
        """Entries the result cache dropped other than to make room, by model: their
        TTL passed, or the model was invalidated. Every cached model has a sample
        (0 until it counts one)."""
        actor = gw.runtime.cache
        result_cache = actor.cache if actor is not None else None
        cached = [
            m for m in gw.runtime.models
            if result_cache is not None and result_cache.rule(m).enabled
        ]
        for key, doc in (
            ("expirations", "Cached results dropped because their TTL passed, by model."),
            ("invalidations", "Cached results dropped by an invalidation of their "
             "model (rt.invalidate_cache), by model."),
        ):
            counts = cache[f"{key}_by_model"]
            family = CounterMetricFamily(f"trioserve_cache_{key}", doc, labels=["model"])
            for model in sorted(set(cached) | set(counts)):
                family.add_metric([model], counts.get(model, 0))
            yield family


def metrics_registry(gateway: Gateway) -> CollectorRegistry:
    """A private registry holding only ``gateway``'s collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(gateway))
    return registry


OPENMETRICS = "application/openmetrics-text"
TEXT = "text/plain"


def exposition(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """``registry``'s samples and their content type, in the format the Accept field
    value ``accept`` prefers: OpenMetrics (``application/openmetrics-text``, ending in
    ``# EOF``) when it gives that a higher q-value than Prometheus's text format
    (``text/plain``), which is the default (no Accept, ``*/*``, a tie, or neither)."""
    if accept and _quality(accept, OPENMETRICS) > _quality(accept, TEXT):
        return openmetrics_latest(registry), OPENMETRICS_CONTENT_TYPE
    return generate_latest(registry), CONTENT_TYPE_LATEST


def _quality(accept: str, media_type: str) -> float:
    """The q-value that the Accept field value ``accept`` gives ``media_type``: that of
    its most specific range that matches it (``type/subtype``, then ``type/*``, then
    ``*/*``; RFC 9110 §12.5.1; the highest of several such, as Prometheus lists one
    per version), 0 when none does. A range with a malformed q-value is left out."""
    kind = media_type.partition("/")[0]
    best, quality = -1, 0.0
    for part in accept.split(","):
        media_range, *params = part.split(";")
        media_range = media_range.strip().lower()
        if media_range == media_type:
            rank = 2
        elif media_range == f"{kind}/*":
            rank = 1
        elif media_range == "*/*":
            rank = 0
        else:
            continue
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = math.nan
        if not 0.0 <= q <= 1.0:  # NaN too
            continue
        if rank > best or (rank == best and q > quality):
            best, quality = rank, q
    return quality
