"""Staging a batch into a worker's shared memory: the same layout as ``np.stack``."""

from __future__ import annotations

import re

import attrs
import numpy as np
import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import NoZygote, _StandIn, callable_model, config
from runtime_helpers import item as one_item
from trioserve import InvalidInput, ModelConfig, ModelError, RequestState, TenantConfig
from trioserve._builtin import mlp_backend
from trioserve._config import MAX_BATCH_SIZE
from trioserve._process import WorkerProcess, _stack_into


@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (1, 4, 2), (0, 3)])
@pytest.mark.parametrize("n", [1, 7])
def test_stacking_into_a_flat_buffer_matches_np_stack(shape, n):
    rng = np.random.default_rng(n)
    base = rng.standard_normal((n, *shape)).astype(np.float32)
    # rows of one array (views, as a request with a batch dimension gives); for 0-d
    # items, numpy scalars
    arrays = [base[i] for i in range(n)] if shape else [np.float32(v) for v in base]
    flat = np.empty(base.size, dtype=np.float32)
    _stack_into(flat, arrays, shape)
    np.testing.assert_array_equal(flat.reshape(base.shape), np.stack(arrays))


def test_items_that_are_not_contiguous_stack_as_np_stack_does():
    big = np.arange(4 * 6 * 2, dtype=np.float32).reshape(4, 6, 2)
    arrays = [big[i, ::2, :] for i in range(4)]  # strided views of shape (3, 2)
    arrays.append(np.asfortranarray(np.ones((3, 2), np.float32)))
    flat = np.empty(5 * 6, dtype=np.float32)
    _stack_into(flat, arrays, (3, 2))
    np.testing.assert_array_equal(flat.reshape(5, 3, 2), np.stack(arrays))


@pytest.mark.parametrize(
    "shapes",
    [
        [(2, 3), (1, 3), (3, 3)],  # as many rows as three (2, 3) items: concatenate alone
        [(2, 3), (3, 2)],  # would take the first; the second it refuses itself
    ],
)
def test_an_item_of_another_shape_is_refused(shapes):
    arrays = [np.ones(s, np.float32) for s in shapes]
    flat = np.empty(len(arrays) * 6, dtype=np.float32)
    assert sum(a.size for a in arrays) == flat.size  # the sizes add up
    with pytest.raises(ValueError, match="an item of shape"):
        _stack_into(flat, arrays, (2, 3))


def test_a_workers_shared_memory_is_bounded_whatever_the_batch_size():
    # The largest batch of the mlp (1 KiB of input an item) would want 128 MiB a slot.
    cfg = ModelConfig(name="m", backend="mlp", max_batch_size=MAX_BATCH_SIZE)
    worker = WorkerProcess(cfg, mlp_backend(), "cpu", 1)
    assert worker._shm_size == WorkerProcess.SLOTS * WorkerProcess.MAX_SLOT_BYTES
    small = WorkerProcess(attrs.evolve(cfg, max_batch_size=64), mlp_backend(), "cpu", 1)
    assert small._shm_size == WorkerProcess.SLOTS * (1 << 20)  # the least a slot takes


async def test_a_batch_larger_than_its_slot_goes_through_the_pipe(monkeypatch):
    monkeypatch.setattr(WorkerProcess, "MAX_SLOT_BYTES", 64)  # 16 floats
    layouts = []
    stack = WorkerProcess._stack

    def recorded(self, items, base):
        layouts.append(stack(self, items, base))
        return layouts[-1]

    monkeypatch.setattr(WorkerProcess, "_stack", recorded)
    cfg = config(ModelConfig(name="s", backend="sleep", execution="process", max_batch_size=8))
    items = [{"x": np.full(8, v, np.float32)} for v in range(8)]  # 256 bytes
    async with trioserve.open_runtime(cfg) as rt:
        outs = await rt.infer_batch("s", items)
    assert [o["y"].tolist() for o in outs] == [[float(v)] * 8 for v in range(8)]
    assert None in layouts  # not stacked into the slot: sent as items


async def test_items_of_other_inputs_or_dtypes_in_one_batch_come_back_as_they_were():
    """A batch was staged in shared memory by its first item's inputs: another item's
    extra input was dropped, and its arrays were cast to the first item's dtypes
    (echo in a worker process answered {"a": int64 [7, 8], "b": ...} with {"a":
    float32 [7., 8.]}). The worker's outputs were stacked the same way. Such a
    batch now travels as items, and each answer is its own input."""
    cfg = config(ModelConfig(name="e", backend="echo", execution="process", max_batch_size=8))
    items = [
        {"a": np.array([1.5, 2.5], np.float32)},
        {"a": np.array([7, 8], np.int64), "b": np.array([3.0], np.float32)},
        {"a": np.array([1.0, 2.0], np.float64)},
        {"a": np.array([4.5, 5.5], np.float32)},
    ]
    async with trioserve.open_runtime(cfg) as rt:
        outs = await rt.infer_batch("e", items)
    for item, out in zip(items, outs, strict=True):
        assert sorted(out) == sorted(item)
        for name, arr in item.items():
            assert out[name].dtype == arr.dtype
            assert out[name].tolist() == arr.tolist()


