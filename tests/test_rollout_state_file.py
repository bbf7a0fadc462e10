"""A rollout's decisions kept across restarts (``runtime.rollout_state_file``,
docs/rollout.md): the round trip, a record that no longer matches the
configuration, a file that cannot be read, or could not be written, a write that
fails, a write abandoned at the close, and the atomic write itself."""

from __future__ import annotations

import json
import logging
import os
import threading

import attrs
import numpy as np
import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import GATE_LIMIT_S, config
from test_rollout_runtime import adder, one, version_of
from trioserve import ConfigError, ModelConfig
from trioserve import _rollout_state as state_file
from trioserve.cli import main


def make_adder(k: float):
    """A factory backend (its option ``k`` is its "weights"): ``y = x + k``."""
    return adder(k)


def model(rollout: dict, *, canary_k: float = 2, **cfg) -> ModelConfig:
    """Model ``m``: version 1 (+1, the model's backend), 2 (+``canary_k``, weights of
    its own, from options) and 3 (+3)."""
    cfg.setdefault("max_wait_ms", 0.0)
    return ModelConfig(
        name="m", backend=adder(1),
        versions={"1": {}, "2": {"backend": make_adder, "options": {"k": canary_k}},
                  "3": {"backend": make_adder, "options": {"k": 3}}},
        rollout=rollout, **cfg,
    )


def kept(m: ModelConfig, path) -> trioserve.Config:
    return config(m, rollout_state_file=str(path))


def recorded(path) -> dict:
    with open(path, "rb") as f:
        return json.load(f)


async def unversioned(rt, n: int) -> list[str]:
    return [version_of(await rt.infer("m", one(i)), i) for i in range(n)]


CANARY = {"stable": "1", "canary": "2", "steps": [0.5, 0.75], "step_s": 10,
          "min_requests": 2}


async def test_a_rollback_outlasts_a_restart(autojump_clock, tmp_path, caplog):
    path = tmp_path / "rollout.json"
    caplog.set_level(logging.INFO, logger="trioserve")
    async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
        assert rt.rollout_state("m")["restored"] is None
        rt.rollback("m", reason="errors on the dashboards")
        # the runtime closes at once: the decision is written before it has closed
    on_disk = recorded(path)
    async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
        state = rt.rollout_state("m")
        seen = await unversioned(rt, 6)
        with pytest.raises(ConfigError, match="already rolled_back"):
            rt.promote("m")
    assert on_disk["format"] == 1
    assert {k: v for k, v in on_disk["models"]["m"].items() if k != "versions"} == {
        "state": "rolled_back", "stable": "1", "canary": "2", "steps": [0.5, 0.75],
        "step": 0, "reason": "errors on the dashboards",
    }
    assert (state["state"], state["share"], state["reason"], state["restored"]) == (
        "rolled_back", 0.0, "errors on the dashboards", "rolled_back")
    assert state["events"]["rolled_back"] == 0  # nothing happened in this run
    assert state["state_file"] == {"path": str(path), "writes": 0, "write_errors": 0,
                                   "last_error": None}
    assert seen == ["1"] * 6  # the canary is not on trial again
    said = [r.getMessage() for r in caplog.records if "rollout: stable" in r.getMessage()]
    assert said[-1] == (
        f"model 'm': rollout: stable '1', canary '2' rolled back as recorded in {path}"
    )


async def test_a_promotion_by_the_checks_outlasts_a_restart(autojump_clock, tmp_path):
    path = tmp_path / "rollout.json"
    async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
        while rt.rollout_state("m")["state"] != "promoted":
            await rt.infer("m", one(0))
            await trio.sleep(1)
        await rt._rollout_state.flush()
        writes = rt.rollout_state("m")["state_file"]["writes"]
    async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
        state = rt.rollout_state("m")
        seen = await unversioned(rt, 4)
    assert writes == 2  # the second step begun (the trial's progress), the promotion
    assert recorded(path)["models"]["m"]["state"] == "promoted"
    assert (state["state"], state["share"], state["restored"]) == ("promoted", 1.0, "promoted")
    assert seen == ["2"] * 4


