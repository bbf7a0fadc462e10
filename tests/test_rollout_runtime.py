"""A model's rollout in a running runtime: the canary's split, its steps and
promotion, rollback on errors and on latency, the shadow, statistics, metrics and
shutdown (docs/rollout.md)."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import GATE_LIMIT_S, X, Y, config
from trioserve import CallableBackend, ModelConfig, ModelError


def adder(k: float, *, fail_if=None, slow_s: float = 0.0, gate=None, execution="inline"):
    """A backend computing ``y = x + k``: ``fail_if(x0)`` makes a batch holding such
    an item raise; ``slow_s`` moves the (mock) clock on by that much per batch;
    ``gate`` (a threading.Event, thread execution) holds each batch until set."""

    def run(items):
        if gate is not None:
            gate.wait(GATE_LIMIT_S)
        if slow_s:
            trio.lowlevel.current_clock().jump(slow_s)
        if fail_if is not None and any(fail_if(float(it["x"][0])) for it in items):
            raise ValueError("bad input for this version")
        return [{"y": it["x"] + np.float32(k)} for it in items]

    return CallableBackend(run, inputs=[X], outputs=[Y], execution=execution)


def model(rollout: dict, *, canary=None, shadow=None, **cfg) -> ModelConfig:
    """Model ``m``: version 1 (+1, the model's backend), 2 (+2, ``canary``) and 3
    (+3, ``shadow``)."""
    cfg.setdefault("max_wait_ms", 0.0)
    return ModelConfig(
        name="m", backend=adder(1),
        versions={"1": {}, "2": {"backend": canary or adder(2)},
                  "3": {"backend": shadow or adder(3)}},
        rollout=rollout, **cfg,
    )


def one(v: float) -> dict[str, np.ndarray]:
    return {"x": np.asarray([v], np.float32)}


def version_of(out, x: float) -> str:
    return str(round(float(out["y"][0]) - x))


async def test_the_split_follows_the_share_exactly(autojump_clock):
    m = model({"stable": "1", "canary": "2", "steps": [0.25], "min_requests": 10_000})
    async with trioserve.open_runtime(config(m)) as rt:
        seen = [version_of(await rt.infer("m", one(i)), i) for i in range(100)]
        batch = await rt.infer_batch("m", [one(i) for i in range(8)])
        stats = rt.statistics()["m"]["rollout"]
    assert seen.count("2") == 25
    assert seen[:8] == ["1", "1", "1", "2", "1", "1", "1", "2"]  # smooth, not random
    # an item of a batch call is routed as a whole request: requests 101 to 108
    assert [version_of(o, i) for i, o in enumerate(batch)] == ["1", "1", "1", "2"] * 2
    assert stats["state"] == "canary"
    assert (stats["counts"]["2"]["ok"], stats["counts"]["2"]["errors"]) == (27, 0)
    assert (stats["counts"]["1"]["ok"], stats["counts"]["1"]["errors"]) == (81, 0)


async def test_a_good_canary_steps_through_every_share_and_is_promoted(autojump_clock):
    m = model({"stable": "1", "canary": "2", "steps": [0.2, 0.5], "step_s": 10,
               "min_requests": 5})
    async with trioserve.open_runtime(config(m)) as rt:
        shares = []
        for i in range(200):
            await rt.infer("m", one(i))
            stats = rt.statistics()["m"]["rollout"]
            if not shares or shares[-1] != stats["share"]:
                shares.append(stats["share"])
            if stats["state"] == "promoted":
                break
            await trio.sleep(0.5)
        after = [version_of(await rt.infer("m", one(i)), i) for i in range(10)]
        pinned = await rt.infer("m", one(0), version="1")
    assert shares == [0.2, 0.5, 1.0]
    assert stats["events"] == {"step": 1, "promoted": 1, "rolled_back": 0,
                               "paused": 0, "resumed": 0, "started": 0}
    assert stats["reason"] is None
    assert after == ["2"] * 10  # the canary takes every unversioned request
    assert version_of(pinned, 0) == "1"  # a version asked for is still served


async def test_a_canary_failing_on_some_inputs_is_rolled_back_and_nothing_is_lost(
    autojump_clock,
):
    bad = adder(2, fail_if=lambda x: x % 10 == 7)  # one input in ten fails on it
    m = model({"stable": "1", "canary": "2", "steps": [0.5], "step_s": 1000,
               "min_requests": 20, "max_error_rate": 0.05}, canary=bad, max_batch_size=1)
    answers: dict[int, object] = {}

    async def call(rt, i: int) -> None:
        try:
            answers[i] = version_of(await rt.infer("m", one(i)), i)
        except ModelError as exc:
            answers[i] = exc

    async with trioserve.open_runtime(config(m)) as rt:
        async with trio.open_nursery() as nursery:
            for i in range(400):
                nursery.start_soon(call, rt, i)
                await trio.sleep(0.01)
        stats = rt.statistics()["m"]["rollout"]
        later = [version_of(await rt.infer("m", one(i)), i) for i in range(10)]
    assert len(answers) == 400  # every caller got its result or its error
    errors = [i for i, a in answers.items() if isinstance(a, ModelError)]
    assert errors
    assert all(i % 10 == 7 for i in errors)
    assert stats["state"] == "rolled_back"
    assert stats["share"] == 0.0
    assert stats["reason"].startswith("error rate: ")
    # within the step, once its errors were certain to pass 5% of 20 answers
    assert stats["counts"]["2"]["ok"] + stats["counts"]["2"]["errors"] <= 20
    assert stats["events"] == {"step": 0, "promoted": 0, "rolled_back": 1,
                               "paused": 0, "resumed": 0, "started": 0}
    assert later == ["1"] * 10


async def test_a_slower_canary_is_rolled_back_on_latency(autojump_clock):
    slow = adder(2, slow_s=0.05)
    m = model({"stable": "1", "canary": "2", "steps": [0.5], "step_s": 1000,
               "min_requests": 10, "max_latency_ratio": 1.5}, canary=slow)
    fast = adder(1, slow_s=0.01)
    m = ModelConfig(**{**{a.name: getattr(m, a.name) for a in m.__attrs_attrs__},
                       "backend": fast})
    async with trioserve.open_runtime(config(m)) as rt:
        for i in range(60):
            await rt.infer("m", one(i))
            if rt.statistics()["m"]["rollout"]["state"] != "canary":
                break
        stats = rt.statistics()["m"]["rollout"]
    assert stats["state"] == "rolled_back"
    assert stats["reason"].startswith("latency: the canary's p99 50")
    assert i == 19  # at the 20th request both versions had their 10 answers


async def test_a_hung_canary_is_rolled_back_once_its_requests_are_late(autojump_clock):
    """The canary's model hangs (its first batch never returns within the test):
    the requests queued behind it pass their deadline in the queue. Each is late,
    no error (a client's timeout may be too short), but the stable is not late: once
    the stable has min_requests outcomes, two late requests of the canary's are sure
    to put its late share past the stable's at min_requests, and it is rolled back,
    long before its batch's cut-off: few callers see a failure."""
    gate = threading.Event()  # set once every request was sent
    hung = adder(2, gate=gate, execution="thread")
    m = model({"stable": "1", "canary": "2", "steps": [0.25], "step_s": 1000,
               "min_requests": 20, "max_error_rate": 0.05}, canary=hung,
              timeout_ms=200.0, batch_timeout_floor_ms=60_000.0)
    failed: list[tuple[int, trioserve.TrioserveError]] = []
    answered: list[int] = []

    async def call(rt, i: int) -> None:
        try:
            await rt.infer("m", one(i))
        except trioserve.TrioserveError as exc:
            failed.append((i, exc))
        else:
            answered.append(i)

    try:
        async with trioserve.open_runtime(config(m)) as rt:
            t0 = trio.current_time()
            async with trio.open_nursery() as nursery:
                for i in range(200):
                    nursery.start_soon(call, rt, i)
                    await trio.sleep(0.01)
                stats = rt.statistics()["m"]["rollout"]
                took = trio.current_time() - t0
                # The hung batch may end now. Its request's fate turns on the batch's
                # wall-clock cut-off and its retry, not on the rollout: left out below.
                gate.set()
    finally:
        gate.set()
    assert stats["state"] == "rolled_back"
    assert stats["reason"] == (
        "late: 2 of the canary's 2 requests (100.00%) passed their deadline in its "
        "queue, 0 of the stable's 24 (0.00%): more by over max_error_rate 0.05 (at "
        "least 20 of each, sure to be over at 20 whatever its next ones)"
    )
    assert stats["counts"]["2"] == {**stats["counts"]["2"], "ok": 0, "late": 2}
    assert stats["counts"]["1"]["late"] == 0
    assert took < 60.0  # within the batch's cut-off: the late shares caught it
    # Only the canary's requests failed, every fourth (its share 0.25): the two late
    # ones (the second, request 11, passed its deadline 0.2 s after it came, at
    # 0.31 s, the stable having 24 answers by then), and those routed to it within
    # that deadline before, still queued (15 to 27), besides the one its hung batch
    # holds (3): not the ~1500 callers of the minute until the batch is cut off.
    late = sorted(i for i, exc in failed if i != 3)
    assert late == [7, 11, 15, 19, 23, 27]
    assert all(isinstance(exc, trioserve.DeadlineExceeded) and exc.in_queue
               for i, exc in failed if i != 3)
    assert len(failed) + len(answered) == 200


async def test_shutdown_mid_step_is_clean(autojump_clock):
    m = model({"stable": "1", "canary": "2", "steps": [0.5], "step_s": 10,
               "min_requests": 5}, shadow=adder(3))
    m = ModelConfig(**{**{a.name: getattr(m, a.name) for a in m.__attrs_attrs__},
                       "rollout": {**{"stable": "1", "canary": "2", "steps": [0.5],
                                      "step_s": 10, "min_requests": 5}, "shadow": "3"}})
    async with trioserve.open_runtime(config(m)) as rt:
        for i in range(6):
            await rt.infer("m", one(i))
        before = rt.statistics()["m"]["rollout"]
    after = rt.statistics()["m"]["rollout"]
    assert before["state"] == after["state"] == "canary"  # closed mid-step, as it was
    assert after["events"] == {"step": 0, "promoted": 0, "rolled_back": 0,
                                "paused": 0, "resumed": 0, "started": 0}
    with pytest.raises(trioserve.ActorClosed):
        await rt.infer("m", one(0))


def shadowed(shadow_backend, **rollout) -> ModelConfig:
    return ModelConfig(
        name="m", backend=adder(1), max_wait_ms=0.0, max_batch_size=1,
        versions={"1": {}, "3": {"backend": shadow_backend}},
        rollout={"stable": "1", "shadow": "3", **rollout},
    )


async def test_the_shadow_never_changes_the_callers_answer_nor_delays_it():
    # the shadow answers otherwise (+3), and is held until every caller has its answer:
    # a caller that waited for its copy would never return
    gate = threading.Event()
    m = shadowed(adder(3, gate=gate, execution="thread"), shadow_share=0.5)
    try:
        async with trioserve.open_runtime(config(m)) as rt:
            controller = rt._families["m"].controller
            answers = [version_of(await rt.infer("m", one(i)), i) for i in range(10)]
            held = dict(controller.shadow_results)
            gate.set()
            await controller.wait_shadow_results(5)
            stats = rt.statistics()["m"]
    finally:
        gate.set()
    assert answers == ["1"] * 10
    assert held == {}
    assert stats["rollout"]["state"] == "stable"
    assert stats["rollout"]["shadow"] == {"version": "3", "match": 0, "mismatch": 5,
                                          "error": 0, "dropped": 0}
    assert stats["end_to_end"].count == 10  # the copies are not the model's requests


async def test_the_shadows_matches_and_errors_are_counted(autojump_clock):
    m = shadowed(adder(1, fail_if=lambda x: x >= 8))  # stable's weights, failing on some
    async with trioserve.open_runtime(config(m)) as rt:
        for i in range(10):
            await rt.infer("m", one(i))
        await rt._families["m"].controller.wait_shadow_results(10)
        stats = rt.statistics()["m"]["rollout"]
    assert stats["shadow"] == {"version": "3", "match": 8, "mismatch": 0, "error": 2,
                               "dropped": 0}


async def test_shadow_copies_are_dropped_and_counted_when_its_queue_is_full():
    gate = threading.Event()
    m = shadowed(adder(1, gate=gate, execution="thread"), shadow_queue=2)
    try:
        async with trioserve.open_runtime(config(m)) as rt:
            controller = rt._families["m"].controller
            await rt.infer("m", one(0))
            await trio.testing.wait_all_tasks_blocked()  # the copy is at the shadow
            for i in range(1, 10):
                assert version_of(await rt.infer("m", one(i)), i) == "1"
            assert controller.shadow_results["dropped"] == 7  # 2 wait, 7 dropped
            # a caller cancelled meanwhile breaks nothing
            with trio.move_on_after(0):
                await rt.infer("m", one(42))
            gate.set()
            await controller.wait_shadow_results(3)
            out = await rt.infer("m", one(11))
            await controller.wait_shadow_results(4)
            stats = rt.statistics()["m"]["rollout"]["shadow"]
    finally:
        gate.set()
    assert version_of(out, 11) == "1"
    assert stats == {"version": "3", "match": 4, "mismatch": 0, "error": 0, "dropped": 7}


async def test_rollout_metrics_only_for_models_with_a_rollout(autojump_clock):
    from trioserve.transport import open_gateway, open_http

    plain = ModelConfig(name="p", backend=adder(1), max_wait_ms=0.0)
    m = model({"stable": "1", "canary": "2", "steps": [0.25], "shadow": "3"})
    async with trioserve.open_runtime(config(m, plain)) as rt, \
            open_gateway(rt, host="127.0.0.1", port=0) as gw:
        for i in range(4):
            await rt.infer("m", one(i))
        await rt._families["m"].controller.wait_shadow_results(3)
        async with open_http(gw.url) as http:
            text = (await http.get("/metrics")).body.decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("trioserve_")]
    assert 'trioserve_rollout_share{model="m",version="2"} 0.25' in lines
    assert 'trioserve_rollout_share{model="m",version="1"} 0.75' in lines
    assert 'trioserve_rollout_events_total{event="rolled_back",model="m"} 0.0' in lines
    assert ('trioserve_shadow_results_total{model="m",result="mismatch",version="3"} 3.0'
            in lines)
    assert not [ln for ln in lines if "rollout" in ln and 'model="p"' in ln]


@pytest.mark.parametrize("canary", [None, "2"])
async def test_unversioned_answers_are_cached_under_the_version_routed_to(
    autojump_clock, canary,
):
    m = model({"stable": "1", "canary": canary, "steps": [0.5]}
              if canary else {"stable": "1"})
    cfg = config(m)
    cfg = trioserve.Config(models=cfg.models, tenants=cfg.tenants,
                           cache=trioserve.CacheConfig(capacity_bytes=1 << 20))
    async with trioserve.open_runtime(cfg) as rt:
        first = await rt.infer("m", one(5))  # to stable (1)
        pinned = [version_of(await rt.infer("m", one(5), version=v), 5) for v in "123"]
    assert version_of(first, 5) == "1"
    assert pinned == ["1", "2", "3"]  # each version's own answer, never another's


async def test_a_shadows_copy_of_a_call_naming_no_tenant_is_the_default_tenants():
    # the shadow is served by the stable's backend: the copies and the callers'
    # requests share one queue, whose statistics list each flow by its tenant
    m = ModelConfig(name="m", backend=adder(1), max_wait_ms=0.0,
                    versions={"1": {}, "3": {}}, rollout={"stable": "1", "shadow": "3"})
    async with trioserve.open_runtime(config(m)) as rt:
        for i in range(4):
            await rt.infer("m", one(i))
        await rt._families["m"].controller.wait_shadow_results(4)
        stats = rt.statistics()["m"]
    assert stats["rollout"]["shadow"]["match"] == 4
    flows = stats["flows"]
    assert sorted(flows) == ["t/batch", "t/realtime"]
    assert flows["t/batch"]["dispatched"] == 4  # the copies, at the lowest class
    assert flows["t/realtime"]["dispatched"] == 4


async def test_a_caller_reusing_its_buffers_does_not_change_the_shadows_copy():
    gate = threading.Event()  # the shadow (stable's weights) runs once all are answered
    m = shadowed(adder(1, gate=gate, execution="thread"))
    try:
        async with trioserve.open_runtime(config(m)) as rt:
            controller = rt._families["m"].controller
            buf = np.zeros(1, np.float32)
            for i in range(5):
                buf[0] = i  # one input buffer, refilled for each call
                out = await rt.infer("m", {"x": buf})
                out["y"][0] = -1.0  # and the answer changed in place
            gate.set()
            await controller.wait_shadow_results(5)
            stats = rt.statistics()["m"]["rollout"]["shadow"]
    finally:
        gate.set()
    assert stats == {"version": "3", "match": 5, "mismatch": 0, "error": 0, "dropped": 0}


@pytest.mark.parametrize(("rate", "warned"), [(1.0, True), (0.99, False)])
async def test_a_max_error_rate_of_1_is_accepted_and_logged_at_start(
    autojump_clock, caplog, rate, warned,
):
    m = model({"stable": "1", "canary": "2", "max_error_rate": rate})
    with caplog.at_level(logging.WARNING, logger="trioserve"):
        async with trioserve.open_runtime(config(m)) as rt:
            assert rt.statistics()["m"]["rollout"]["state"] == "canary"
    said = [r.getMessage() for r in caplog.records if "max_error_rate" in r.getMessage()]
    assert said == ([
        "model 'm': rollout.max_error_rate = 1: neither errors nor late requests will "
        "ever roll the canary '2' back; only its latency can"
    ] if warned else [])


def _cached(m: ModelConfig) -> trioserve.Config:
    cfg = config(m)
    return trioserve.Config(models=cfg.models, tenants=cfg.tenants,
                            cache=trioserve.CacheConfig(capacity_bytes=1 << 20))


def _timed(rt, version: str) -> int:
    """How many latencies the rollout's check holds for ``version`` in the step."""
    return rt._families["m"].controller.rollout.counts[version].latency.summary().count


async def test_cache_hits_are_left_out_of_the_checks(autojump_clock):
    # A hit's near-zero latency says nothing of the version: it is counted apart
    # (shared), in no latency, error share or min_requests.
    m = model({"stable": "1", "canary": "2", "steps": [0.5], "min_requests": 1000})
    async with trioserve.open_runtime(_cached(m)) as rt:
        # stable, canary, stable, ...: the first of each computed, the others hits
        seen = [version_of(await rt.infer("m", one(5)), 5) for _ in range(6)]
        single = rt.statistics()["m"]["rollout"]["counts"]
        timed = (_timed(rt, "1"), _timed(rt, "2"))
        # a batch call: items 1 (stable), 2 (canary), 3 (stable), 4 (canary); stable's
        # first is a hit, the canary's two are one input, computed once
        out = await rt.infer_batch("m", [one(5), one(6), one(6), one(6)])
        batch = rt.statistics()["m"]["rollout"]["counts"]
        batch_timed = (_timed(rt, "1"), _timed(rt, "2"))
    assert seen == ["1", "2"] * 3
    assert {v: (c["ok"], c["shared"]) for v, c in single.items()} == {"1": (1, 2), "2": (1, 2)}
    assert timed == (1, 1)
    assert [version_of(o, x) for o, x in zip(out, [5, 6, 6, 6], strict=True)] == \
        ["1", "2", "1", "2"]
    assert {v: (c["ok"], c["shared"]) for v, c in batch.items()} == {"1": (2, 3), "2": (2, 3)}
    assert batch_timed == (2, 2)


async def test_a_request_joined_to_another_in_flight_is_left_out_of_the_checks():
    # every unversioned request to the canary, each input twice at once: the second
    # joins the first's computation; a failure is counted once, not per caller
    gate = threading.Event()
    failing = adder(2, fail_if=lambda x: x == 9, gate=gate, execution="thread")
    m = model({"stable": "1", "canary": "2", "steps": [1.0], "min_requests": 1000},
              canary=failing, coalesce=True)
    got: list[object] = []

    async def call(rt, x: float) -> None:
        try:
            got.append(version_of(await rt.infer("m", one(x)), x))
        except ModelError:
            got.append("error")

    try:
        async with trioserve.open_runtime(config(m)) as rt:
            for x in (4.0, 9.0):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(call, rt, x)
                    nursery.start_soon(call, rt, x)
                    await trio.testing.wait_all_tasks_blocked()
                    gate.set()
                gate.clear()
            counts = rt.statistics()["m"]["rollout"]["counts"]["2"]
            timed = _timed(rt, "2")
    finally:
        gate.set()
    assert got == ["2", "2", "error", "error"]
    assert (counts["ok"], counts["errors"], counts["shared"]) == (1, 1, 2)
    assert timed == 2  # the two computations' latencies


class Seen(CallableBackend):
    """A backend computing ``y = x + k`` inline, recording the ``x`` of each item it
    runs (as a tuple) in ``seen``; an item costs its length."""

    def __init__(self, k: float, *, gate=None) -> None:
        self.seen: list[tuple[float, ...]] = []

        def run(items):
            if gate is not None:
                gate.wait(GATE_LIMIT_S)
            self.seen.extend(tuple(map(float, it["x"])) for it in items)
            return [{"y": it["x"] + np.float32(k)} for it in items]

        super().__init__(run, inputs=[X], outputs=[Y],
                         execution="thread" if gate is not None else "inline")

    def prepare(self, name, inputs):
        it, _ = super().prepare(name, inputs)
        return it, int(it["x"].shape[0])


def shadow_of(stable, shadow, **cfg) -> ModelConfig:
    """Model ``m``: stable version 1 (``stable``) and its shadow 3 (``shadow``)."""
    cfg.setdefault("max_wait_ms", 0.0)
    rollout = {"stable": "1", "shadow": "3"}
    rollout.update(cfg.pop("rollout", {}))
    return ModelConfig(name="m", backend=stable, versions={"1": {}, "3": {"backend": shadow}},
                       rollout=rollout, **cfg)


async def _copied(rt, n: int) -> int:
    """Wait for ``n`` shadow copies to have run, then return how many ran or were
    dropped once nothing more moves."""
    controller = rt._families["m"].controller
    await controller.wait_shadow_results(n)
    await trio.testing.wait_all_tasks_blocked()
    return sum(controller.shadow_results.values())


@pytest.mark.parametrize(("share", "copied"), [(1.0, [5, 6, 7, 8]), (0.5, [6, 8])])
async def test_the_shadow_copies_only_answers_the_model_computed(autojump_clock, share, copied):
    # Repeats of an input answered from the cache are not copied: the shadow runs
    # each input once (the first, the one the model ran), and its share is of those.
    shadow = Seen(3)
    m = shadow_of(adder(1), shadow, rollout={"shadow_share": share})
    async with trioserve.open_runtime(_cached(m)) as rt:
        for x in (5, 5, 5, 6, 6, 7, 5, 7, 8, 8, 6):
            assert version_of(await rt.infer("m", one(x)), x) == "1"
        ran = await _copied(rt, len(copied))
    assert sorted(shadow.seen) == [(float(x),) for x in copied]
    assert ran == len(copied)


async def test_an_uncached_models_every_answer_is_copied_to_its_shadow(autojump_clock):
    shadow = Seen(3)
    m = shadow_of(adder(1), shadow)
    async with trioserve.open_runtime(config(m)) as rt:
        for x in (5, 5, 5, 6):
            await rt.infer("m", one(x))
        await rt.infer_batch("m", [one(5), one(6), one(6)])
        ran = await _copied(rt, 7)
    assert sorted(shadow.seen) == [(5.0,)] * 4 + [(6.0,)] * 3
    assert ran == 7


async def test_a_batch_call_copies_to_the_shadow_only_the_items_the_model_ran(autojump_clock):
    shadow = Seen(3)
    m = shadow_of(adder(1), shadow)
    async with trioserve.open_runtime(_cached(m)) as rt:
        await rt.infer("m", one(5))
        # 5 from the cache, 6 computed, its repeat shared, 7 computed
        out = await rt.infer_batch("m", [one(5), one(6), one(6), one(7)])
        ran = await _copied(rt, 3)
    assert [float(o["y"][0]) for o in out] == [6.0, 7.0, 7.0, 8.0]
    assert sorted(shadow.seen) == [(5.0,), (6.0,), (7.0,)]
    assert ran == 3


async def test_a_batch_call_with_items_run_alone_copies_only_those_the_model_ran(
    autojump_clock,
):
    # Items over max_batch_tokens run alone, the others together: which answers the
    # model did not run for is known by each item's place in the whole call.
    shadow = Seen(3)
    m = shadow_of(Seen(1), shadow, max_batch_tokens=2, oversize="alone")
    big = {"x": np.full(3, 7.0, np.float32)}
    bigger = {"x": np.full(3, 8.0, np.float32)}
    async with trioserve.open_runtime(_cached(m)) as rt:
        await rt.infer("m", big)
        await rt.infer("m", one(5))
        # 0: big, cached; 1: computed; 2: cached; 3: big, computed; 4: big, cached
        out = await rt.infer_batch("m", [big, one(6), one(5), bigger, big])
        ran = await _copied(rt, 4)
    assert [o["y"].tolist() for o in out] == [[8.0] * 3, [7.0], [6.0], [9.0] * 3, [8.0] * 3]
    assert sorted(shadow.seen) == [(5.0,), (6.0,), (7.0, 7.0, 7.0), (8.0, 8.0, 8.0)]
    assert ran == 4


async def test_a_request_joined_to_another_in_flight_is_not_copied_to_the_shadow():
    gate = threading.Event()
    shadow = Seen(3)
    m = shadow_of(Seen(1, gate=gate), shadow, coalesce=True)
    got: list[float] = []

    async def call(rt) -> None:
        got.append(float((await rt.infer("m", one(4)))["y"][0]))

    try:
        async with trioserve.open_runtime(config(m)) as rt:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, rt)
                nursery.start_soon(call, rt)
                await trio.testing.wait_all_tasks_blocked()
                gate.set()
            ran = await _copied(rt, 1)
    finally:
        gate.set()
    assert got == [5.0, 5.0]
    assert sorted(shadow.seen) == [(4.0,)]
    assert ran == 1


