"""Compressed answers: Accept-Encoding read as RFC 9110 §12.5.3 says (q-values, ``*``,
identity), gzip or deflate (the zlib format) for answers of MIN_COMPRESS bytes and
more, compressed in bounded steps with checkpoints between them; errors and small
answers go plain; a request without Accept-Encoding is served as before."""

from __future__ import annotations

import gzip
import zlib

import h11
import numpy as np
import orjson
import pytest
import trio
import trioserve
from http_helpers import config, echo_model, serving, v2_input
from runtime_helpers import Recorder, callable_model
from trioserve import CacheConfig, TenantConfig
from trioserve.transport import _coding, _gateway, _http, open_http
from trioserve.transport._coding import (
    COMPRESS_STEP,
    DEFLATE,
    GZIP,
    MIN_COMPRESS,
    encode_body,
    negotiate,
)

INFER = "/v2/models/echo/infer"


def echo_request(n: int, *, binary: bool = False) -> bytes:
    """An echo request whose answer holds ``n`` floats (~9 bytes each as JSON)."""
    doc = {"inputs": [v2_input([i / 7 for i in range(n)])], "id": "r"}
    if binary:
        doc["parameters"] = {"binary_data_output": True}
    return orjson.dumps(doc)


LARGE = echo_request(400)  # an answer of ~3.7 KiB
SMALL = echo_request(4)  # ~120 bytes


def decoded(res) -> bytes:
    coding = res.headers.get("content-encoding")
    if coding == "gzip":
        return gzip.decompress(res.body)
    if coding == "deflate":
        return zlib.decompress(res.body)  # the zlib format, as tritonclient reads it
    assert coding is None, coding
    return res.body


@pytest.mark.parametrize(
    ("accept", "verdict"),
    [
        ("gzip", (GZIP, True)),
        ("deflate", (DEFLATE, True)),
        ("x-gzip", (GZIP, True)),
        ("deflate, gzip", (GZIP, True)),  # a tie: gzip
        ("gzip;q=0.5, deflate;q=0.8", (DEFLATE, True)),
        ("GZIP ; Q=0.7", (GZIP, True)),
        ("gzip;q=0", (None, True)),
        ("gzip;q=0, deflate", (DEFLATE, True)),
        ("*", (GZIP, True)),
        ("*;q=0.5", (GZIP, True)),
        ("*;q=0.3, gzip;q=0", (DEFLATE, True)),
        ("identity", (None, True)),  # only identity listed: gzip is not acceptable
        ("gzip;q=0.5, identity", (None, True)),  # identity weighs more
        ("gzip, identity;q=0", (GZIP, False)),
        ("gzip, *;q=0", (GZIP, False)),
        ("*;q=0", (None, True)),  # nothing acceptable: plain all the same
        ("identity;q=0", (None, True)),
        ("br, zstd", (None, True)),  # codings the server does not have
        ("", (None, True)),  # an empty value asks for no coding
        ("gzip;q=2", (None, True)),  # malformed weights: the element is ignored
        ("gzip;q=0.0001, deflate;q=abc", (None, True)),
        ("gzip;q=abc, deflate", (DEFLATE, True)),
    ],
)
def test_accept_encoding_is_negotiated_as_rfc_9110_says(accept, verdict):
    assert negotiate(accept.encode()) == verdict


@pytest.fixture
def steps(monkeypatch):
    """Each step of a compression: (input done before, after, checkpoints before it)."""
    seen: list[tuple[int, int, int]] = []
    checkpoints = 0
    step = _coding._Compressor.step

    def spy(self):
        before = self._done
        try:
            return step(self)
        finally:
            seen.append((before, self._done, checkpoints))

    async def counted():
        nonlocal checkpoints
        checkpoints += 1
        await trio.lowlevel.checkpoint()

    monkeypatch.setattr(_coding._Compressor, "step", spy)
    monkeypatch.setattr(_coding, "_checkpoint", counted)
    return seen


