"""Compressed request bodies: inflated in bounded steps with checkpoints between them,
the size limit enforced as the output grows, the caller authenticated once."""

from __future__ import annotations

import gzip
import itertools
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


# ---- a gzip body of several members (RFC 1952 §2.2), as gzip -d reads it
def members(body: bytes, n: int) -> bytes:
    """``body`` gzipped as ``n`` members, one after another (as ``cat a.gz b.gz``)."""
    cut = [len(body) * i // n for i in range(n + 1)]
    return b"".join(gzip.compress(body[a:b], mtime=0) for a, b in itertools.pairwise(cut))


async def test_a_gzip_body_of_several_members_is_inflated_whole():
    cfg = config(echo_model())
    body = echo_body(600)
    async with serving(cfg) as gw, open_http(gw.url) as http:
        res = await http.request("POST", "/v2/models/echo/infer", members(body, 2),
                                 headers=[("Content-Encoding", "gzip")])
    # it was 400 "the body is not valid gzip data: it ends early or late"
    assert res.status == 200, res.body
    assert res.json()["outputs"][0]["data"] == [1.5, 2.5]
    assert gzip.decompress(members(body, 2)) == body  # as Python's reader takes it
    for n in (3, 64):
        assert await decode_body(members(body, n), b"x-gzip", MIB) == body


async def test_the_members_are_inflated_in_bounded_steps_with_checkpoints(steps):
    body = echo_body(3 * MIB + 100)
    assert await decode_body(members(body, 5), b"gzip", 4 * MIB) == body
    step = _inflate.INFLATE_STEP
    full = len(body) // step
    # a step runs on from one member into the next, never past INFLATE_STEP
    assert steps[:full + 1] == [(i * step, min((i + 1) * step, len(body)), i)
                                for i in range(full + 1)]
    # many small members: at most MEMBERS_PER_STEP of them a step
    steps.clear()
    many = _inflate.MEMBERS_PER_STEP * 3 + 1
    small = echo_body(many * 40)
    assert await decode_body(members(small, many), b"gzip", MIB) == small
    assert [n - steps[0][2] for _, _, n in steps] == [0, 1, 2, 3]
    assert steps[-1][1] == len(small)


async def test_the_limit_counts_every_member_and_a_bomb_member_is_stopped_early():
    body = echo_body(MIB)
    # each member under the limit, the two over it
    assert await decode_body(members(body, 2), b"gzip", MIB) == body
    with pytest.raises(BodyTooLarge, match="over 1048575 bytes once decompressed"):
        await decode_body(members(body, 2), b"gzip", MIB - 1)
    # a bomb behind a plain member is refused as it grows, never inflated whole
    bomb = gzip.compress(b"x" * MIB) + gzip.compress(bytes(256 * MIB))
    tracemalloc.start()
    try:
        with pytest.raises(BodyTooLarge, match="over 2097152 bytes once decompressed"):
            await decode_body(bomb, b"gzip", 2 * MIB)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * MIB


@pytest.mark.parametrize(
    ("tail", "error"),
    [(b"junk", r"it ends early or late \(4 bytes after gzip member 2 are not a gzip member\)"),
     (b"\0" * 8 + b"junk", r"it ends early or late \(12 bytes after gzip member 2"),
     (b"\0" * 8 + b"\x1f\x9d", r"it ends early or late \(10 bytes after gzip member 2"),
     (b"\x1f", "it ends early or late$"),  # a member's first byte, and no more
     (gzip.compress(b"x")[:-1], "it ends early or late$"),  # a last member cut short
     (b"\x1f\x8b\x09" + bytes(20), "Error -3 while decompressing data")],
)
async def test_bytes_after_the_members_that_are_not_a_whole_member_are_refused(tail, error):
    body = echo_body(600)
    with pytest.raises(InvalidInput, match=f"not valid gzip data: {error}"):
        await decode_body(members(body, 2) + tail, b"gzip", MIB)
    with pytest.raises(InvalidInput, match=r"ends early or late$"):
        await decode_body(b"", b"gzip", MIB)  # no member at all


async def test_zero_padding_after_the_last_gzip_member_is_skipped():
    # as gzip -d and Python's gzip take it (a tool that pads to a block size): it was
    # 400 "(8 bytes after gzip member 2 are not a gzip member)"
    body = echo_body(600)
    for n, pad in ((1, 1), (2, 8), (3, 512)):
        padded = members(body, n) + bytes(pad)
        assert gzip.decompress(padded) == body
        assert await decode_body(padded, b"gzip", MIB) == body
    # a long padding is read at once, not a byte (nor a member) a step
    padded = members(body, 1) + bytes(4 * MIB)
    with trio.testing.assert_no_checkpoints():
        assert await decode_body(padded, b"gzip", MIB) == body
    # behind the last member the cap allows, and still within the limit
    assert await decode_body(members(body, 64) + bytes(100), b"gzip", 4096) == body
    with pytest.raises(BodyTooLarge):
        await decode_body(members(body, 1) + bytes(8), b"gzip", len(body) - 1)
    # only after a whole member: padding alone, or inside a member, is refused
    with pytest.raises(InvalidInput, match="not valid gzip data"):
        await decode_body(bytes(64), b"gzip", MIB)
    with pytest.raises(InvalidInput, match="incorrect length check"):
        await decode_body(gzip.compress(body)[:-4] + bytes(4), b"gzip", MIB)
    # deflate is one stream: nothing after it, NULs included
    with pytest.raises(InvalidInput, match="not valid deflate data"):
        await decode_body(zlib.compress(body) + bytes(8), b"deflate", MIB)


async def test_zero_padding_between_gzip_members_is_skipped():
    # as Python's gzip takes it (it strips NULs after each member): it was 400 "(N
    # bytes after gzip member 1 are not a gzip member)" while the same NULs after the
    # last member were taken. (``gzip -d`` stops at them: "trailing garbage ignored".)
    body = echo_body(600)
    half = len(body) // 2
    first, second = gzip.compress(body[:half]), gzip.compress(body[half:])
    for pad in (1, 8, 512):
        padded = first + bytes(pad) + second
        assert gzip.decompress(padded) == body
        assert await decode_body(padded, b"gzip", MIB) == body
        padded += bytes(pad)
        assert gzip.decompress(padded) == body
        assert await decode_body(padded, b"gzip", MIB) == body
    # padding after every member, long or short, within the cap on members
    padded = b"".join(gzip.compress(body[i:i + 10]) + bytes(i) for i in range(0, 600, 10))
    assert gzip.decompress(padded) == body
    assert await decode_body(padded, b"gzip", MIB) == body
    with pytest.raises(InvalidInput, match="more than 64 members"):
        await decode_body(members(body, 64) + bytes(3) + members(body, 1), b"gzip", 4096)
    # what follows the padding is still a member or nothing
    with pytest.raises(InvalidInput, match=r"\(6 bytes after gzip member 1 are not"):
        await decode_body(first + bytes(4) + b"no", b"gzip", MIB)
    with pytest.raises(InvalidInput, match=r"ends early or late$"):
        await decode_body(first + bytes(4) + second[:-1], b"gzip", MIB)


async def test_deflate_is_one_stream_and_takes_nothing_after_it():
    body = echo_body(600)
    for packed in (zlib.compress(body) * 2, gzip.compress(body) * 2):
        with pytest.raises(InvalidInput, match="not valid deflate data"):
            await decode_body(packed, b"deflate", MIB)


async def test_a_gzip_body_of_too_many_members_is_refused():
    limit = 128 * 1024  # one member per KiB of the limit: 128
    body = echo_body(1000)
    assert await decode_body(members(body, 128), b"gzip", limit) == body
    with pytest.raises(InvalidInput, match="more than 128 members"):
        await decode_body(members(body, 129), b"gzip", limit)
    # a body of empty members (20 bytes each) is stopped at the cap
    with pytest.raises(InvalidInput, match="more than 16384 members"):
        await decode_body(gzip.compress(b"", mtime=0) * 800_000, b"gzip", 16 * MIB)
    # a small limit still takes MIN_MEMBERS
    assert await decode_body(members(body, 64), b"gzip", 4096) == body
    with pytest.raises(InvalidInput, match="more than 64 members"):
        await decode_body(members(body, 65), b"gzip", 4096)