async def test_a_pause_outlasts_a_restart_at_its_step_and_a_resume_is_kept_too(
    autojump_clock, tmp_path,
):
    path = tmp_path / "rollout.json"
    rollout = {**CANARY, "min_requests": 4}
    async with trioserve.open_runtime(kept(model(rollout), path)) as rt:
        for i in range(8):
            await rt.infer("m", one(i))
        await trio.sleep(10)
        await rt.infer("m", one(0))  # the first step has ended: step 2, at 0.75
        # (the step's record: a write of its own, in a worker thread: under the mock
        # clock, trio time may pass meanwhile)
        await rt._rollout_state.flush()
        await trio.sleep(3)
        paused = rt.pause_rollout("m")
        served = paused["step_elapsed_s"]
    async with trioserve.open_runtime(kept(model(rollout), path)) as rt:
        state = rt.rollout_state("m")
        seen = await unversioned(rt, 4)
        await trio.sleep(100)  # held: no step ends, nothing promotes it
        held = rt.rollout_state("m")
        # on trial again (its 3 answers are short of min_requests: the step goes on)
        resumed = rt.resume_rollout("m")
        await rt._rollout_state.flush()
        after_resume = recorded(path)
    async with trioserve.open_runtime(kept(model(rollout), path)) as rt:
        again = rt.rollout_state("m")
    assert (paused["step"], paused["share"]) == (1, 0.75)
    assert served >= 3.0
    assert (state["state"], state["paused"], state["step"], state["share"]) == (
        "paused", True, 1, 0.75)
    assert state["restored"] == "paused"
    assert state["step_elapsed_s"] == served  # the time served before the pause
    assert seen == ["1", "2", "2", "2"]  # 3 of 4 to the canary: the step's share
    assert (held["state"], held["step"], held["counts"]["2"]["ok"]) == ("paused", 1, 3)
    assert held["step_elapsed_s"] == served  # the pause not counted
    assert (resumed["state"], resumed["step"], resumed["share"]) == ("canary", 1, 0.75)
    # on trial again: its progress is recorded (its step, the time served in it)
    rec = after_resume["models"]["m"]
    assert (rec["state"], rec["step"], rec["elapsed_s"]) == ("canary", 1, served)
    # (written again at the close, the time served the same: nothing passed since)
    assert (again["state"], again["step"], again["restored"]) == ("canary", 1, "canary")
    assert again["step_elapsed_s"] >= served  # and what passed until the close


@pytest.mark.parametrize(
    ("now", "why"),
    [
        ({**CANARY, "canary": "3"},
         "it was decided for stable '1' and canary '2', the configuration has stable "
         "'1' and canary '3'"),
        ({**CANARY, "stable": "3"},
         "it was decided for stable '1' and canary '2', the configuration has stable "
         "'3' and canary '2'"),
        ({"stable": "1"}, "the configuration has no canary now"),
    ],
)
async def test_a_record_of_other_versions_is_not_used(
    autojump_clock, tmp_path, caplog, now, why,
):
    path = tmp_path / "rollout.json"
    async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
        rt.rollback("m")
    caplog.set_level(logging.INFO, logger="trioserve")
    async with trioserve.open_runtime(kept(model(now), path)) as rt:
        state = rt.rollout_state("m")
    assert state["restored"] is None
    assert state["state"] == ("canary" if "canary" in now else "stable")
    said = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert said == [
        f"model 'm': rollout: the decision recorded in {path} is not used: {why}; "
        "it starts afresh"
    ]
    # left as it was, unless the configuration's canary is on trial: its progress
    # is recorded at the close, in place of the record not used
    assert recorded(path)["models"]["m"]["canary"] == ("3" if "canary" in now and now[
        "canary"] == "3" else "2")