@pytest.mark.parametrize("way", ["inputs", "outputs"])
async def test_a_batch_past_a_workers_message_limit_is_split_and_a_lone_one_refused(
    monkeypatch, way
):
    """One message to or from a worker carries at most 4 GiB (its length is 4 bytes).
    A batch whose pickled inputs were longer raised struct.error out of the batcher
    (the actor crashed, its requests failed with ActorBroken, and every such request
    spent a restart); outputs as long failed in the worker with the same struct.error,
    told as the model's. Now such a batch runs again in halves, and a request that
    does not fit alone is answered so; the worker goes on. One whose outputs do not
    fit ran: a ModelError, charged. One whose inputs do not fit was never sent: the
    caller's InvalidInput (a 400 over HTTP), not charged; it used to be a ModelError
    ("failed on cpu", a 500), charged, and counted as the model's error. (The limit
    is lowered here: the worker gets it from the parent at its start.)"""
    monkeypatch.setattr(WorkerProcess, "MAX_FRAME_BYTES", 3000)
    if way == "inputs":
        monkeypatch.setattr(WorkerProcess, "MAX_SLOT_BYTES", 64)  # sent as items
    cfg = config(ModelConfig(name="s", backend="sleep", execution="process", max_batch_size=8))
    items = [{"x": np.full(200, v, np.float32)} for v in range(8)]  # ~6.4 KB in all
    async with trioserve.open_runtime(cfg) as rt:
        outs = await rt.infer_batch("s", items)
        assert [o["y"].tolist() for o in outs] == [[float(v)] * 200 for v in range(8)]
        assert rt.statistics()["s"]["statuses"]["retried"] >= 8  # split, not failed
        before = rt.tenant_statistics()["t"]
        with pytest.raises(ModelError if way == "outputs" else InvalidInput) as caught:
            await rt.infer("s", {"x": np.zeros(1000, np.float32)})  # 4 KB alone
        after = rt.tenant_statistics()["t"]
        assert re.fullmatch(
            (r"model 's' failed on cpu: " if way == "outputs" else r"model 's': ")
            # (a request alone: its inputs or outputs, not its batch's, which it
            # used to say)
            + rf"its {way}"
            + r" are \d+ bytes in one message "
            r"(to|from) its worker process, more than the 3000 bytes a message carries; "
            r'send a smaller request, or use execution = "thread"',
            str(caught.value),
        )
        assert after["credits_used"] - before["credits_used"] == (
            1 if way == "outputs" else 0  # it ran; never sent: refunded
        )
        assert rt.statistics()["s"]["statuses"].get("model_error", 0) == (way == "outputs")
        assert rt.statistics()["s"]["statuses"].get("invalid_input", 0) == (way == "inputs")
        batcher = rt.models["s"].batchers[0]
        assert (batcher.restarts, batcher.workers_lost) == (0, 0)
        assert (await rt.infer("s", items[3]))["y"].tolist() == [3.0] * 200


class _PipeCarriesOne(_StandIn):
    """A worker process in trio time whose pipe carries one request's inputs and
    outputs, not two: a batch of two is refused, not sent (``way`` "inputs":
    FrameTooLarge from its submit), or ran and its outputs cannot come back
    ("outputs": FrameTooLarge as its result). Its sending ("inputs") or its result
    ("outputs") waits for ``go``; a batch of one is echoed."""

    TooLarge = WorkerProcess.TooLarge
    way: str
    go: trio.Event

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        self.pid = None
        self.busy_seconds = self.last_run_seconds = 0.0
        self._exited = trio.Event()
        self._sent: list[list] = []

    async def submit(self, items) -> None:
        if self.way == "inputs":
            await self.go.wait()
            if len(items) > 1:
                raise self.TooLarge("its batch's inputs are more bytes than a message carries")
        else:
            await trio.lowlevel.checkpoint()
        self._sent.append(items)

    async def result(self):
        if self.way == "outputs":
            await self.go.wait()
        else:
            await trio.lowlevel.checkpoint()
        items = self._sent.pop(0)
        if len(items) > 1:
            raise self.TooLarge("its batch's outputs are more bytes than a message carries")
        return [{"y": it["x"]} for it in items]


