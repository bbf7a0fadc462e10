"""What a request is told under explicit model control when its model does not answer
now: a model not served names the models that serve apart from those not loaded (in
every entry point: the embedding API, HTTP infer and metadata, the stream), and a model
loading or unloading says so instead of advising a load."""

from __future__ import annotations

import numpy as np
import pytest
from http_helpers import config, echo_model, serving, v2_input
from runtime_helpers import callable_model, item
from test_model_control import Worker, workers  # noqa: F401  (fixtures)
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