async def test_an_answer_of_one_step_is_compressed_without_a_checkpoint(steps):
    body = LARGE * 4
    assert gzip.decompress(await encode_body(body, GZIP)) == body
    assert steps == [(0, len(body), 0)]


@pytest.mark.parametrize("coding", [GZIP, DEFLATE])
async def test_a_large_answer_is_compressed_in_bounded_steps_with_checkpoints(steps, coding):
    body = np.random.default_rng(1).standard_normal(200_000).tobytes()[: 3 * COMPRESS_STEP + 100]
    packed = await encode_body(body, coding)
    assert (gzip.decompress if coding == GZIP else zlib.decompress)(packed) == body
    # at most COMPRESS_STEP of input a step, a checkpoint between each two
    assert steps == [
        (i * COMPRESS_STEP, min((i + 1) * COMPRESS_STEP, len(body)), i) for i in range(4)
    ]


async def test_other_tasks_run_between_the_steps_of_a_large_compression(monkeypatch):
    """Another task always ready to run gets a turn at least every other step (trio
    runs each batch of ready tasks in either order, so it may run just before one
    step and just after the next): the loop is never held longer than two steps."""
    body = orjson.dumps([i / 7 for i in range(120_000)])  # ~2.4 MB: many steps
    log: list[str] = []
    step = _coding._Compressor.step

    def logged(self):
        log.append("s")
        return step(self)

    monkeypatch.setattr(_coding._Compressor, "step", logged)
    stop = False

    async def other_connection():
        while not stop:
            log.append("t")
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_connection)  # always ready: it ticks at each turn
        packed = await encode_body(body, GZIP)
        stop = True
    assert gzip.decompress(packed) == body
    steps = "".join(log)
    assert steps.count("s") == -(-len(body) // COMPRESS_STEP) > 30
    assert "sss" not in steps.lstrip("s")  # once started, it ran at least every other step
    assert steps.count("t") >= steps.count("s") // 2


@pytest.mark.parametrize(
    ("accept", "coding"),
    [
        ("gzip", "gzip"),
        ("deflate", "deflate"),
        ("gzip;q=0", None),
        ("gzip;q=0, deflate;q=0.1", "deflate"),
        ("*;q=0.5", "gzip"),
        ("identity", None),
        ("br, compress", None),
        ("identity;q=0.9, deflate", "deflate"),
    ],
)
async def test_accept_encoding_over_http(accept, coding):
    async with serving(config(echo_model())) as gw, open_http(gw.url) as http:
        plain = await http.request("POST", INFER, LARGE)
        res = await http.request("POST", INFER, LARGE, headers=[("Accept-Encoding", accept)])
    assert plain.status == res.status == 200
    assert "content-encoding" not in plain.headers
    assert "vary" not in plain.headers  # no Accept-Encoding: the answer as before
    assert len(plain.body) > MIN_COMPRESS
    assert res.headers.get("content-encoding") == coding
    assert res.headers["vary"] == "accept-encoding"
    assert int(res.headers["content-length"]) == len(res.body)
    if coding is not None:
        assert len(res.body) < len(plain.body) / 2
    assert decoded(res) == plain.body


async def test_small_answers_go_plain_unless_plain_is_refused():
    async with serving(config(echo_model())) as gw, open_http(gw.url) as http:
        plain = await http.request("POST", INFER, SMALL)
        small = await http.request("POST", INFER, SMALL, headers=[("Accept-Encoding", "gzip")])
        forced = await http.request(
            "POST", INFER, SMALL, headers=[("Accept-Encoding", "gzip, identity;q=0")]
        )
    assert len(plain.body) < MIN_COMPRESS
    assert "content-encoding" not in small.headers
    assert small.headers["vary"] == "accept-encoding"
    assert small.body == plain.body
    assert forced.headers["content-encoding"] == "gzip"
    assert gzip.decompress(forced.body) == plain.body


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
async def test_a_binary_answer_keeps_the_json_length_before_compression(coding):
    """Inference-Header-Content-Length counts the JSON part of the decompressed body
    (as Triton sends it and tritonclient reads it)."""
    body = echo_request(600, binary=True)
    async with serving(config(echo_model())) as gw, open_http(gw.url) as http:
        plain = await http.request("POST", INFER, body)
        res = await http.request("POST", INFER, body, headers=[("Accept-Encoding", coding)])
    assert res.headers["content-encoding"] == coding
    hlen = res.headers["inference-header-content-length"]
    assert hlen == plain.headers["inference-header-content-length"]
    raw = decoded(res)
    assert raw == plain.body
    head = orjson.loads(raw[: int(hlen)])
    assert head["outputs"][0]["parameters"]["binary_data_size"] == 600 * 4
    np.testing.assert_array_equal(
        np.frombuffer(raw[int(hlen):], np.float32),
        np.array([i / 7 for i in range(600)], np.float32),
    )


async def test_one_keep_alive_connection_mixes_compressed_and_plain_answers():
    async with serving(config(echo_model())) as gw, open_http(gw.url) as http:
        sent = [None, "gzip", None, "deflate", "gzip", "gzip;q=0", None]
        bodies = [LARGE, LARGE, SMALL, LARGE, SMALL, LARGE, LARGE]
        answers = []
        for accept, body in zip(sent, bodies, strict=True):
            headers = [] if accept is None else [("Accept-Encoding", accept)]
            answers.append(await http.request("POST", INFER, body, headers=headers))
            assert gw.statistics().connections == 1  # the same connection throughout
    codings = [a.headers.get("content-encoding") for a in answers]
    assert codings == [None, "gzip", None, "deflate", None, None, None]
    assert ["vary" in a.headers for a in answers] == [False, True, False, True, True, True, False]
    for a, body in zip(answers, bodies, strict=True):
        sent_data = np.float32(orjson.loads(body)["inputs"][0]["data"])
        np.testing.assert_array_equal(
            np.float32(orjson.loads(decoded(a))["outputs"][0]["data"]), sent_data
        )


def _request(body: bytes, accept: str | None) -> bytes:
    head = [b"POST %b HTTP/1.1" % INFER.encode(), b"Host: t", b"Content-Length: %d" % len(body)]
    if accept is not None:
        head.append(b"Accept-Encoding: " + accept.encode())
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def _answers(stream: trio.SocketStream, n: int) -> list[tuple[h11.Response, bytes]]:
    """The next ``n`` answers on ``stream`` (h11 reads them; the requests were sent
    raw, so h11's client state is given a request of its own for each)."""
    h = h11.Connection(h11.CLIENT)
    out: list[tuple[h11.Response, bytes]] = []
    response = None
    chunks: list[bytes] = []
    while len(out) < n:
        if h.our_state is h11.IDLE:
            h.send(h11.Request(method="POST", target=INFER,
                               headers=[("host", "t"), ("content-length", "0")]))
            h.send(h11.EndOfMessage())
        event = h.next_event()
        if event is h11.NEED_DATA:
            h.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Response):
            response, chunks = event, []
        elif isinstance(event, h11.Data):
            chunks.append(event.data)
        elif isinstance(event, h11.EndOfMessage):
            out.append((response, b"".join(chunks)))
            if len(out) < n:
                h.start_next_cycle()
    return out