async def test_a_record_of_other_weights_or_steps_is_not_used(
    autojump_clock, tmp_path, caplog,
):
    path = tmp_path / "rollout.json"
    async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
        rt.pause_rollout("m")
    paused = path.read_bytes()
    caplog.set_level(logging.INFO, logger="trioserve")
    # the same versions' names, but the canary's options are other weights
    async with trioserve.open_runtime(kept(model(CANARY, canary_k=7), path)) as rt:
        reweighted = rt.rollout_state("m")
    # (its own trial's progress took the record's place at its close)
    replaced = recorded(path)["models"]["m"]
    path.write_bytes(paused)
    # paused at step 1 of other steps
    async with trioserve.open_runtime(kept(model({**CANARY, "steps": [0.1]}), path)) as rt:
        restepped = rt.rollout_state("m")
    path.write_bytes(paused)
    # the very same configuration (the model's backend is another object, of the
    # same kind): restored
    async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
        same = rt.rollout_state("m")
    said = [r.getMessage().partition(" is not used: ")[2]
            for r in caplog.records if "not used" in r.getMessage()]
    assert (reweighted["state"], reweighted["restored"]) == ("canary", None)
    assert (replaced["state"], replaced["step"]) == ("canary", 0)
    assert replaced["versions"]["2"] == state_file.version_fingerprint(
        model(CANARY, canary_k=7), "2")
    assert (restepped["state"], restepped["restored"]) == ("canary", None)
    assert (same["state"], same["restored"]) == ("paused", "paused")
    assert said == [
        "the backend or options of version '2' changed since; it starts afresh",
        "its canary was on trial at step 1 of steps [0.5, 0.75], the configuration's "
        "steps are now [0.1]; it starts afresh",
    ]


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b'{"format": 1, "models": {"m": ', "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[]", "not a rollout state file (expected a JSON object with 'format' and 'models')"),
        (b'{"format": 2, "models": {}}', "format 2, this server reads format 1"),
        (b'{"format": 1, "models": {"m": {"state": "gone", "stable": "1", "canary": "2", '
         b'"versions": {}, "steps": [0.5], "step": 0}}}',
         "the record of model 'm': 'state' must be one of promoted, rolled_back, paused, "
         "canary, got 'gone'"),
        (b'{"format": 1, "models": {"m": {"state": "paused", "stable": "1", "canary": "2", '
         b'"versions": {}, "steps": [0.5], "step": 3}}}',
         "the record of model 'm': 'step' 3 is not one of its 1 steps"),
    ],
)
async def test_a_file_that_is_no_state_file_fails_the_start_naming_it(
    autojump_clock, tmp_path, content, why,
):
    path = tmp_path / "rollout.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as exc:
        async with trioserve.open_runtime(kept(model(CANARY), path)):
            pass  # pragma: no cover
    text = str(exc.value)
    assert text.startswith(f"{path}: rollout state file (runtime.rollout_state_file): {why}")
    assert text.endswith("; fix it, or remove it to start every rollout afresh")
    assert path.read_bytes() == content  # left as it was


async def test_a_state_file_that_cannot_be_read_fails_the_start(
    autojump_clock, tmp_path, monkeypatch,
):
    path = tmp_path / "rollout.json"
    path.write_bytes(b'{"format": 1, "models": {}}')

    def unreadable(p):
        raise PermissionError(13, "Permission denied", p)

    monkeypatch.setattr(state_file, "_read", unreadable)
    with pytest.raises(ConfigError) as exc:
        async with trioserve.open_runtime(kept(model(CANARY), path)):
            pass  # pragma: no cover
    assert str(exc.value) == (
        f"{path}: rollout state file (runtime.rollout_state_file): cannot be read: "
        "Permission denied; fix it, or remove it to start every rollout afresh"
    )


def real_path(p) -> str:
    """``p`` with its links followed, as the state file's errors name folders."""
    return os.path.realpath(p)


UNWRITABLE = "rollout state file (runtime.rollout_state_file): cannot be written: "
LOST = "(every decision's write would fail, and the decisions be lost at a restart); "


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("missing/rollout.json",
         "its directory {tmp}/missing does not exist {lost}create it, or set "
         "runtime.rollout_state_file to a file in a directory that exists"),
        ("a-file/rollout.json",
         "its directory {tmp}/a-file is not a directory {lost}set "
         "runtime.rollout_state_file to a file in a directory"),
        ("a-dir",
         "is a directory, not a file {lost}set runtime.rollout_state_file to a "
         "file's path"),
    ],
)
async def test_a_state_file_that_could_not_be_written_fails_the_start_naming_it(
    autojump_clock, tmp_path, where, why,
):
    # Found at the start, not by the first decision's write (logged, while serving
    # went on): the decisions would have been lost at the next restart.
    (tmp_path / "a-file").write_bytes(b"")
    (tmp_path / "a-dir").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    path = tmp_path / where
    with pytest.raises(ConfigError) as exc:
        async with trioserve.open_runtime(kept(model(CANARY), path)):
            pytest.fail("the runtime started")  # pragma: no cover
    why = why.format(tmp=real_path(tmp_path), lost=LOST)
    assert str(exc.value) == f"{path}: {UNWRITABLE}{why}"
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert list((tmp_path / "a-dir").iterdir()) == []


async def test_a_state_file_in_a_directory_not_writable_fails_the_start(
    autojump_clock, tmp_path, monkeypatch,
):
    # (as the superuser every directory is writable: its refusal is the system's)
    path = tmp_path / "rollout.json"

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(state_file.tempfile, "mkstemp", refused)
    with pytest.raises(ConfigError) as exc:
        async with trioserve.open_runtime(kept(model(CANARY), path)):
            pytest.fail("the runtime started")  # pragma: no cover
    assert str(exc.value) == (
        f"{path}: {UNWRITABLE}no file can be created in its directory "
        f"{real_path(tmp_path)}: "
        f"Permission denied {LOST}make the directory writable, or set "
        "runtime.rollout_state_file to a file in one that is"
    )