@pytest.mark.parametrize("way", ["inputs", "outputs"])
async def test_the_one_request_left_of_a_batch_past_the_limit_runs_alone(
    autojump_clock, manual_watchdog, monkeypatch, way
):
    """A batch of two does not fit in one message to (or from) its worker, and one
    of its callers left as it was sent (or ran): the one request left runs again
    alone, which fits, and gets its answer. It used to be refused for the whole
    batch's size (InvalidInput for its inputs, ModelError for its outputs), though
    its own fit. The one that left never ran (inputs: refunded, once) or ran
    (outputs: charged)."""
    import trioserve._runtime
    import trioserve.actors._batcher

    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", _PipeCarriesOne)
    monkeypatch.setattr(_PipeCarriesOne, "way", way, raising=False)
    monkeypatch.setattr(_PipeCarriesOne, "go", trio.Event(), raising=False)
    # the batch closes at its two requests (never at its wait)
    cfg = trioserve.Config(
        models=(callable_model(
            "m", lambda items: items, execution="process", max_batch_size=2,
            max_wait_ms=10_000, timeout_ms=None, adaptive_limit=False,
        ),),
        tenants=(TenantConfig(name="a", default=True, credit_rate=1.0, credit_burst=10.0),),
    )
    scope = trio.CancelScope()
    ended: dict[float, object] = {}

    async def caller(rt, value: float, scope: trio.CancelScope) -> None:
        with scope:
            try:
                ended[value] = (await rt.infer("m", one_item(value)))["y"].tolist()
            except trioserve.TrioserveError as exc:
                ended[value] = exc

    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        nursery.start_soon(caller, rt, 1.0, trio.CancelScope())
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(caller, rt, 2.0, scope)
        await trio.testing.wait_all_tasks_blocked()
        batcher = rt.models["m"].batchers[0]
        ((first, second),) = batcher._in_flight
        assert [r.item["x"][0] for r in (first, second)] == [1.0, 2.0]
        scope.cancel("the caller left")
        await trio.testing.wait_all_tasks_blocked()
        assert second.reply.state is RequestState.ABANDONED
        _PipeCarriesOne.go.set()
        await trio.testing.wait_all_tasks_blocked()
        assert ended == {1.0: [1.0]}  # alone, it fit
        statuses = rt.statistics()["m"]["statuses"]
        assert statuses["retried"] == 1
        assert statuses.get("model_error", 0) == 0
        assert (batcher.restarts, batcher.workers_lost) == (0, 0)
        tenant = rt.tenant_statistics()["a"]
        assert (tenant["credits_used"], tenant["credits_refunded"]) == (
            (1, 1) if way == "inputs" else (2, 0)  # never sent: refunded; it ran: charged
        )


class _NeverFits(_StandIn):
    """A worker process in trio time whose pipe carries no request's inputs: every
    batch is refused before it is sent (FrameTooLarge from its submit)."""

    TooLarge = WorkerProcess.TooLarge

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        self.pid = None
        self.busy_seconds = self.last_run_seconds = 0.0
        self._exited = trio.Event()

    async def submit(self, items) -> None:
        await trio.lowlevel.checkpoint()
        raise self.TooLarge("its inputs are 4096 bytes in one message to its worker process")


async def test_a_request_refused_for_the_pipe_is_counted_as_invalid_input(
    autojump_clock, manual_watchdog, monkeypatch
):
    """A request whose inputs its worker's pipe cannot carry is answered 400
    (InvalidInput) and counted so: by the gateway's HTTP statuses, and as the
    model's ``invalid_input`` outcome (``statistics()``, /metrics), not its
    ``model_error``. It used to be counted in no outcome of the model's, unlike
    every other answer a replica gives."""
    import orjson
    import trioserve._runtime
    import trioserve.actors._batcher
    from http_helpers import v2_input
    from prometheus_client.parser import text_string_to_metric_families
    from trioserve.transport import Gateway

    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", _NeverFits)
    cfg = config(callable_model(
        "m", lambda items: items, execution="process", max_batch_size=1, max_wait_ms=0,
        timeout_ms=None,
    ))
    async with trioserve.open_runtime(cfg) as rt:
        client = Gateway(rt).app.test_client()
        res = await client.post(
            "/v2/models/m/infer", data=orjson.dumps({"inputs": [v2_input([[2.0]])]})
        )
        assert res.status_code == 400
        assert "its inputs are 4096 bytes" in (await res.get_data(as_text=True))
        assert rt.statistics()["m"]["statuses"] == {"invalid_input": 1}
        scraped = await (await client.get("/metrics")).get_data(as_text=True)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(scraped) for s in family.samples
    }
    outcome = "trioserve_batcher_outcomes_total"
    assert samples[outcome, (("model", "m"), ("outcome", "invalid_input"))] == 1
    assert samples[outcome, (("model", "m"), ("outcome", "model_error"))] == 0
    statuses = {
        labels: n for (name, labels), n in samples.items()
        if name == "trioserve_requests_total" and n
    }
    assert statuses == {(("model", "m"), ("status", "400"), ("tenant", "t")): 1}
