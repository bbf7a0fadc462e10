"""Compressed request bodies: inflated in bounded steps with checkpoints between them,
the size limit enforced as the output grows, the caller authenticated once."""

from __future__ import annotations

import gzip
import tracemalloc
import zlib

import orjson
import pytest
import trio
import trioserve
from http_helpers import config, echo_model, serving, v2_input
from trioserve import InvalidInput
from trioserve.transport import _inflate, open_http
from trioserve.transport._inflate import BodyTooLarge, decode_body

MIB = 1024 * 1024


def echo_body(n: int) -> bytes:
    """An echo request padded with spaces to ``n`` bytes."""
    body = orjson.dumps({"inputs": [v2_input([[1.5, 2.5]])], "id": "z"})
    return body + b" " * (n - len(body))


@pytest.fixture
def steps(monkeypatch):
    """Each step of an inflate: (output before, output after, checkpoints before it)."""
    seen: list[tuple[int, int, int]] = []
    checkpoints = 0
    step = _inflate._Inflater.step

    def spy(self):
        before = self._size
        try:
            return step(self)
        finally:
            seen.append((before, self._size, checkpoints))

    async def counted():
        nonlocal checkpoints
        checkpoints += 1
        await trio.lowlevel.checkpoint()

    monkeypatch.setattr(_inflate._Inflater, "step", spy)
    monkeypatch.setattr(_inflate, "_checkpoint", counted)
    return seen


async def test_a_small_body_is_inflated_in_one_step_without_a_checkpoint(steps):
    body = echo_body(4096)
    assert await decode_body(gzip.compress(body), b"gzip", MIB) == body
    assert steps == [(0, 4096, 0)]


@pytest.mark.parametrize("coding", [b"gzip", b"deflate"])
async def test_a_large_body_is_inflated_in_bounded_steps_with_checkpoints(steps, coding):
    body = echo_body(3 * MIB + 100)
    packed = gzip.compress(body) if coding == b"gzip" else zlib.compress(body)
    assert await decode_body(packed, coding, 4 * MIB) == body
    step = _inflate.INFLATE_STEP
    full = len(body) // step
    # each step at most INFLATE_STEP of output, a checkpoint between each two
    assert steps[:full + 1] == [(i * step, min((i + 1) * step, len(body)), i)
                                for i in range(full + 1)]
    assert all(after == len(body) for _, after, _ in steps[full + 1:])


async def test_the_decompressed_limit_is_enforced_as_the_output_grows():
    bomb = gzip.compress(bytes(256 * MIB))  # ~250 KiB that inflate to 256 MiB
    tracemalloc.start()
    try:
        with pytest.raises(BodyTooLarge, match="over 2097152 bytes once decompressed"):
            await decode_body(bomb, b"gzip", 2 * MIB)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * MIB  # at most the limit and one step, never the whole bomb


async def test_exactly_the_limit_is_taken_and_corrupt_data_refused():
    body = echo_body(2 * MIB)
    assert await decode_body(gzip.compress(body), b"gzip", len(body)) == body
    with pytest.raises(BodyTooLarge):
        await decode_body(gzip.compress(body), b"gzip", len(body) - 1)
    with pytest.raises(InvalidInput, match="ends early or late"):
        await decode_body(gzip.compress(body)[:-100], b"gzip", 4 * MIB)
    with pytest.raises(InvalidInput, match="ends early or late"):
        await decode_body(gzip.compress(body) + b"junk", b"gzip", 4 * MIB)


class CountingAuth:
    def __init__(self, auth):
        self.auth = auth
        self.calls = 0

    def tenant(self, authorization):
        self.calls += 1
        return self.auth.tenant(authorization)


@pytest.mark.parametrize("idempotency_key", [None, "k1"])
@pytest.mark.parametrize("size", [4096, 2 * MIB])
async def test_a_compressed_request_is_authenticated_once(idempotency_key, size):
    tenants = (trioserve.TenantConfig(name="acme", api_keys=("key",)),)
    cfg = config(echo_model(), tenants=tenants, server={"max_body_bytes": 4 * MIB})
    async with serving(cfg) as gw:
        gw.auth = counting = CountingAuth(gw.auth)
        headers = [("Content-Encoding", "gzip"), ("Authorization", "Bearer key")]
        if idempotency_key:
            headers.append(("Idempotency-Key", idempotency_key))
        async with open_http(gw.url) as http:
            res = await http.request("POST", "/v2/models/echo/infer",
                                     gzip.compress(echo_body(size)), headers=headers)
        assert res.status == 200, res.body
        assert res.json()["outputs"][0]["data"] == [1.5, 2.5]
        assert counting.calls == 1
        assert gw.requests[("echo", "acme", 200)] == 1


# ---- the control plane's bodies are decoded as an infer body is
@pytest.mark.parametrize(
    ("coding", "encode"),
    [("gzip", gzip.compress), ("deflate", zlib.compress), ("identity", bytes),
     ("gzip, deflate", lambda b: zlib.compress(gzip.compress(b)))],
)
async def test_a_compressed_repository_index_request_is_decoded(coding, encode):
    async with serving(config(echo_model())) as gw, open_http(gw.url) as http:
        plain = await http.request("POST", "/v2/repository/index", b'{"ready": true}')
        res = await http.request("POST", "/v2/repository/index",
                                 encode(b'{"ready": true}'),
                                 headers=[("Content-Encoding", coding)])
    # it was parsed as JSON as it came: 400 "invalid JSON" for the compressed bytes
    assert res.status == 200, res.body
    assert res.json() == plain.json() == [
        {"name": "echo", "version": "1", "state": "READY", "reason": ""}
    ]


async def test_a_control_plane_body_that_cannot_be_decoded_is_refused_as_an_infer_body_is():
    cfg = config(echo_model(), server={"max_body_bytes": 65536})
    async with serving(cfg) as gw, open_http(gw.url) as http:
        async def index(body: bytes, coding: str):
            res = await http.request("POST", "/v2/repository/index", body,
                                     headers=[("Content-Encoding", coding)])
            return res.status, res.json()["error"], res.headers.get("accept-encoding")

        unknown = await index(b'{"ready": true}', "br")
        corrupt = await index(b"not gzip", "gzip")
        bomb = await index(gzip.compress(b" " * (1024 * 1024)), "gzip")
    # a coding nobody decodes was read as if plain (200)
    assert unknown == (
        415, "Content-Encoding 'br' is not supported; send gzip, deflate or identity",
        "gzip, deflate",
    )
    assert corrupt[:2] == (400, "the body is not valid gzip data: Error -3 while "
                                "decompressing data: incorrect header check")
    assert bomb[:2] == (413, "request body over 65536 bytes once decompressed")