def test_serve_says_in_one_line_which_state_file_cannot_be_written(tmp_path, capsys):
    cfg = tmp_path / "prod.toml"
    cfg.write_text(
        f'[runtime]\nrollout_state_file = "{tmp_path}/missing/rollout.json"\n'
        '[models.mlp]\nbackend = "echo"\nversions = ["1", "2"]\n'
        '[models.mlp.rollout]\nstable = "1"\ncanary = "2"\n'
    )
    assert main(["serve", "--config", str(cfg), "--port", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"trioserve: invalid configuration: {cfg}: {tmp_path}/missing/rollout.json: "
        f"{UNWRITABLE}its directory {real_path(tmp_path)}/missing does not exist "
        f"{LOST}create it, "
        "or set runtime.rollout_state_file to a file in a directory that exists\n"
    )


async def test_no_file_yet_is_a_fresh_start_and_no_rollout_reads_none(
    autojump_clock, tmp_path,
):
    path = tmp_path / "rollout.json"
    async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
        state = rt.rollout_state("m")
    plain = ModelConfig(name="p", backend=adder(1))
    path.write_bytes(b"not read: no model has a rollout")
    async with trioserve.open_runtime(config(plain, rollout_state_file=str(path))) as rt:
        assert await rt.infer("p", one(1))
    assert (state["state"], state["restored"]) == ("canary", None)
    assert not path.exists() or path.read_bytes().startswith(b"not read")


async def test_a_write_that_fails_is_logged_and_counted_and_serving_goes_on(
    autojump_clock, tmp_path, caplog,
):
    path = tmp_path / "missing" / "rollout.json"
    (tmp_path / "missing").mkdir()
    caplog.set_level(logging.INFO, logger="trioserve")
    async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
        (tmp_path / "missing").rmdir()  # its directory is gone since the start
        rt.pause_rollout("m")
        await rt._rollout_state.flush()
        failed = rt.rollout_state("m")["state_file"]
        served = await unversioned(rt, 4)
        (tmp_path / "missing").mkdir()
        rt.resume_rollout("m")  # the next decision writes the whole file again
        rt.rollback("m")
        await rt._rollout_state.flush()
        later = rt.rollout_state("m")["state_file"]
    assert failed["write_errors"] == 1
    assert failed["writes"] == 0
    assert failed["last_error"].startswith("FileNotFoundError: ")
    assert served == ["1", "2", "1", "2"]
    assert later["writes"] == 1  # the resume and the rollback: one write
    assert later["write_errors"] == 1
    assert recorded(path)["models"]["m"]["state"] == "rolled_back"
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert errors[0].getMessage().startswith(
        f"rollout state file {path}: cannot write the rollouts' decisions "
        "(FileNotFoundError: ")
    assert errors[0].getMessage().endswith(
        "; serving goes on, the next decision tries again")


async def test_a_write_under_way_holds_up_no_request(autojump_clock, tmp_path, monkeypatch):
    path = tmp_path / "rollout.json"
    writing, release = trio.Event(), threading.Event()
    real = state_file.write_atomic

    def slow_write(p: str, data: bytes, **kwargs) -> None:  # in the writer's worker thread
        trio.from_thread.run_sync(writing.set)
        release.wait(GATE_LIMIT_S)
        real(p, data, **kwargs)

    monkeypatch.setattr(state_file, "write_atomic", slow_write)
    try:
        async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
            rt.rollback("m")
            await writing.wait()
            served = await unversioned(rt, 4)  # while the write is held in its thread
            written_yet = path.exists()
            release.set()
            await rt._rollout_state.flush()
            stats = rt.rollout_state("m")["state_file"]
    finally:
        release.set()
    assert served == ["1"] * 4
    assert not written_yet
    assert stats["writes"] == 1
    assert recorded(path)["models"]["m"]["state"] == "rolled_back"


class ServiceFailed(Exception):
    """The embedding service's own failure, closing the runtime at once."""


async def paused_then_failed(path) -> None:
    async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
        rt.pause_rollout("m")
        raise ServiceFailed


async def test_a_write_abandoned_at_the_close_never_lands_after_it(
    autojump_clock, tmp_path, monkeypatch, caplog,
):
    # A runtime closed by its service's failure (no grace: no flush) writes its last
    # decision then, for FINAL_WRITE_S at most; the disk holds that write in its
    # thread past that. A later runtime writes the file; the first write's thread
    # then ends: it must not replace the later runtime's file with older decisions.
    path = tmp_path / "rollout.json"
    held, release, ended = threading.Event(), threading.Event(), threading.Event()
    real_fsync, real_write = os.fsync, state_file.write_atomic
    blocked: list[int] = []  # the thread held

    def stuck_fsync(fd: int) -> None:
        if not blocked:  # the first write's data, before its rename
            blocked.append(threading.get_ident())
            held.set()
            release.wait(GATE_LIMIT_S)
        real_fsync(fd)

    def watched_write(*args, **kwargs) -> None:
        try:
            real_write(*args, **kwargs)
        finally:
            if threading.get_ident() == blocked[0]:
                ended.set()

    monkeypatch.setattr(os, "fsync", stuck_fsync)
    monkeypatch.setattr(state_file, "write_atomic", watched_write)
    caplog.set_level(logging.ERROR, logger="trioserve")
    try:
        t0 = trio.current_time()
        with pytest.raises(ServiceFailed):
            await paused_then_failed(path)
        closed_after = trio.current_time() - t0
        # its write is held in its thread (the clock may have jumped past its bound
        # before the thread came to its flush: it goes on there regardless)
        assert await trio.to_thread.run_sync(held.wait, GATE_LIMIT_S)
        async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
            assert rt.rollout_state("m")["restored"] is None  # nothing landed
            rt.rollback("m", reason="the later runtime's")
        later = path.read_bytes()
    finally:
        release.set()
    await trio.to_thread.run_sync(ended.wait, GATE_LIMIT_S)
    assert ended.is_set()  # the abandoned write has run to its end
    assert closed_after == pytest.approx(state_file.FINAL_WRITE_S)
    assert path.read_bytes() == later  # left as the later runtime wrote it
    assert recorded(path)["models"]["m"]["reason"] == "the later runtime's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout.json"]  # no temp left
    assert [r.getMessage() for r in caplog.records] == [
        f"rollout state file {path}: the last decisions were not written within 5 s of "
        "the close (that write is abandoned: it will not replace the file)"
    ]


