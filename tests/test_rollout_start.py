"""A new rollout started while serving (docs/rollout.md, "Operator actions"):
``rt.start_rollout``, the blocking client's, ``POST /v2/models/NAME/rollout/start``,
and a started trial kept across restarts by the state file."""

from __future__ import annotations

import logging

import orjson
import pytest
import trio
import trioserve
from http_helpers import config as http_config
from http_helpers import serving
from runtime_helpers import config
from test_rollout_runtime import model, one
from test_rollout_state_file import inline_writes as inline_writes  # a fixture
from test_rollout_state_file import kept, recorded, unversioned
from test_rollout_state_file import model as weighted
from trioserve import ConfigError, InvalidInput
from trioserve.transport import open_http

TRIAL = {"stable": "1", "canary": "2", "steps": [0.5], "step_s": 10, "min_requests": 2}


async def test_a_trial_started_after_a_rollback_runs_against_the_same_stable(
    autojump_clock, caplog,
):
    caplog.set_level(logging.INFO, logger="trioserve")
    async with trioserve.open_runtime(config(model(TRIAL))) as rt:
        rt.rollback("m", reason="bad")
        started = rt.start_rollout("m", canary="3", steps=[0.25, 0.5], step_s=5)
        seen = await unversioned(rt, 8)
    assert (started["state"], started["stable"], started["canary"]) == ("canary", "1", "3")
    assert (started["step"], started["share"], started["steps"]) == (0, 0.25, [0.25, 0.5])
    assert (started["origin"], started["stable_from"]) == ("operator", "previous")
    assert started["reason"] is None
    assert started["events"] == {"step": 0, "promoted": 0, "rolled_back": 1, "paused": 0,
                                 "resumed": 0, "started": 1}
    assert seen == ["1", "1", "1", "3"] * 2  # the new canary at 0.25
    said = [r.getMessage() for r in caplog.records if "started by" in r.getMessage()]
    assert said == [
        "model 'm': rollout started by the operator: canary '3' on trial against stable "
        "'1' (the last trial's stable), at 0.25 of unversioned requests, steps [0.25, 0.5]"
    ]


async def test_a_trial_started_after_a_promotion_has_the_promoted_canary_as_stable(
    autojump_clock,
):
    async with trioserve.open_runtime(config(model(TRIAL))) as rt:
        rt.promote("m")
        started = rt.start_rollout("m", canary="1")  # the configuration's rules
        seen = await unversioned(rt, 4)
        # the new trial runs its steps and checks: promoted after step_s
        await trio.sleep(10)
        await unversioned(rt, 4)
        final = rt.rollout_state("m")
    assert (started["stable"], started["canary"], started["stable_from"]) == (
        "2", "1", "promoted")
    assert (started["share"], started["steps"]) == (0.5, [0.5])
    assert seen == ["2", "1", "2", "1"]
    assert (final["state"], final["stable"], final["canary"]) == ("promoted", "2", "1")


async def test_a_rollout_without_a_canary_may_start_one(autojump_clock):
    async with trioserve.open_runtime(config(model({"stable": "1"}))) as rt:
        assert rt.rollout_state("m")["state"] == "stable"
        started = rt.start_rollout("m", canary="2", steps=[0.5])
        seen = await unversioned(rt, 4)
    assert (started["state"], started["stable"], started["stable_from"]) == (
        "canary", "1", "configuration")
    assert seen == ["1", "2", "1", "2"]


