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


def credits_config(rate: float = 1.0):
    """Model ``m`` (loaded at start, batches of 1 s) and a tenant with ``rate``
    credits a second and a burst of 1: a second request of the batch class waits
    for its credits."""
    return trioserve.Config(
        models=(m_model(load_at_start=True),),
        tenants=(trioserve.TenantConfig(name="t", default=True, credit_rate=rate,
                                        credit_burst=1.0),),
        server=trioserve.ServerConfig(model_control="explicit"),
    )


async def test_an_unload_answers_the_requests_waiting_for_credits_at_once(
    autojump_clock, workers  # noqa: F811
):
    """With ``over_quota = "wait"``, requests waiting for their tenant's credits were
    refused by an unload only when their credits came (seconds later): now the
    unload answers them at once, each once, and gives their credits back."""
    answers: dict = {}

    async def one(rt, x):
        try:
            out = await rt.infer("m", item(x), priority="batch")
        except trioserve.TrioserveError as exc:
            answers.setdefault(x, []).append((trio.current_time() - t0, exc))
        else:
            answers.setdefault(x, []).append((trio.current_time() - t0, float(out["y"][0])))

    async with trioserve.open_runtime(credits_config()) as rt:
        t0 = trio.current_time()
        async with trio.open_nursery() as callers:
            for x in (1.0, 2.0, 3.0, 4.0):  # 1 paid; 2, 3 and 4 wait 1, 2 and 3 s
                callers.start_soon(one, rt, x)
                await trio.testing.wait_all_tasks_blocked()  # (in this order)
            assert rt.tenant_statistics()["t"]["credit_waits"] == 3
            await rt.unload_model("m")  # once the request admitted is answered (1 s)
            unloaded_at = trio.current_time() - t0
        assert unloaded_at == 1.0
        assert answers[1.0] == [(1.0, 1.0)]
        for x in (2.0, 3.0, 4.0):
            ((when, exc),) = answers[x]  # one answer each
            assert when == 0.0  # at the unload, not when its credits came
            assert type(exc) is UnknownModel
            assert str(exc) == UNLOADING
        stats = rt.tenant_statistics()["t"]
        # given back as to callers that left while waiting (docs/scheduling.md)
        assert (stats["credits_used"], stats["credits_refunded"]) == (1, 3)


async def test_requests_waiting_for_credits_go_on_through_a_reload_then_an_unload(
    autojump_clock, workers  # noqa: F811
):
    """A reload while requests wait for credits keeps them waiting (the new copy
    answers them once their credits come); an unload after it answers the ones
    still waiting at once."""
    answers: dict = {}

    async def one(rt, x):
        try:
            out = await rt.infer("m", item(x), priority="batch")
        except trioserve.TrioserveError as exc:
            answers[x] = (trio.current_time() - t0, str(exc))
        else:
            answers[x] = (trio.current_time() - t0, float(out["y"][0]))

    async with trioserve.open_runtime(credits_config()) as rt:
        t0 = trio.current_time()
        async with trio.open_nursery() as callers:
            for x in (1.0, 2.0, 3.0, 4.0):  # their credits come at 0, 1, 2 and 3 s
                callers.start_soon(one, rt, x)
                await trio.testing.wait_all_tasks_blocked()  # (in this order)
            workers.weight = 10.0
            await rt.load_model("m")  # a reload: the new copy weighs 10
            assert trio.current_time() - t0 == 0.0
            await trio.sleep(1.5)  # 2's credits came (at 1 s): the new copy runs it
            await rt.unload_model("m")
        assert answers == {
            1.0: (1.0, 1.0),  # the old copy's, queued before the reload
            2.0: (2.0, 20.0),  # handed over to the new copy at 1 s, run 1 s
            3.0: (1.5, UNLOADING),  # still waiting at the unload: answered then
            4.0: (1.5, UNLOADING),
        }


def broken_factory(**options):
    raise RuntimeError("weights server unreachable")


async def test_a_backend_that_cannot_be_made_stops_the_start_even_if_not_loaded_at_start():
    """As docs/model-control.md says (and why): the stand-in of a model not loaded is
    made from its backend, so a factory that raises fails the start, naming it."""
    cfg = trioserve.Config(
        models=(trioserve.ModelConfig(name="big", backend=broken_factory,
                                      load_at_start=False),),
        server=trioserve.ServerConfig(model_control="explicit"),
    )
    with pytest.raises(trioserve.ConfigError, match=(
        r"^models\.big\.backend: broken_factory failed with its options \{\}: "
        r"RuntimeError: weights server unreachable$"
    )):
        async with trioserve.open_runtime(cfg):
            pass  # pragma: no cover