async def test_a_write_under_way_at_the_close_is_abandoned_after_the_bound(
    mock_clock, tmp_path, monkeypatch, caplog,
):
    # A write that the disk holds (in its worker thread) when the close begins holds
    # the close for FINAL_WRITE_S at most: then it is abandoned (logged), the newest
    # decisions are written, and the held write, once the disk answers, replaces
    # nothing. The mock clock passes the bound; nothing jumps it on its own.
    path = tmp_path / "rollout.json"
    writing, release, ended = trio.Event(), threading.Event(), threading.Event()
    real = state_file.write_atomic
    written: list[str] = []  # each write's record, as handed to the disk

    def held_write(p: str, data: bytes, **kwargs) -> None:  # in a worker thread
        written.append(json.loads(data)["models"]["m"]["state"])
        if len(written) > 1:
            real(p, data, **kwargs)
            return
        try:  # the first write: the disk hangs
            trio.from_thread.run_sync(writing.set)
            release.wait(GATE_LIMIT_S)
            real(p, data, **kwargs)
        finally:
            ended.set()

    monkeypatch.setattr(state_file, "write_atomic", held_write)
    caplog.set_level(logging.ERROR, logger="trioserve")
    store = state_file.RolloutStateFile(str(path), {})
    closed = threading.Event()
    scope = trio.CancelScope()

    async def keeping() -> None:
        with scope:
            await store.run()
        closed.set()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keeping)
            await trio.testing.wait_all_tasks_blocked()
            store.put("m", {"state": "paused"})
            await writing.wait()
            store.put("m", {"state": "rolled_back"})  # the newest, not written yet
            t0 = trio.current_time()
            scope.cancel()  # the close, with the first write held by the disk
            await trio.testing.wait_all_tasks_blocked()
            assert not closed.is_set()
            mock_clock.jump(state_file.FINAL_WRITE_S)
            assert await trio.to_thread.run_sync(closed.wait, GATE_LIMIT_S)
            closed_after = trio.current_time() - t0
            assert not ended.is_set()  # the disk still holds the first write
            on_disk = recorded(path)
    finally:
        release.set()
    assert await trio.to_thread.run_sync(ended.wait, GATE_LIMIT_S)
    assert closed_after == pytest.approx(state_file.FINAL_WRITE_S)
    assert written == ["paused", "rolled_back"]
    assert on_disk["models"]["m"] == {"state": "rolled_back"}
    assert recorded(path) == on_disk  # the held write, ended, replaced nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout.json"]  # no temp left
    assert store.statistics()["writes"] == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"rollout state file {path}: a write under way when the runtime closed did not "
        "end within 5 s (it is abandoned: it will not replace the file)"
    ]