async def test_a_start_is_refused_while_a_canary_is_on_trial(autojump_clock):
    async with trioserve.open_runtime(config(model(TRIAL))) as rt:
        with pytest.raises(ConfigError) as on_trial:
            rt.start_rollout("m", canary="3")
        rt.pause_rollout("m")
        with pytest.raises(ConfigError) as paused:
            rt.start_rollout("m", canary="3")
        state = rt.rollout_state("m")
    assert str(on_trial.value) == (
        "model 'm': cannot start a rollout: canary '2' is on trial; roll it back or "
        "promote it first")
    assert str(paused.value) == (
        "model 'm': cannot start a rollout: canary '2' is on trial (paused); roll it back "
        "or promote it first")
    assert (state["state"], state["canary"], state["events"]["started"]) == ("paused", "2", 0)


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"canary": "9"}, "canary '9' is not one of the model's versions (1, 2, 3)"),
        ({"canary": "1"}, "canary '1' is the stable version (the one taking every "
                          "unversioned request now); name another version"),
        ({"canary": 2}, "canary must be a version's name (a string), got 2"),
        ({"canary": "3", "steps": [0.5, 0.25]},
         "rollout.steps: must be increasing, got [0.5, 0.25]"),
        ({"canary": "3", "step_s": 0}, "rollout.step_s: must be a finite number > 0.0, got 0"),
        ({"canary": "3", "max_error_rate": 2},
         "rollout.max_error_rate: must be a finite number <= 1.0, got 2"),
        ({"canary": "3", "shadow": "2"},
         "unknown key 'shadow'; a start may give canary, steps, step_s, min_requests, "
         "max_error_rate, max_latency_ratio"),
    ],
)
async def test_a_start_with_a_bad_canary_or_rule_is_refused_clearly(
    autojump_clock, kwargs, why,
):
    async with trioserve.open_runtime(config(model(TRIAL))) as rt:
        rt.rollback("m")
        with pytest.raises(InvalidInput) as exc:
            rt.start_rollout("m", **kwargs)
        state = rt.rollout_state("m")
    assert str(exc.value) == f"model 'm': cannot start a rollout: {why}"
    assert (state["state"], state["events"]["started"]) == ("rolled_back", 0)


async def test_the_shadow_cannot_be_started_as_a_canary(autojump_clock):
    async with trioserve.open_runtime(config(model({**TRIAL, "shadow": "3"}))) as rt:
        rt.rollback("m")
        with pytest.raises(InvalidInput, match="canary '3' is the rollout's shadow"):
            rt.start_rollout("m", canary="3")


def test_the_blocking_client_starts_a_rollout():
    with trioserve.serve_in_thread(config(model(TRIAL))) as client:
        client.rollback("m")
        started = client.start_rollout("m", canary="3", min_requests=5)
        with pytest.raises(ConfigError, match="roll it back or promote it first"):
            client.start_rollout("m", canary="2")
    assert (started["state"], started["canary"]) == ("canary", "3")


async def test_a_start_over_http():
    async with serving(http_config(model(TRIAL))) as gw, open_http(gw.url) as http:
        async def call(target, body=b""):
            res = await http.request("POST", target, body)
            return res.status, res.json()

        start = "/v2/models/m/rollout/start"
        got = {
            "on trial": await call(start, b'{"canary": "3"}'),
            "rollback": await call("/v2/models/m/rollout/rollback"),
            "no body": await call(start),
            "no canary": await call(start, b'{"steps": [0.5]}'),
            "unknown key": await call(start, b'{"canary": "3", "x": 1}'),
            "unknown version": await call(start, b'{"canary": "9"}'),
            "the stable": await call(start, b'{"canary": "1"}'),
            "bad rule": await call(start, b'{"canary": "3", "steps": [0.5, 0.25]}'),
            "unknown model": await call("/v2/models/nope/rollout/start", b'{"canary": "3"}'),
            "start": await call(start, b'{"canary": "3", "steps": [0.25, 1.0], "step_s": 30}'),
        }
        text = (await http.get("/metrics")).body.decode()
        in_process = gw.runtime.rollout_state("m")
    status = {k: s for k, (s, _) in got.items()}
    assert status == {
        "on trial": 409, "rollback": 200, "no body": 400, "no canary": 400,
        "unknown key": 400, "unknown version": 400, "the stable": 400, "bad rule": 400,
        "unknown model": 404, "start": 200,
    }
    assert got["on trial"][1]["error"] == (
        "model 'm': cannot start a rollout: canary '2' is on trial; roll it back or "
        "promote it first")
    assert got["no body"][1]["error"] == (
        "rollout start request: a start's body must be a JSON object giving 'canary'")
    assert got["unknown key"][1]["error"] == (
        "rollout start request: unknown key 'x'; a start's body may give canary, steps, "
        "step_s, min_requests, max_error_rate, max_latency_ratio")
    assert got["unknown version"][1]["error"] == (
        "model 'm': cannot start a rollout: canary '9' is not one of the model's versions "
        "(1, 2, 3)")
    assert got["bad rule"][1]["error"] == (
        "model 'm': cannot start a rollout: rollout.steps: must be increasing, got "
        "[0.5, 0.25]")
    doc = got["start"][1]
    assert (doc["state"], doc["stable"], doc["canary"], doc["share"]) == (
        "canary", "1", "3", 0.25)
    # the same state in process (the time served in the step moves on: real time)
    assert {k: v for k, v in doc.items() if k != "step_elapsed_s"} == {
        k: v for k, v in in_process.items() if k != "step_elapsed_s"}
    lines = text.splitlines()
    assert 'trioserve_rollout_events_total{event="started",model="m"} 1.0' in lines
    assert 'trioserve_rollout_share{model="m",version="3"} 0.25' in lines