async def test_a_pipelined_pair_gets_a_compressed_and_a_plain_answer_in_order():
    async with serving(config(echo_model())) as gw, open_http(gw.url) as http:
        plain = (await http.request("POST", INFER, LARGE)).body
        stream = await trio.open_tcp_stream(*gw.addresses[0])
        async with stream:
            await stream.send_all(_request(LARGE, "gzip") + _request(LARGE, None))
            (first, packed), (second, body) = await _answers(stream, 2)
    assert first.status_code == second.status_code == 200
    assert dict(first.headers)[b"content-encoding"] == b"gzip"
    assert gzip.decompress(packed) == plain
    assert b"content-encoding" not in dict(second.headers)
    assert body == plain


async def test_the_fast_path_takes_requests_with_and_without_accept_encoding(monkeypatch):
    """Both are parsed by llhttp; without Accept-Encoding nothing is negotiated."""
    parsed: list[bool] = []
    encoded: list[bytes] = []
    parse, encode = _http._data_plane_request, _gateway.encode_answer

    def parse_spy(buf, max_body):
        out = parse(buf, max_body)
        parsed.append(out is not None)
        return out

    async def encode_spy(answer, accept):
        encoded.append(accept)
        return await encode(answer, accept)

    monkeypatch.setattr(_http, "_data_plane_request", parse_spy)
    monkeypatch.setattr(_gateway, "encode_answer", encode_spy)
    async with serving(config(echo_model())) as gw:
        stream = await trio.open_tcp_stream(*gw.addresses[0])
        async with stream:
            for accept in (None, "gzip", None):
                await stream.send_all(_request(LARGE, accept))
                ((response, _),) = await _answers(stream, 1)
                assert response.status_code == 200
            # two Accept-Encoding lines are one list
            await stream.send_all(_request(LARGE, "br").replace(
                b"\r\n\r\n", b"\r\nAccept-Encoding: deflate\r\n\r\n", 1))
            ((response, body),) = await _answers(stream, 1)
    assert parsed == [True] * 4
    assert encoded == [b"gzip", b"br, deflate"]
    assert dict(response.headers)[b"content-encoding"] == b"deflate"
    assert orjson.loads(zlib.decompress(body))["id"] == "r"