def test_a_revoked_ownership_renames_nothing_and_waits_for_a_rename_under_way(tmp_path):
    path = tmp_path / "rollout.json"
    owner = state_file.Ownership()
    state_file.write_atomic(str(path), b"first", owner=owner)
    assert path.read_bytes() == b"first"
    # a rename under way holds the lock: revoke_nowait says so, revoke waits for it
    renaming, release = threading.Event(), threading.Event()
    real_replace = os.replace

    def slow_replace(src, dst):
        renaming.set()
        release.wait(GATE_LIMIT_S)
        real_replace(src, dst)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "replace", slow_replace)
        writer = threading.Thread(
            target=state_file.write_atomic, args=(str(path), b"second"),
            kwargs={"owner": owner},
        )
        writer.start()
        assert renaming.wait(GATE_LIMIT_S)
        assert not owner.revoke_nowait()
        release.set()
        owner.revoke()  # returns once the rename under way is done
        assert path.read_bytes() == b"second"
        writer.join(GATE_LIMIT_S)
    state_file.write_atomic(str(path), b"third", owner=owner)
    assert path.read_bytes() == b"second"  # revoked: nothing replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout.json"]
    assert owner.revoke_nowait()  # (and again: nothing under way)


def test_the_atomic_write_leaves_the_old_file_or_the_new_never_part(tmp_path, monkeypatch):
    path = tmp_path / "rollout.json"
    state_file.write_atomic(str(path), b"old")
    for name in ("fsync", "replace"):
        with monkeypatch.context() as mp:
            def broken(*args, _name=name):
                raise OSError(28, "No space left on device")

            mp.setattr(os, name, broken)
            with pytest.raises(OSError, match="No space left"):
                state_file.write_atomic(str(path), b"new, cut short")
        assert path.read_bytes() == b"old"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout.json"]
    state_file.write_atomic(str(path), b"new")
    assert path.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout.json"]


def test_the_state_file_is_a_checked_config_value():
    limits = trioserve.RuntimeLimits(rollout_state_file=os.path.join("var", "r.json"))
    assert limits.rollout_state_file == os.path.join("var", "r.json")
    from pathlib import Path

    assert trioserve.RuntimeLimits(rollout_state_file=Path("r.json")).rollout_state_file == \
        "r.json"
    for bad in ("", 3, "a\0b"):
        with pytest.raises(ConfigError, match=r"^runtime.rollout_state_file: must be a "
                                              r"file's path \(a non-empty string\), got "):
            trioserve.RuntimeLimits(rollout_state_file=bad)


def test_a_versions_fingerprint_is_its_backend_and_options():
    m = model(CANARY)
    fp = state_file.version_fingerprint
    assert fp(m, "1") == fp(attrs.evolve(m, backend=adder(5)), "1")  # a kind, not an object
    assert fp(m, "2") != fp(m, "3")  # options k 2 and k 3
    assert fp(m, "2") == fp(model(CANARY), "2")
    assert fp(m, "2") != fp(attrs.evolve(m, options={"seed": 1}), "2")  # the model's, merged
    np.testing.assert_equal(len(fp(m, "1")), 16)


async def test_a_load_under_model_control_starts_from_the_decision_recorded(
    autojump_clock, tmp_path,
):
    path = tmp_path / "rollout.json"
    cfg = trioserve.Config(
        models=(model(CANARY, load_at_start=False),),
        tenants=(trioserve.TenantConfig(name="t", default=True),),
        runtime=trioserve.RuntimeLimits(rollout_state_file=str(path)),
        server=trioserve.ServerConfig(model_control="explicit"),
    )
    async with trioserve.open_runtime(cfg) as rt:
        await rt.load_model("m")
        first = rt.rollout_state("m")
        rt.rollback("m", reason="operator")
        await rt.load_model("m")  # a reload
        reloaded = rt.rollout_state("m")
        await rt.unload_model("m")
        await rt.load_model("m")
        again = rt.rollout_state("m")
        seen = await unversioned(rt, 4)
    assert (first["state"], first["restored"]) == ("canary", None)
    for state in (reloaded, again):
        assert (state["state"], state["restored"], state["reason"]) == (
            "rolled_back", "rolled_back", "operator")
    assert seen == ["1"] * 4


@pytest.mark.parametrize("decision", ["promote", "rollback"])
async def test_a_final_decision_at_a_later_step_outlasts_fewer_steps(
    autojump_clock, tmp_path, decision,
):
    # Promoted or rolled back at step 2 of 2; the configuration then has one step.
    # A final decision does not depend on the steps (docs/rollout.md: only a pause's
    # does): it is restored, not a failed start.
    path = tmp_path / "rollout.json"
    async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
        for i in range(8):
            await rt.infer("m", one(i))
        await trio.sleep(10)
        await rt.infer("m", one(0))  # the first step has ended: step 2
        assert rt.rollout_state("m")["step"] == 1
        await rt._rollout_state.flush()  # (the step's record: a write of its own)
        getattr(rt, decision)("m")
    assert recorded(path)["models"]["m"]["step"] == 1
    one_step = {**CANARY, "steps": [0.5]}
    async with trioserve.open_runtime(kept(model(one_step), path)) as rt:
        state = rt.rollout_state("m")
        seen = await unversioned(rt, 4)
    final = "promoted" if decision == "promote" else "rolled_back"
    assert (state["state"], state["restored"], state["step"]) == (final, final, 0)
    assert seen == (["2"] * 4 if decision == "promote" else ["1"] * 4)


