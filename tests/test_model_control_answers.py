"""What a request is told under explicit model control when its model does not answer
now: a model not served names the models that serve apart from those not loaded (in
every entry point: the embedding API, HTTP infer and metadata, the stream), and a model
loading or unloading says so instead of advising a load."""

from __future__ import annotations

from urllib.parse import quote

import numpy as np
import pytest
import trio
import trio.testing
import trioserve
from http_helpers import config, echo_model, serving, v2_input
from runtime_helpers import callable_model, item
from test_model_control import SlowToStop, Worker, workers  # noqa: F401  (fixtures)
from trioserve import UnknownModel
from trioserve.transport import open_http, open_stream


def explicit(*models, **server):
    return config(*models, server={"model_control": "explicit", **server})


def m_model(name: str = "m", **cfg):
    args = dict(execution="process", max_batch_size=2, max_wait_ms=0, timeout_ms=None,
                load_at_start=False)
    args.update(cfg)
    return callable_model(name, lambda items: items, **args)


async def unknown_everywhere(gw) -> set[str]:
    """The 404's text for model 'nope' from each entry point."""
    texts = set()
    with pytest.raises(UnknownModel) as caught:
        await gw.runtime.infer("nope", item(1.0))
    texts.add(str(caught.value))
    async with open_http(gw.url) as http:
        res = await http.infer("nope", [v2_input(np.full(1, 1.0, np.float32))])
        assert res.status == 404
        texts.add(res.json()["error"])
        res = await http.request("GET", "/v2/models/nope")
        assert res.status == 404
        texts.add(res.json()["error"])
    async with open_stream(gw.url) as stream:
        await stream.send("r", "nope", {"x": np.full((1, 1), 1.0, np.float32)})
        reply = await stream.receive()
        assert reply.status == 404
        texts.add(reply.error)
    return texts


async def test_an_unknown_model_names_only_the_loaded_ones_as_serving(
    autojump_clock, workers  # noqa: F811
):
    async with serving(explicit(m_model(), echo_model())) as gw:
        assert await unknown_everywhere(gw) == {
            "unknown model 'nope'; serving: echo; not loaded: m"
        }
        await gw.runtime.load_model("m")
        assert await unknown_everywhere(gw) == {"unknown model 'nope'; serving: echo, m"}
        await gw.runtime.unload_model("m")
        assert await unknown_everywhere(gw) == {
            "unknown model 'nope'; serving: echo; not loaded: m"
        }
    async with serving(explicit(m_model(), m_model("k"))) as gw:
        assert await unknown_everywhere(gw) == {
            "unknown model 'nope'; serving no model; not loaded: k, m"
        }


async def answers_of(gw, model: str = "m") -> dict[str, tuple]:
    """What each entry point answers a request for ``model`` now: (status or the
    error's type, text, Retry-After)."""
    out = {}
    try:
        await gw.runtime.infer(model, item(1.0))
    except trioserve.TrioserveError as exc:
        out["rt"] = (type(exc).__name__, str(exc), getattr(exc, "retry_after", None))
    async with open_http(gw.url) as http:
        res = await http.infer(model, [v2_input(np.full(1, 1.0, np.float32))])
        out["infer"] = (res.status, res.json()["error"], res.headers.get("retry-after"))
        res = await http.request("GET", f"/v2/models/{quote(model, safe='')}")
        out["metadata"] = (res.status, res.json()["error"], res.headers.get("retry-after"))
    async with open_stream(gw.url) as stream:
        await stream.send("r", model, {"x": np.full((1, 1), 1.0, np.float32)})
        reply = await stream.receive()
        out["stream"] = (reply.status, reply.error, reply.retry_after)
    return out


LOADING = "model 'm' is loading: it serves once its load ends; retry shortly"
UNLOADING = ("model 'm' is unloading: it takes no new requests (those it admitted are "
             "answered)")
NOT_LOADED = ("model 'm' is not loaded (model control is explicit: load it with POST "
              "/v2/repository/models/m/load, or Runtime.load_model)")


