"""Triton's load with a configuration of its own, over real HTTP on a loopback port:
``POST /v2/repository/models/NAME/load`` with ``{"parameters": {"config": ...}}`` (a
JSON string holding an object, as Triton's, or the object itself); the model's
config, metadata and index say what the copy runs; a load without it goes back to
the table; refusals are 400 and load nothing; ``file:`` parameters stay refused.
The model ``m`` runs in the stand-in worker of test_model_control (trio time)."""

from __future__ import annotations

import attrs
import numpy as np
import orjson
import pytest
import trioserve
from http_helpers import config, echo_model, serving, v2_input
from test_http_model_control import LOAD, call, index, infer, served_config
from test_model_control import Worker, workers  # noqa: F401  (fixture)
from trioserve import CallableBackend, TensorSpec
from trioserve.transport import open_http


def load_body(config) -> bytes:
    return orjson.dumps({"parameters": {"config": config}})


async def shown(gw):
    """What the server says ``m`` runs with: its config's and metadata's
    max_batch_size, and its index entry's state and reason."""
    cfg = (await call(gw, "GET", "/v2/models/m/config")).json()
    meta = (await call(gw, "GET", "/v2/models/m")).json()
    (entry,) = [e for e in await index(gw) if e[0] == "m"]
    return cfg["max_batch_size"], meta["parameters"]["max_batch_size"], entry[1:]


@pytest.mark.parametrize("as_string", [True, False], ids=["string", "object"])
async def test_a_load_with_a_config_runs_it_and_a_load_without_goes_back_to_the_table(
    autojump_clock, workers, as_string  # noqa: F811
):
    """Batches close at max_batch_size only (a long max_wait_ms): 8 requests at once
    run as 4 batches of 2 on the table, 2 of 4 with the load's config."""
    given = {"name": "m", "max_batch_size": 4, "timeout_ms": 30_000}
    table = served_config(load_at_start=True)
    (m, echo) = table.models
    cfg = attrs.evolve(table, models=(attrs.evolve(m, max_wait_ms=10_000), echo))
    async with serving(cfg) as gw:
        assert await shown(gw) == (2, 2, ("READY", ""))
        body = load_body(orjson.dumps(given).decode() if as_string else given)
        res = await call(gw, "POST", LOAD, body)
        assert (res.status, res.body) == (200, b"{}")
        assert await shown(gw) == (4, 4, (
            "READY", "runs the configuration its load gave (changed: max_batch_size, "
            "timeout_ms)"
        ))
        doc = (await call(gw, "GET", "/v2/models/m/config")).json()
        assert doc["parameters"]["timeout_ms"] == {"string_value": "30000"}
        done = len(workers.ran)
        answers = await _eight(gw)
        assert answers == [200] * 8
        assert [len(keys) for _, keys in workers.ran[done:]] == [4, 4]  # batches of 4

        res = await call(gw, "POST", LOAD)
        assert res.status == 200
        assert await shown(gw) == (2, 2, ("READY", ""))
        done = len(workers.ran)
        await _eight(gw)
        assert [len(keys) for _, keys in workers.ran[done:]] == [2, 2, 2, 2]


async def _eight(gw) -> list[int]:
    import trio

    statuses: list[int] = []

    async def one(x):
        statuses.append((await infer(gw, x)).status)

    async with trio.open_nursery() as clients:
        for x in range(8):
            clients.start_soon(one, float(x))
    return statuses


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (load_body('{"max_batch_size": 4'), "repository load request: parameter 'config' is "
         "not valid JSON (a string holding a JSON object of the model's keys): "),
        (load_body("[4]"), "repository load request: parameter 'config' must be a JSON "
         "object of the model's keys (as its [models.NAME] table), or a string holding "
         'one, got "[4]"'),
        (load_body(4), "repository load request: parameter 'config' must be a JSON object "
         "of the model's keys (as its [models.NAME] table), or a string holding one, got 4"),
        (load_body({"cache": False}), "failed to load 'm': models.m.cache: a load's config "
         "cannot change it: the result cache's rules are set when the server starts, for "
         "every copy of the model"),
        (load_body('{"backend": "echo"}'), "failed to load 'm': models.m.backend: a load's "
         "config cannot change it: the backend is what the model is: another backend is "
         "another model"),
        (load_body({"max_batch_size": 0}), "failed to load 'm': models.m.max_batch_size: "
         "must be an integer >= 1, got 0"),
        (load_body({"name": "other"}), "failed to load 'm': models.m.name: a load's config "
         "is for the model the load names ('m'), got 'other'"),
        (orjson.dumps({"parameters": {"file:1/model.pt": "AAAA"}}), "repository load "
         "request: parameter 'file:1/model.pt' is not supported: a model here has no files "
         "to replace (its backend loads what it runs; give the backend's options in "
         "parameter 'config' instead)"),
    ],
    ids=["malformed", "array", "number", "cache", "backend", "bad-value", "name", "file"],
)
async def test_a_refused_load_is_400_and_the_loaded_copy_serves_on(
    autojump_clock, workers, body, error  # noqa: F811
):
    async with serving(served_config(load_at_start=True)) as gw:
        res = await call(gw, "POST", LOAD, body)
        assert res.status == 400
        assert res.json()["error"].startswith(error)
        assert len(workers.made) == 1  # nothing loaded
        assert await shown(gw) == (2, 2, ("READY", ""))
        assert (await infer(gw, 3.0)).outputs()["y"].tolist() == [3.0]


async def test_with_model_control_off_a_load_with_a_config_is_refused_as_ever():
    async with serving(config(echo_model())) as gw:
        res = await call(gw, "POST", "/v2/repository/models/echo/load",
                         load_body({"max_batch_size": 4}))
        assert res.status == 400
        assert "model control is off" in res.json()["error"]


def widened(width: int = 1, scale: float = 1.0) -> CallableBackend:
    """A backend factory whose input ``x`` has ``width`` values: ``y = scale * x``."""
    return CallableBackend(
        lambda items: [{"y": it["x"] * scale} for it in items],
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(width,)),),
        outputs=(TensorSpec(name="y", datatype="FP32", shape=(width,)),),
        execution="inline",
    )


async def test_options_reach_the_model_and_its_metadata_follows_its_tensors(autojump_clock):
    """Options that change the model's tensors: its metadata and the inputs the
    server takes are those of the copy serving."""
    m = trioserve.ModelConfig(name="m", backend=widened, max_wait_ms=0)
    cfg = config(m, server={"model_control": "explicit"})
    two = [v2_input(np.array([1.0, 2.0], np.float32))]
    async with serving(cfg) as gw:
        meta = (await call(gw, "GET", "/v2/models/m")).json()
        assert meta["inputs"][0]["shape"] == [-1, 1]
        async with open_http(gw.url) as http:
            assert (await http.infer("m", two)).status == 400  # one value, not two
        res = await call(gw, "POST", LOAD, load_body('{"options": {"width": 2, "scale": 3}}'))
        assert res.status == 200
        meta = (await call(gw, "GET", "/v2/models/m")).json()
        assert meta["inputs"][0]["shape"] == [-1, 2]
        async with open_http(gw.url) as http:
            res = await http.infer("m", two)
        assert res.status == 200
        assert res.outputs()["y"].tolist() == [3.0, 6.0]
        assert (await call(gw, "POST", LOAD)).status == 200
        meta = (await call(gw, "GET", "/v2/models/m")).json()
        assert meta["inputs"][0]["shape"] == [-1, 1]