async def test_a_state_file_that_is_a_symlink_keeps_its_link(autojump_clock, tmp_path):
    # The file kept elsewhere (a mounted volume), named by a link: a write replaces
    # the file linked to, not the link (which would then go stale: the next start
    # would read the old decisions through it... or, removed, none).
    target = tmp_path / "volume" / "rollout.json"
    target.parent.mkdir()
    link = tmp_path / "rollout.json"
    link.symlink_to(target)
    async with trioserve.open_runtime(kept(model(CANARY), link)) as rt:
        rt.rollback("m", reason="bad")
    assert link.is_symlink()
    assert recorded(target)["models"]["m"]["state"] == "rolled_back"
    assert [p.name for p in target.parent.iterdir()] == ["rollout.json"]  # no temp left


async def test_two_runtimes_of_one_process_cannot_share_a_state_file(
    autojump_clock, tmp_path,
):
    # Each would write the whole file from its own records: the second's write would
    # drop the first's decisions. The second is refused, naming the file.
    path = tmp_path / "rollout.json"
    async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
        with pytest.raises(ConfigError, match=r"rollout.json: rollout state file .*"
                           r"already used by another runtime of this process"):
            async with trioserve.open_runtime(kept(model(CANARY), path)):
                pass  # pragma: no cover
        rt.rollback("m", reason="kept")
    # released when its runtime closes
    async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
        assert rt.rollout_state("m")["restored"] == "rolled_back"


# ---------------------------------------------------------------- a trial's progress
@pytest.fixture
def inline_writes(monkeypatch):
    """The state file written in the event loop's thread, not a worker thread: under
    the mock clock a worker thread's write lets trio time jump (to the next deadline,
    a step's end) while it runs, so that the time a step has served would be
    whatever the jumps made it. The atomic write itself is the same."""
    import types

    async def run_sync(fn, *args, **kwargs):
        await trio.lowlevel.checkpoint()
        return fn(*args)

    shim = types.SimpleNamespace(**vars(trio))
    shim.to_thread = types.SimpleNamespace(run_sync=run_sync)
    monkeypatch.setattr(state_file, "trio", shim)


async def through_first_step(rt) -> None:
    """Step 1 of CANARY (share 0.5, 10 s, 2 answers): ended at 10 s."""
    for i in range(4):
        await rt.infer("m", one(i))
    await trio.sleep(10)
    await rt.infer("m", one(0))
    assert rt.rollout_state("m")["step"] == 1


async def test_a_restart_mid_step_resumes_that_step_with_its_time_served(
    autojump_clock, tmp_path, inline_writes, caplog,
):
    path = tmp_path / "rollout.json"
    caplog.set_level(logging.INFO, logger="trioserve")
    async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
        await through_first_step(rt)
        begun = recorded(path)["models"]["m"]  # written when the step began
        await trio.sleep(6)
        before = rt.rollout_state("m")
    closed = recorded(path)["models"]["m"]  # and at the close
    async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
        t0 = trio.current_time()
        state = rt.rollout_state("m")
        seen = await unversioned(rt, 4)  # the canary's answers: 3 of 4 at 0.75
        await trio.sleep_until(t0 + 4 - 0.25)
        going = rt.rollout_state("m")["state"]
        await trio.sleep_until(t0 + 4)  # the 4 s left of the step's 10
        await trio.testing.wait_all_tasks_blocked()
        ended = rt.rollout_state("m")
    assert {k: begun[k] for k in ("state", "step", "elapsed_s")} == {
        "state": "canary", "step": 1, "elapsed_s": 0.0}
    assert before["step_elapsed_s"] == 6.0
    assert {k: closed[k] for k in ("state", "step", "elapsed_s")} == {
        "state": "canary", "step": 1, "elapsed_s": 6.0}
    assert (state["state"], state["step"], state["share"], state["restored"]) == (
        "canary", 1, 0.75, "canary")
    assert state["step_elapsed_s"] == 6.0
    # the step's min_requests count afresh: its earlier answers were in memory
    assert state["counts"]["2"]["ok"] == 0
    assert seen == ["1", "2", "2", "2"]
    assert going == "canary"
    assert (ended["state"], ended["events"]["promoted"]) == ("promoted", 1)
    said = [r.getMessage() for r in caplog.records if "as recorded in" in r.getMessage()]
    assert said == [
        f"model 'm': rollout: stable '1', canary '2' on trial at step 2 of 2 (0.75), "
        f"6 s of it served as recorded in {path}"
    ]