async def test_a_start_needs_an_operators_key_when_keys_are_set():
    cfg = http_config(model(TRIAL), server={"control_plane_keys": ("ops-key",)})
    async with serving(cfg) as gw, open_http(gw.url) as http:
        gw.runtime.rollback("m")
        body = b'{"canary": "3"}'
        refused = (await http.request("POST", "/v2/models/m/rollout/start", body)).status
        allowed = (await http.request(
            "POST", "/v2/models/m/rollout/start", body,
            headers=[("authorization", "Bearer ops-key")])).status
    assert (refused, allowed) == (401, 200)


async def test_a_started_trial_and_its_progress_outlast_a_restart(
    autojump_clock, tmp_path, inline_writes, caplog,
):
    path = tmp_path / "rollout.json"
    cfg = kept(weighted(TRIAL), path)
    async with trioserve.open_runtime(cfg) as rt:
        rt.promote("m")
        rt.start_rollout("m", canary="3", steps=[0.5, 1.0], step_s=20, min_requests=1)
        for i in range(2):
            await rt.infer("m", one(i))
        await trio.sleep(20)
        await rt.infer("m", one(0))  # its first step ended: step 2, at 1.0
        await trio.sleep(5)
    on_disk = recorded(path)["models"]["m"]
    caplog.set_level(logging.INFO, logger="trioserve")
    async with trioserve.open_runtime(cfg) as rt:
        state = rt.rollout_state("m")
        seen = await unversioned(rt, 2)
        await trio.sleep(15)  # what is left of the step's 20 s
        await unversioned(rt, 1)
        final = rt.rollout_state("m")
    # a configuration whose rollout is another: the started trial is not used
    async with trioserve.open_runtime(kept(weighted({**TRIAL, "canary": "3"}), path)) as rt:
        other = rt.rollout_state("m")
    assert {k: on_disk[k] for k in ("state", "stable", "canary", "steps", "step",
                                    "elapsed_s")} == {
        "state": "canary", "stable": "2", "canary": "3", "steps": [0.5, 1.0], "step": 1,
        "elapsed_s": 5.0}
    assert on_disk["started"] == {
        "configured": {"stable": "1", "canary": "2"}, "stable_from": "promoted",
        "rules": {"step_s": 20, "min_requests": 1, "max_error_rate": 0.01,
                  "max_latency_ratio": 1.5}}
    assert (state["state"], state["stable"], state["canary"], state["step"]) == (
        "canary", "2", "3", 1)
    assert (state["origin"], state["stable_from"], state["restored"]) == (
        "operator", "promoted", "canary")
    assert state["step_elapsed_s"] == 5.0
    assert seen == ["3", "3"]  # share 1.0
    assert (final["state"], final["canary"]) == ("promoted", "3")
    said = [r.getMessage() for r in caplog.records if "as recorded in" in r.getMessage()]
    assert said == [
        "model 'm': rollout: stable '2', canary '3' on trial at step 2 of 2 (1), 5 s of "
        f"it served (a trial started by the operator) as recorded in {path}"
    ]
    assert (other["state"], other["stable"], other["canary"], other["restored"]) == (
        "canary", "1", "3", None)


async def test_a_started_trial_is_recorded_at_once(autojump_clock, tmp_path, inline_writes):
    path = tmp_path / "rollout.json"
    async with trioserve.open_runtime(kept(weighted(TRIAL), path)) as rt:
        rt.rollback("m", reason="bad")
        rt.start_rollout("m", canary="3")
        await rt._rollout_state.flush()
        rec = recorded(path)["models"]["m"]
    assert (rec["state"], rec["stable"], rec["canary"], rec["step"], rec["reason"]) == (
        "canary", "1", "3", 0, None)
    assert rec["started"]["stable_from"] == "previous"
    body = orjson.dumps(rec)
    assert b'"elapsed_s":0.0' in body