async def test_the_h11_path_compresses_too_and_closes_after():
    """A request h11 parses (``Connection: close``) gets its answer compressed."""
    async with serving(config(echo_model())) as gw:
        stream = await trio.open_tcp_stream(*gw.addresses[0])
        async with stream:
            await stream.send_all(_request(LARGE, "gzip").replace(
                b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1))
            ((response, body),) = await _answers(stream, 1)
    headers = dict(response.headers)
    assert headers[b"content-encoding"] == b"gzip"
    assert headers[b"connection"] == b"close"
    assert orjson.loads(gzip.decompress(body))["id"] == "r"


async def test_the_edge_keeps_each_coding_of_an_answer_apart(monkeypatch):
    """The edge cache keeps an answer as it was sent: a gzip client's repeat is a hit
    that is not compressed again, a plain client's is the plain answer, and each form
    is an entry charged for its own bytes."""
    compressed: list[bytes] = []
    encode = _coding.encode_body

    async def encode_spy(body, coding):
        compressed.append(coding)
        return await encode(body, coding)

    monkeypatch.setattr(_coding, "encode_body", encode_spy)
    model = Recorder(timed=False)
    cfg = trioserve.Config(
        models=(callable_model("m", model),), tenants=(TenantConfig(name="A", default=True),),
        cache=CacheConfig(capacity_bytes=1 << 20),
    )
    body = orjson.dumps({"inputs": [v2_input([1.0 + i / 7 for i in range(400)])]})
    path = "/v2/models/m/infer"
    gz = [("Accept-Encoding", "gzip")]
    async with serving(cfg) as gw, open_http(gw.url) as http:
        first = await http.request("POST", path, body)
        entries = gw.runtime.cache_statistics()["entries"]
        packed = [await http.request("POST", path, body, headers=gz) for _ in range(3)]
        assert gw.runtime.cache_statistics()["entries"] == entries + 1
        flate = await http.request("POST", path, body, headers=[("Accept-Encoding", "deflate")])
        again = await http.request("POST", path, body)
        stats = gw.runtime.cache_statistics()
    assert len(model.batches) == 1  # every other answer came from the cache
    assert compressed == [GZIP, DEFLATE]  # once a coding, not once a request
    for res in packed:
        assert res.headers["content-encoding"] == "gzip"
        assert res.headers["vary"] == "accept-encoding"
        assert gzip.decompress(res.body) == first.body
    assert packed[1].body == packed[0].body
    assert zlib.decompress(flate.body) == first.body
    assert again.body == first.body
    assert again.headers == first.headers  # neither Content-Encoding nor Vary
    assert stats["entries"] == entries + 2
    assert stats["bytes_used"] <= 1 << 20