# ---------------------------------------------------------------- the operator's
async def test_the_operator_pauses_resumes_and_promotes_a_canary(autojump_clock, caplog):
    m = model({"stable": "1", "canary": "2", "steps": [0.5, 0.75], "step_s": 10,
               "min_requests": 2})
    with caplog.at_level(logging.INFO, logger="trioserve"):
        async with trioserve.open_runtime(config(m)) as rt:
            for i in range(4):
                await rt.infer("m", one(i))
            paused = rt.pause_rollout("m")
            await trio.sleep(100)  # long past step_s, with its answers: held
            held = [version_of(await rt.infer("m", one(i)), i) for i in range(4)]
            still = rt.rollout_state("m")
            resumed = rt.resume_rollout("m")
            await trio.sleep(9.9)  # the step's 10 s, its pause not counted
            before = rt.rollout_state("m")["step"]
            elapsed = rt.rollout_state("m")["step_elapsed_s"]
            await trio.sleep(0.2)
            stepped = rt.rollout_state("m")
            promoted = rt.promote("m")
            after = [version_of(await rt.infer("m", one(i)), i) for i in range(3)]
            assert rt.statistics()["m"]["rollout"] == rt.rollout_state("m")
    assert (paused["state"], paused["paused"], paused["share"]) == ("paused", True, 0.5)
    # the step's age, in seconds, stands still while paused and goes on after
    assert still["step_elapsed_s"] == paused["step_elapsed_s"]
    assert elapsed == pytest.approx(paused["step_elapsed_s"] + 9.9)
    assert promoted["step_elapsed_s"] is None  # ended
    assert held == ["1", "2", "1", "2"]  # the share holds
    assert (still["state"], still["step"], still["counts"]["2"]["ok"]) == ("paused", 0, 4)
    assert (resumed["state"], resumed["paused"]) == ("canary", False)
    assert before == 0
    assert (stepped["step"], stepped["share"]) == (1, 0.75)
    assert (promoted["state"], promoted["share"], promoted["reason"]) == ("promoted", 1.0, None)
    assert promoted["events"] == {"step": 1, "promoted": 1, "rolled_back": 0, "paused": 1,
                                  "resumed": 1, "started": 0}
    assert after == ["2"] * 3
    said = [r.getMessage() for r in caplog.records if "by the operator" in r.getMessage()]
    assert said == [
        "model 'm': canary '2' paused by the operator at step 1, 0.5 of unversioned requests",
        "model 'm': canary '2' resumed by the operator at step 1, 0.5 of unversioned requests",
        # the share it held when promoted, not the 1 it takes after
        "model 'm': canary '2' promoted by the operator at step 2, 0.75 of unversioned "
        "requests",
    ]


