"""Edges of the fault handling (docs/faults.md): a replica whose device is lost
(thread, inline, a slow lane's), the queue retired when every replica of it is lost,
and what callers, credits, statistics and readiness say meanwhile."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import (
    DEVICE_LOST,
    GATE_LIMIT_S,
    LosesItsDevice,
    X,
    Y,
    config,
    item,
)
from trioserve import ModelConfig, ModelError


class GatedLoss(trioserve.ModelBackend):
    """Thread replicas whose device a negative input leaves unusable (``device_lost``
    says so for it, through ``lose_devices``), once ``gate`` is set: until then that
    batch holds its replica (``started`` is set when it begins). Otherwise
    ``y = x``."""

    inputs = (X,)
    outputs = (Y,)
    default_execution = "thread"

    def __init__(self, lost: set[str]) -> None:
        self.lost = lost
        self.gate = threading.Event()
        self.started = threading.Event()

    def load(self, device, *, torch_threads=1):
        def run(items):
            if device in self.lost:
                raise RuntimeError(DEVICE_LOST)
            if any(it["x"][0] < 0 for it in items):
                self.started.set()
                if not self.gate.wait(GATE_LIMIT_S):
                    raise RuntimeError("gate never opened")
                self.lost.add(device)
                raise RuntimeError(DEVICE_LOST)
            return [{"y": it["x"].copy()} for it in items]

        return run


async def test_requests_failed_unrun_by_a_retired_queue_are_refunded(mock_clock, lose_devices):
    """The only replica loses its device while requests wait in its queue: they get
    the retired queue's error at once and, never having run, are refunded, as a
    request refused by the retired queue is (and one pushed out or expired queued).
    Before, they were charged."""
    backend = GatedLoss(lose_devices)
    cfg = config(ModelConfig(name="m", backend=backend, devices=("cpu:0",),
                             max_batch_size=1, max_wait_ms=0))
    errors: list[str] = []
    async with trioserve.open_runtime(cfg) as rt:

        async def call(*values: float) -> None:
            try:
                if len(values) == 1:
                    await rt.infer("m", item(values[0]))
                else:
                    await rt.infer_batch("m", [item(v) for v in values])
            except ModelError as exc:
                errors.append(str(exc))

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, -1.0)
                await trio.to_thread.run_sync(backend.started.wait, GATE_LIMIT_S)
                nursery.start_soon(call, 1.0)
                nursery.start_soon(call, 2.0, 3.0)
                await trio.testing.wait_all_tasks_blocked()
                backend.gate.set()
        finally:
            backend.gate.set()
        assert len(errors) == 3
        assert sum("failed on cpu:0 and left it unusable" in e for e in errors) == 1
        assert sum("no replica can serve it any more" in e for e in errors) == 2
        assert not rt.model_ready("m")
        await call(4.0)  # refused by the retired queue
        assert len(errors) == 4
        assert "no replica can serve it any more" in errors[-1]
        credits = rt.tenant_statistics()["t"]
        assert credits["credits_used"] == 1  # the request that ran
        assert credits["credits_refunded"] == 4


class Loses(LosesItsDevice):
    """:class:`LosesItsDevice` whose item costs its length (for the slow lane)."""

    def prepare(self, name, inputs):
        it, _ = super().prepare(name, inputs)
        return it, int(it["x"].shape[0])


async def test_a_slow_lane_whose_replicas_are_lost_is_retired_alone(mock_clock, lose_devices):
    """The slow lane's only replica loses its device on a batch of two long inputs:
    both get the error (counted once in device_lost, twice in model_error, not
    retried); the slow lane's queue is retired (a long request, or a call with a long
    item, refused at once, refunded), the fast lane serves on, and the model stays
    ready (its fast lane can serve). The refusal names the lane: it used to say that
    no replica could serve the model any more, while its fast lane still did."""
    cfg = config(ModelConfig(name="m", backend=Loses(lose_devices, "thread"),
                             devices=("cpu:0", "cpu:1"), max_batch_size=4, max_wait_ms=0,
                             slow_lane_cost=4))
    async with trioserve.open_runtime(cfg) as rt:
        served = rt.models["m"]
        fast, slow = served.batchers
        with pytest.raises(ModelError, match="left it unusable"):
            await rt.infer_batch("m", [item(-1.0, 4), item(5.0, 4)])
        assert lose_devices == {slow.device}
        assert (slow.health, fast.health) == ("lost", "ready")
        statuses = rt.statistics()["m"]["statuses"]
        assert (statuses["device_lost"], statuses["model_error"]) == (1, 2)
        assert not statuses.get("retried")
        start = trio.current_time()
        lane = r"no replica can serve its slow lane \(requests of cost 4 or more\) any more"
        with pytest.raises(ModelError, match=lane) as info:
            await rt.infer("m", item(2.0, 4))
        assert "its other requests are still served" in str(info.value)
        assert "serve it any more" not in str(info.value)
        with pytest.raises(ModelError, match=lane):
            await rt.infer_batch("m", [item(1.0), item(2.0, 4)])
        assert trio.current_time() == start
        assert (await rt.infer("m", item(3.0)))["y"][0] == 3.0
        assert rt.model_ready("m")
        assert rt.health()["m"]["replicas"][slow.name] == "lost"
        credits = rt.tenant_statistics()["t"]
        assert credits["credits_used"] == 8 + 1  # the lost batch, the short request
        assert credits["credits_refunded"] == 4 + 5


async def test_a_fast_lane_whose_replicas_are_lost_leaves_the_model_to_its_slow_lane(
    mock_clock, lose_devices
):
    """The fast lane's only replica loses its device: its queue is retired, and short
    requests are refused at once with an error naming the fast lane (not the whole
    model); the slow lane serves on, so the model is ready (also over HTTP). Once the
    slow lane's replica is lost too, the model is not ready, and both lanes refuse
    with the model's error: the fast lane's refusal is replaced by it."""
    from trioserve.transport import Gateway

    cfg = config(ModelConfig(name="m", backend=Loses(lose_devices, "thread"),
                             devices=("cpu:0", "cpu:1"), max_batch_size=4, max_wait_ms=0,
                             slow_lane_cost=4))
    async with trioserve.open_runtime(cfg) as rt:
        client = Gateway(rt).app.test_client()
        fast, slow = rt.models["m"].batchers

        async def ready() -> tuple[bool, int, int]:
            model = await client.get("/v2/models/m/ready")
            server = await client.get("/v2/health/ready")
            return rt.model_ready("m"), model.status_code, server.status_code

        with pytest.raises(ModelError, match="left it unusable"):
            await rt.infer("m", item(-1.0))
        assert (fast.health, slow.health) == ("lost", "ready")
        assert await ready() == (True, 200, 200)
        assert rt.statistics()["m"]["ready"]
        lane = r"no replica can serve its fast lane \(requests of cost below 4\) any more"
        with pytest.raises(ModelError, match=lane) as info:
            await rt.infer("m", item(1.0))
        assert "its other requests are still served" in str(info.value)
        assert "serve it any more" not in str(info.value)
        assert (await rt.infer("m", item(2.0, 4)))["y"][0] == 2.0  # the slow lane serves

        with pytest.raises(ModelError, match="left it unusable"):
            await rt.infer("m", item(-1.0, 4))
        assert (fast.health, slow.health) == ("lost", "lost")
        assert await ready() == (False, 503, 503)
        for request in (item(1.0), item(2.0, 4)):  # either lane: the model's error
            with pytest.raises(ModelError, match="no replica can serve it any more"):
                await rt.infer("m", request)


async def test_readiness_over_http_follows_the_replicas_that_lost_their_device(
    autojump_clock, lose_devices
):
    """``/v2/models/m/ready`` and ``/v2/health/ready``: ready while one of two inline
    replicas has its device, 503 once both lost theirs (and requests are refused)."""
    from trioserve.transport import Gateway

    cfg = config(ModelConfig(name="m", backend=Loses(lose_devices, "inline"),
                             devices=("cpu:0", "cpu:1"), max_batch_size=1, max_wait_ms=0))
    async with trioserve.open_runtime(cfg) as rt:
        client = Gateway(rt).app.test_client()

        async def statuses() -> tuple[int, int]:
            model = await client.get("/v2/models/m/ready")
            server = await client.get("/v2/health/ready")
            return model.status_code, server.status_code

        assert await statuses() == (200, 200)
        with pytest.raises(ModelError, match="left it unusable"):
            await rt.infer("m", item(-1.0))
        assert len(lose_devices) == 1
        assert await statuses() == (200, 200)
        with pytest.raises(ModelError, match="left it unusable"):
            await rt.infer("m", item(-2.0))
        assert len(lose_devices) == 2
        assert await statuses() == (503, 503)
        with pytest.raises(ModelError, match="no replica can serve it any more"):
            await rt.infer("m", item(1.0))


def test_device_lost_is_false_at_once_for_a_device_that_is_not_cuda(monkeypatch):
    """``device_lost`` after every model raise: on a CPU (or any non-CUDA) device it
    is False without touching torch, and so on CUDA in a process that never used it."""
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # any use of torch would raise
    for device in ("cpu", "cpu:0", "sleep:1", "mps"):
        assert trioserve.device_lost(device) is False
    assert trioserve.device_lost("cuda:0") is False  # torch never imported here


# ---------------------------------------------------------------- flows of a closed queue


def _two_tenants(model: ModelConfig) -> trioserve.Config:
    return trioserve.Config(
        models=(model,),
        tenants=(trioserve.TenantConfig(name="a", default=True), trioserve.TenantConfig(name="b")),
    )


async def _submit(rt, tenant: str, values) -> None:
    """One request of ``values[0]`` (``infer``), or a call of one item per value."""
    if len(values) == 1:
        await rt.infer("m", item(values[0]), tenant=tenant)
    else:
        await rt.infer_batch("m", [item(v) for v in values], tenant=tenant)


def _assert_balanced(flows: dict) -> None:
    """Each admitted request of a flow (none hedged here) is queued or counted once
    more: dispatched, expired, withdrawn, closed or pushed out."""
    for name, f in flows.items():
        accounted = (
            f["dispatched"] + f["expired"] + f["withdrawn"] + f["closed"] + f["pushed_out"]
            + f["queued"]
        )
        assert f["admitted"] == accounted, (name, f)


class HeldThenLost(GatedLoss):
    """``GatedLoss`` whose held batches each release ``held`` once they began, so
    that a test can wait for every replica to hold one."""

    def __init__(self, lost: set[str]) -> None:
        super().__init__(lost)
        self.held = threading.Semaphore(0)

    def load(self, device, *, torch_threads=1):
        run = super().load(device, torch_threads=torch_threads)

        def held_run(items):
            if any(it["x"][0] < 0 for it in items):
                self.held.release()
            return run(items)

        return held_run


async def test_requests_failed_queued_by_a_retired_queue_count_as_closed(
    mock_clock, lose_devices
):
    """Both replicas hold a batch that then leaves their device unusable, while two
    tenants' requests wait in the queue; the queue is retired and fails them unrun.
    They used to stay counted in their flow's ``admitted`` and in nothing else, so
    the flow's counts no longer added up; now they count in ``closed`` (statistics
    and /metrics), and ``admitted`` = dispatched + expired + withdrawn + closed +
    queued for every flow. A request the retired queue refuses is never admitted."""
    from trioserve.transport import Gateway

    backend = HeldThenLost(lose_devices)
    cfg = _two_tenants(ModelConfig(name="m", backend=backend, devices=("cpu:0", "cpu:1"),
                                   max_batch_size=1, max_wait_ms=0))
    errors: list[str] = []
    async with trioserve.open_runtime(cfg) as rt:

        async def call(tenant: str, *values: float) -> None:
            with pytest.raises(ModelError) as info:
                await _submit(rt, tenant, values)
            errors.append(str(info.value))

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, "a", -1.0)
                nursery.start_soon(call, "a", -2.0)
                for _ in range(2):
                    assert await trio.to_thread.run_sync(
                        backend.held.acquire, True, GATE_LIMIT_S
                    )
                for v in (1.0, 2.0, 3.0):
                    nursery.start_soon(call, "a", v)
                nursery.start_soon(call, "a", 4.0, 5.0)
                for v in (6.0, 7.0):
                    nursery.start_soon(call, "b", v)
                nursery.start_soon(call, "b", 8.0, 9.0)
                await trio.testing.wait_all_tasks_blocked()
                assert rt.statistics()["m"]["queue_depth"] == 9
                backend.gate.set()
        finally:
            backend.gate.set()
        assert len(errors) == 2 + 7  # the two held batches, the seven calls queued
        assert sum("left it unusable" in e for e in errors) == 2
        assert sum("no replica can serve it any more" in e for e in errors) == 7
        assert not rt.model_ready("m")
        with pytest.raises(ModelError, match="no replica can serve it any more"):
            await rt.infer("m", item(10.0), tenant="b")  # refused: never admitted
        flows = rt.statistics()["m"]["flows"]
        a, b = flows["a/realtime"], flows["b/realtime"]
        assert (a["admitted"], a["dispatched"], a["closed"], a["shed"]) == (7, 2, 5, 0)
        assert (b["admitted"], b["dispatched"], b["closed"], b["shed"]) == (4, 0, 4, 0)
        _assert_balanced(flows)
        res = await Gateway(rt).app.test_client().get("/metrics")
        text = await res.get_data(as_text=True)
        for tenant, n in (("a", 5), ("b", 4)):
            line = (
                'trioserve_flow_requests_total{class="realtime",model="m",'
                f'outcome="closed",tenant="{tenant}"}} {n}.0'
            )
            assert line in text, line


async def test_requests_failed_queued_at_shutdown_count_as_closed(mock_clock):
    """The runtime shuts down (no grace) while two tenants' requests wait for their
    batch to close: each gets ActorClosed, unrun, and counts in its flow's
    ``closed``, so the flows still add up."""
    model = ModelConfig(name="m", backend=Loses(set(), "inline"), devices=("cpu:0",),
                        max_batch_size=4, max_wait_ms=1000)
    closed: list[trioserve.ActorClosed] = []

    async def call(rt, tenant: str, n: int) -> None:
        with pytest.raises(trioserve.ActorClosed) as info:
            await _submit(rt, tenant, [1.0] * n)
        closed.append(info.value)

    async with trio.open_nursery() as nursery:
        async with trioserve.open_runtime(_two_tenants(model)) as rt:
            results = await rt.infer_batch("m", [item(v) for v in (1.0, 2.0, 3.0, 4.0)])
            assert len(results) == 4  # a full batch: run at once
            nursery.start_soon(call, rt, "a", 1)
            nursery.start_soon(call, rt, "b", 2)
            await trio.testing.wait_all_tasks_blocked()
            assert rt.statistics()["m"]["queue_depth"] == 3  # the clock stands still
            rt.grace_deadline = trio.current_time()
    assert len(closed) == 2
    assert all(e.in_queue for e in closed)  # never ran: refunded
    flows = rt.statistics()["m"]["flows"]
    a, b = flows["a/realtime"], flows["b/realtime"]
    assert (a["admitted"], a["dispatched"], a["closed"], a["queued"]) == (5, 4, 1, 0)
    assert (b["admitted"], b["dispatched"], b["closed"], b["queued"]) == (2, 0, 2, 0)
    _assert_balanced(flows)