async def test_paused_time_is_not_counted_in_the_time_served(
    autojump_clock, tmp_path, inline_writes,
):
    path = tmp_path / "rollout.json"
    async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
        await through_first_step(rt)
        await trio.sleep(2)
        rt.pause_rollout("m")
        await trio.sleep(50)
        paused = recorded(path)["models"]["m"]
        rt.resume_rollout("m")
        await rt._rollout_state.flush()
        resumed = recorded(path)["models"]["m"]
        await trio.sleep(3)
    closed = recorded(path)["models"]["m"]
    async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
        state = rt.rollout_state("m")
    assert (paused["state"], paused["elapsed_s"]) == ("paused", 2.0)
    assert (resumed["state"], resumed["elapsed_s"]) == ("canary", 2.0)
    assert (closed["state"], closed["elapsed_s"]) == ("canary", 5.0)
    assert (state["step"], state["step_elapsed_s"]) == (1, 5.0)


async def test_a_trial_recorded_for_other_steps_starts_at_the_first_step(
    autojump_clock, tmp_path, inline_writes, caplog,
):
    path = tmp_path / "rollout.json"
    async with trioserve.open_runtime(kept(model(CANARY), path)) as rt:
        await through_first_step(rt)
    caplog.set_level(logging.INFO, logger="trioserve")
    async with trioserve.open_runtime(
        kept(model({**CANARY, "steps": [0.25, 0.5, 0.75]}), path)
    ) as rt:
        state = rt.rollout_state("m")
    said = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert (state["state"], state["step"], state["restored"]) == ("canary", 0, None)
    assert state["step_elapsed_s"] == 0.0
    assert said == [
        f"model 'm': rollout: the decision recorded in {path} is not used: its canary "
        "was on trial at step 2 of steps [0.5, 0.75], the configuration's steps are now "
        "[0.25, 0.5, 0.75]; it starts afresh"
    ]


async def test_a_file_of_the_earlier_format_still_loads(autojump_clock, tmp_path):
    # written before a trial's progress was kept: no elapsed_s, no trial on record
    path = tmp_path / "rollout.json"
    m = model(CANARY)
    fp = {v: state_file.version_fingerprint(m, v) for v in ("1", "2")}
    path.write_text(json.dumps({"format": 1, "models": {"m": {
        "state": "paused", "stable": "1", "canary": "2", "versions": fp,
        "steps": [0.5, 0.75], "step": 1, "reason": None}}}))
    async with trioserve.open_runtime(kept(m, path)) as rt:
        state = rt.rollout_state("m")
    assert (state["state"], state["step"], state["step_elapsed_s"], state["restored"]) == (
        "paused", 1, 0.0, "paused")


def test_a_write_revoked_before_its_thread_began_creates_no_temporary_file(tmp_path):
    # The close revokes a write cancelled before its thread began, and does not wait
    # for that thread: had it begun anyway, a temporary file would appear beside the
    # state file after the close (then be removed), or be left at the process's exit.
    path = tmp_path / "rollout.json"
    writes = []

    def write(owner):
        writes.append(sorted(p.name for p in tmp_path.iterdir()))
        state_file.write_atomic(str(path), b"{}", owner=owner)

    job = state_file._Write(write, 1)
    assert job.owner.revoke_nowait()
    job.run()  # the thread begins only now
    assert writes == []  # (it was begun, and made a temporary file)
    assert job.done.is_set()
    assert not job.begun
    assert job.error is None
    assert list(tmp_path.iterdir()) == []


def test_a_write_revoked_once_begun_removes_its_temporary_file_and_replaces_nothing(
    tmp_path,
):
    # Begun (its ownership checked) before the revocation: the close sees it begun
    # and waits for it; it renames nothing and leaves no temporary file.
    path = tmp_path / "rollout.json"
    path.write_bytes(b"old")
    seen = []

    def write(owner):
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        assert owner.revoke_nowait()  # revoked as it writes
        state_file.write_atomic(str(path), b"new", owner=owner)

    job = state_file._Write(write, 1)
    job.run()
    assert job.begun
    assert job.done.is_set()
    assert job.error is None
    assert seen == [["rollout.json"]]
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["rollout.json"]