async def test_an_action_the_rollout_does_not_allow_is_refused(autojump_clock, caplog):
    plain = ModelConfig(name="p", backend=adder(1), max_wait_ms=0.0)
    m = model({"stable": "1", "canary": "2"})
    caplog.set_level(logging.INFO, logger="trioserve")
    async with trioserve.open_runtime(config(m, plain)) as rt:
        with pytest.raises(trioserve.ConfigError) as refused:
            rt.resume_rollout("m")
        rolled = rt.rollback("m", reason="the dashboards\nmodel 'm': canary '2' promoted")
        refusals = {}
        for action in ("promote", "rollback", "pause_rollout", "resume_rollout"):
            with pytest.raises(trioserve.ConfigError) as exc:
                getattr(rt, action)("m")
            refusals[action] = str(exc.value)
        with pytest.raises(trioserve.UnknownModel):
            rt.promote("nope")
        with pytest.raises(trioserve.ConfigError) as none:
            rt.rollout_state("p")
        with pytest.raises(trioserve.InvalidInput, match="reason must be a non-empty string"):
            rt.rollback("m", reason="")
        final = rt.rollout_state("m")
    assert str(refused.value) == "model 'm': cannot resume its rollout: it is not paused"
    assert (rolled["state"], rolled["share"], rolled["reason"]) == (
        "rolled_back", 0.0, "the dashboards\nmodel 'm': canary '2' promoted")
    # the operator's reason is one line of the log, as given (a newline in it could
    # pass for a line of the runtime's own)
    said = [r.getMessage() for r in caplog.records if "by the operator" in r.getMessage()]
    assert said == [
        # the share it held (the first step's 0.05), not the 0 it takes after
        "model 'm': canary '2' rolled back by the operator at step 1, 0.05 of unversioned "
        "requests: \"the dashboards\\nmodel 'm': canary '2' promoted\""
    ]
    assert refusals["promote"] == (
        "model 'm': cannot promote its rollout: the canary is already rolled_back (final)")
    assert refusals["pause_rollout"].startswith("model 'm': cannot pause its rollout: ")
    assert str(none.value) == (
        "model 'p' has no rollout (no [models.p.rollout] in its configuration)")
    assert final == rolled  # nothing refused changed it


def test_the_blocking_client_operates_a_rollout():
    m = model({"stable": "1", "canary": "2", "steps": [0.5]})
    with trioserve.serve_in_thread(config(m)) as client:
        state = client.rollout_state("m")
        paused = client.pause_rollout("m")
        resumed = client.resume_rollout("m")
        rolled = client.rollback("m", reason="a bad canary")
        with pytest.raises(trioserve.ConfigError, match="already rolled_back"):
            client.promote("m")
        with pytest.raises(trioserve.UnknownModel):
            client.rollout_state("nope")
    assert state["state"] == "canary"
    assert (paused["paused"], resumed["paused"]) == (True, False)
    assert (rolled["state"], rolled["reason"]) == ("rolled_back", "a bad canary")