async def test_a_kept_small_answer_keeps_the_form_each_accept_encoding_asks_for():
    """A small answer goes plain to "gzip" but compressed to a client that refuses
    identity, and an answer to any Accept-Encoding says Vary while one to none does
    not: four forms of one body, none handed to a client that asked for another."""
    cfg = trioserve.Config(
        models=(callable_model("m", Recorder(timed=False)),),
        tenants=(TenantConfig(name="A", default=True),),
        cache=CacheConfig(capacity_bytes=1 << 20),
    )
    body = orjson.dumps({"inputs": [v2_input([1.5, 2.5])]})
    asks = [None, "gzip", "gzip, identity;q=0", "br"]
    async with serving(cfg) as gw, open_http(gw.url) as http:
        rounds = []
        for _ in range(2):  # the second round is all hits
            rounds.append([
                await http.request(
                    "POST", "/v2/models/m/infer", body,
                    headers=[] if a is None else [("Accept-Encoding", a)])
                for a in asks
            ])
    for none, gz, forced, br in rounds:
        assert "vary" not in none.headers
        assert "content-encoding" not in none.headers
        assert len(none.body) < MIN_COMPRESS
        assert gz.headers["vary"] == br.headers["vary"] == "accept-encoding"
        assert "content-encoding" not in gz.headers
        assert "content-encoding" not in br.headers
        assert gz.body == br.body == none.body
        assert forced.headers["content-encoding"] == "gzip"
        assert gzip.decompress(forced.body) == none.body


async def test_an_idempotent_replay_takes_the_coding_its_retry_asks_for():
    """The idempotency store keeps the plain answer; each replay is encoded as its own
    Accept-Encoding says."""
    async with serving(config(echo_model())) as gw, open_http(gw.url) as http:
        key = ("Idempotency-Key", "k1")
        plain = await http.request("POST", INFER, LARGE, headers=[key])
        packed = await http.request(
            "POST", INFER, LARGE, headers=[key, ("Accept-Encoding", "gzip")])
        flate = await http.request(
            "POST", INFER, LARGE, headers=[key, ("Accept-Encoding", "deflate")])
        again = await http.request("POST", INFER, LARGE, headers=[key])
    assert "content-encoding" not in plain.headers
    assert packed.headers["content-encoding"] == "gzip"
    assert gzip.decompress(packed.body) == plain.body
    assert flate.headers["content-encoding"] == "deflate"
    assert zlib.decompress(flate.body) == plain.body
    assert again.body == plain.body
    assert "content-encoding" not in again.headers


async def test_error_answers_stay_plain():
    async with serving(config(echo_model())) as gw, open_http(gw.url) as http:
        headers = [("Accept-Encoding", "gzip, identity;q=0")]
        unknown = await http.request("POST", "/v2/models/nope/infer", LARGE, headers=headers)
        bad = await http.request("POST", INFER, b"{" + b" " * 4096, headers=headers)
    for res in (unknown, bad):
        assert res.status in (400, 404)
        assert "content-encoding" not in res.headers
        assert "error" in res.json()


async def test_control_plane_answers_are_compressed_too():
    async with serving(config(echo_model())) as gw, open_http(gw.url) as http:
        await http.request("POST", INFER, SMALL)
        metrics = await http.request("GET", "/metrics", b"", headers=[("Accept-Encoding", "gzip")])
        plain = await http.request("GET", "/metrics")
        meta = await http.request("GET", "/v2/models/echo", b"",
                                  headers=[("Accept-Encoding", "gzip")])
    assert metrics.status == 200
    assert metrics.headers["content-encoding"] == "gzip"
    text = gzip.decompress(metrics.body).decode()
    assert "trioserve_requests_total" in text
    assert "content-encoding" not in plain.headers
    assert len(plain.body) > MIN_COMPRESS
    assert meta.status == 200
    assert "content-encoding" not in meta.headers  # a small answer
    assert meta.json()["name"] == "echo"