async def test_a_model_loading_is_503_to_retry_and_one_unloading_says_so(
    autojump_clock, workers, monkeypatch  # noqa: F811
):
    """Every request for a model loading or unloading was told it was not loaded and
    to load it: one loading is now 503 with Retry-After (as Triton answers a model
    not at its ready state), one unloading 404 saying so; one not loaded is told how
    to load it, as before."""
    async with serving(explicit(m_model(), echo_model())) as gw:
        rt = gw.runtime
        assert await answers_of(gw) == {
            "rt": ("UnknownModel", NOT_LOADED, None),
            "infer": (404, NOT_LOADED, None),
            "metadata": (404, NOT_LOADED, None),
            "stream": (404, NOT_LOADED, None),
        }
        workers.load_s = 50.0
        async with trio.open_nursery() as ops:
            ops.start_soon(rt.load_model, "m")
            await trio.testing.wait_all_tasks_blocked()
            assert rt.model_state("m") == ("LOADING", "loading")
            assert await answers_of(gw) == {
                "rt": ("Overloaded", LOADING, 1.0),
                "infer": (503, LOADING, "1"),
                "metadata": (503, LOADING, "1"),
                "stream": (503, LOADING, 1),
            }
        assert rt.model_state("m") == ("READY", "")

        answers: list = []

        async def one():
            answers.append(await rt.infer("m", item(5.0)))

        async with trio.open_nursery() as ops:
            ops.start_soon(one)  # admitted: it holds the unload for its batch (1 s)
            await trio.testing.wait_all_tasks_blocked()
            ops.start_soon(rt.unload_model, "m")
            await trio.testing.wait_all_tasks_blocked()
            assert rt.model_state("m") == ("UNLOADING", "unloading (requests admitted finish)")
            assert await answers_of(gw) == {
                "rt": ("UnknownModel", UNLOADING, None),
                "infer": (404, UNLOADING, None),
                "metadata": (404, UNLOADING, None),
                "stream": (404, UNLOADING, None),
            }
        assert [float(a["y"][0]) for a in answers] == [5.0]
        assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")
        assert (await answers_of(gw))["infer"] == (404, NOT_LOADED, None)

        # a first load abandoned: unloading until what it started has stopped (its
        # worker takes 2 s to stop)
        import trioserve.actors._batcher

        monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", SlowToStop)
        abandoned: list = []

        async def load():
            try:
                await rt.load_model("m")
            except trioserve.ModelLoadError as exc:
                abandoned.append(str(exc))

        async with trio.open_nursery() as ops:
            ops.start_soon(load)
            await trio.testing.wait_all_tasks_blocked()
            ops.start_soon(rt.unload_model, "m")
            await trio.testing.wait_all_tasks_blocked()
            assert rt.model_state("m") == ("UNLOADING", "unloading (its load abandoned)")
            assert (await answers_of(gw))["infer"] == (404, UNLOADING, None)
        assert len(abandoned) == 1
        assert rt.model_state("m") == ("UNAVAILABLE", "unloaded")
        assert (await answers_of(gw))["infer"] == (404, NOT_LOADED, None)


async def test_the_load_url_in_not_loaded_is_one_to_paste(autojump_clock, workers):  # noqa: F811
    """A model name with a space or other characters gave a URL that was not one:
    the name is percent-encoded, and the URL given loads the model."""
    name = "my model?#%é"
    async with serving(explicit(m_model(name), echo_model())) as gw:
        with pytest.raises(UnknownModel) as caught:
            await gw.runtime.infer(name, item(1.0))
        target = "/v2/repository/models/my%20model%3F%23%25%C3%A9/load"
        assert str(caught.value) == (
            f"model {name!r} is not loaded (model control is explicit: load it with "
            f"POST {target}, or Runtime.load_model)"
        )
        async with open_http(gw.url) as http:
            res = await http.request("POST", target)
            assert (res.status, res.body) == (200, b"{}")
        assert gw.runtime.model_state(name) == ("READY", "")
