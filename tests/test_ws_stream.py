"""The /v2/stream WebSocket's messages and answers: many requests on one socket,
answered out of order and tagged by id; bad messages answered with error frames; the
protocol's frames (pings, fragments, protocol errors)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import trio
import trioserve
from http_helpers import (
    Gate,
    _client_frame,
    _events_until,
    _infer_frame,
    _raw_client,
    _raw_handshake,
    config,
    echo_model,
    f32,
    held_model,
    mlp_model,
    serving,
    settle,
)
from runtime_helpers import callable_model
from trio_websocket import ConnectionClosed
from trioserve import InvalidInput, UnknownModel
from trioserve.transport import open_stream
from trioserve.transport._stream_client import stream_url


async def test_each_answer_is_tagged_with_its_requests_id(mlp_input):
    async with serving(config(mlp_model(), echo_model())) as gw:
        xs = {f"r{i}": mlp_input * i for i in range(20)}
        want = {k: (await gw.runtime.infer("mlp", x))["y"] for k, x in xs.items()}
        async with open_stream(gw.url) as stream:
            for rid, x in xs.items():
                await stream.send(rid, "mlp", {"x": x[None]})
            replies = [await stream.receive() for _ in xs]
    assert sorted(r.id for r in replies) == sorted(xs)
    for r in replies:
        assert r.error is None
        assert r.model_name == "mlp"
        np.testing.assert_allclose(r.outputs["y"], want[r.id][None], rtol=1e-5, atol=1e-6)


async def test_a_large_batch_message_is_split_and_answered_like_a_small_one():
    # Messages of 16 KiB and more are decoded another way first (transport/_request_json.py).
    x = np.random.default_rng(5).standard_normal((24, 256)).astype(np.float32)
    async with serving(config(mlp_model())) as gw:
        want = np.stack([(await gw.runtime.infer("mlp", row))["y"] for row in x])
        async with open_stream(gw.url) as stream:
            await stream.send("big", "mlp", {"x": x})
            bad = x.tolist()
            bad[3][9] = None
            await stream.send_raw(json.dumps(
                {"id": "bad", "model": "mlp",
                 "inputs": [{"name": "x", "shape": [24, 256], "datatype": "FP32", "data": bad}]}
            ))
            replies = {r.id: r for r in [await stream.receive(), await stream.receive()]}
    assert replies["big"].error is None
    np.testing.assert_allclose(replies["big"].outputs["y"], want, rtol=1e-5, atol=1e-6)
    assert "got null (element 777) in 'data'" in replies["bad"].error  # 3 * 256 + 9


async def test_ragged_rows_are_read_as_their_values_in_order_on_the_stream():
    """As over HTTP (and as Triton reads them): rows of unequal lengths holding the
    shape's count of values, in a small message and in one of 16 KiB and more; a
    count other than the shape's is an error frame saying so."""
    x = np.random.default_rng(9).standard_normal((24, 256)).astype(np.float32)
    flat = x.reshape(-1).tolist()

    def message(rid, rows, shape):
        return json.dumps({"id": rid, "model": "mlp", "inputs": [
            {"name": "x", "shape": shape, "datatype": "FP32", "data": rows}]})

    small = [flat[:10], flat[10:256]]
    large = [flat[:300], [], flat[300:]]
    assert len(message("large", large, [24, 256])) >= 16 * 1024
    async with serving(config(mlp_model())) as gw:
        want = np.stack([(await gw.runtime.infer("mlp", row))["y"] for row in x])
        async with open_stream(gw.url) as stream:
            await stream.send_raw(message("small", small, [1, 256]))
            await stream.send_raw(message("large", large, [24, 256]))
            await stream.send_raw(message("short", [flat[:10], flat[10:255]], [1, 256]))
            replies = {r.id: r for r in [await stream.receive() for _ in range(3)]}
    np.testing.assert_allclose(replies["small"].unwrap()["y"], want[:1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(replies["large"].unwrap()["y"], want, rtol=1e-5, atol=1e-6)
    assert (replies["short"].status, replies["short"].error) == (
        400, "input 'x': shape [1, 256] holds 256 values, 'data' has 255")


async def test_a_slow_request_is_answered_after_a_later_fast_one():
    # x[0] of the sleep model is an extra delay in ms; two replicas run both at once.
    sleep = trioserve.ModelConfig(name="sleep", backend="sleep", execution="thread",
                                  replicas=2, max_batch_size=1, max_wait_ms=0.0)
    async with serving(config(sleep)) as gw, open_stream(gw.url) as stream:
        await stream.send("slow", "sleep", {"x": f32(300, 1)})
        await stream.send("fast", "sleep", {"x": f32(0, 2)})
        first = await stream.receive()
        second = await stream.receive()
    assert (first.id, second.id) == ("fast", "slow")
    np.testing.assert_array_equal(first.outputs["y"], [0, 2])
    np.testing.assert_array_equal(second.outputs["y"], [300, 1])


async def test_infer_matches_answers_to_concurrent_callers():
    async with serving(config(echo_model())) as gw, open_stream(gw.url) as stream:
        results = {}

        async def caller(i: int) -> None:
            results[i] = (await stream.infer("echo", {"x": f32(i, i + 1)}))["x"]

        async with trio.open_nursery() as nursery:
            for i in range(100):
                nursery.start_soon(caller, i)
    assert {i: r.tolist() for i, r in results.items()} == {i: [i, i + 1] for i in range(100)}


async def test_a_send_id_in_infers_id_space_is_refused_and_infer_gets_its_own_answer():
    """send("c0", ...) and infer()'s first request (tagged "c0") shared an id: the
    send's answer, arriving first, went to the infer caller, and the infer's own to
    receive(). Infer's ids now begin with a reserved prefix that send refuses."""
    async with serving(config(echo_model())) as gw, open_stream(gw.url) as stream:
        with pytest.raises(ValueError, match="begins with 'infer:', which is kept"):
            await stream.send("infer:0", "echo", {"x": f32(7)})
        await stream.send("c0", "echo", {"x": f32(1)})  # infer's id of old: any id else
        await stream.send(0, "echo", {"x": f32(2)})
        assert (await stream.infer("echo", {"x": f32(3)}))["x"].tolist() == [3]
        got = {}
        for _ in range(2):
            reply = await stream.receive()
            got[reply.id] = reply.outputs["x"].tolist()
        assert got == {"c0": [1], 0: [2]}


async def test_a_bad_message_gets_an_error_frame_and_the_stream_goes_on():
    async with serving(config(echo_model(), mlp_model())) as gw, open_stream(gw.url) as stream:
        await stream.send_raw("{not json")
        await stream.send_raw('{"model": "echo", "inputs": []}')
        await stream.send("m1", "nope", {"x": f32(1)})
        await stream.send("m2", "mlp", {"x": f32(1, 2, 3)})
        await stream.send("m3", "mlp", {"x": f32(1)}, version="7")
        await stream.send("ok", "echo", {"x": f32(4, 5)})
        await stream.send_raw('{"id": "m4", "model": "echo", "inputs": [{"name": "x", '
                              '"shape": [2], "datatype": "FP32", "data": [1.5, true]}]}')
        replies = {}
        for _ in range(7):
            r = await stream.receive()
            replies.setdefault(r.id, []).append(r)
        with pytest.raises(UnknownModel):
            await stream.infer("nope", {"x": f32(1)})
        with pytest.raises(InvalidInput, match="expected shape"):
            await stream.infer("mlp", {"x": f32(1)})
        assert (await stream.infer("echo", {"x": f32(6)}))["x"].tolist() == [6]
    malformed, no_id = sorted(replies.pop(None), key=lambda r: "malformed" not in r.error)
    assert malformed.status == 400
    assert malformed.error.startswith("malformed JSON body")
    assert no_id.status == 400
    assert no_id.error == "a stream message needs an 'id' (string or integer)"
    assert replies["m1"][0].status == 404
    assert replies["m2"][0].status == 400
    assert "expected shape [256] or [N, 256]" in replies["m2"][0].error
    assert (replies["m3"][0].status, replies["m3"][0].error) == (
        404, "model 'mlp' has no version '7'; versions: 1")
    assert replies["ok"][0].outputs["x"].tolist() == [4, 5]
    assert (replies["m4"][0].status, replies["m4"][0].error) == (
        400, "input 'x': expected FP32 values, got a boolean in 'data'")


async def test_a_binary_message_that_is_not_utf8_is_refused_naming_the_byte():
    """A binary message is read as JSON text (UTF-8): one that is not gets a 400 frame
    naming the first bad byte and its offset, and the stream goes on (the frame said
    "str is not valid UTF-8: surrogates not allowed ... (char 0)", orjson's words for
    any such bytes)."""
    async with serving(config(echo_model())) as gw, open_stream(gw.url) as stream:
        await stream.send_raw(b"\xff\xfe{}")
        await stream.send_raw(b'{"id": "x\xc3", "model": "echo"}')
        replies = [await stream.receive() for _ in range(2)]
        assert (await stream.infer("echo", {"x": f32(6)}))["x"].tolist() == [6]
    assert sorted((r.id, r.status, r.error) for r in replies) == [
        (None, 400, "malformed JSON body: not UTF-8 text (byte 0xc3 at offset 9); "
                    "JSON is UTF-8"),
        (None, 400, "malformed JSON body: not UTF-8 text (byte 0xff at offset 0); "
                    "JSON is UTF-8"),
    ]


async def test_a_class_the_tenant_may_not_use_is_forbidden_on_the_stream():
    tenants = (trioserve.TenantConfig(name="acme", api_keys=("k1",), classes=("realtime",)),)
    async with serving(config(echo_model(), tenants=tenants)) as gw, \
            open_stream(gw.url, api_key="k1") as stream:
        with pytest.raises(trioserve.Forbidden, match="may not use request class 'batch'"):
            await stream.infer("echo", {"x": f32(1)}, parameters={"priority": "batch"})


async def test_a_level_and_the_class_it_names_agree_on_the_stream():
    async with serving(config(echo_model())) as gw, open_stream(gw.url) as stream:
        both = {"priority": 1, "class": "realtime"}
        assert (await stream.infer("echo", {"x": f32(1)}, parameters=both))["x"].tolist() == [1]
        with pytest.raises(InvalidInput, match=r"\(class 'realtime'\) disagree"):
            await stream.infer("echo", {"x": f32(1)}, parameters={"priority": 1, "class": "batch"})
        stats = gw.runtime.models["echo"].scheduler.policy.stats
        assert {k: f.admitted for k, f in stats.items()} == {("t", "realtime"): 1}


async def test_a_cancelled_infer_frees_its_slot_when_its_answer_comes():
    gate = Gate()
    async with serving(config(held_model(gate))) as gw, \
            open_stream(gw.url, max_in_flight=1) as stream:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream.infer, "held", {"x": f32(1)})
            await settle()
            nursery.cancel_scope.cancel()
        gate.release()
        # The only slot comes back when the abandoned answer arrives (and is dropped).
        assert (await stream.infer("held", {"x": f32(0)}))["y"].tolist() == [0]


async def test_an_infer_cancelled_before_its_message_left_frees_its_slot_at_once(
    autojump_clock,
):
    from trioserve.transport import StreamClient

    class _Blocked:
        """A socket whose first send does not complete until ``go`` (the server has
        stopped reading), then sends at once."""

        def __init__(self) -> None:
            self.sent: list[str] = []
            self.go = trio.Event()

        async def send_message(self, message: str) -> None:
            if not self.sent and not self.go.is_set():
                await self.go.wait()
            self.sent.append(message)
            await trio.lowlevel.checkpoint()

    ws = _Blocked()
    client = StreamClient(ws, max_in_flight=2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.run_writer)
        with trio.move_on_after(1):
            await client.infer("echo", {"x": f32(1)})  # taken by the writer, held
        with trio.move_on_after(1):
            await client.infer("echo", {"x": f32(2)})  # waits for the writer
        # The second never left, so no answer will come to free its slot: leaving
        # frees it, and forgets the caller, at once. The first is being written: it
        # goes whole, and its answer (dropped) will free its slot.
        assert list(client._waiters) == ["infer:0"]
        ws.go.set()
        with trio.move_on_after(1) as blocked:
            await client.send("a", "echo", {"x": f32(3)})
        assert not blocked.cancelled_caught
        assert [json.loads(m)["id"] for m in ws.sent] == ["infer:0", "a"]
        nursery.cancel_scope.cancel()


async def test_a_send_cancelled_part_way_still_leaves_whole_and_the_stream_goes_on():
    """A caller cancelled while its large message was being written (the server had
    stopped reading at its in-flight bound) cut the frame: the next message's bytes
    were read as the rest of it and the stream failed (1007) under every caller."""
    gate = Gate()
    big = np.full(2_000_000, -0.123456789, np.float32)  # ~24 MB of JSON: past the
    # socket buffers, so the write blocks part way while the server does not read
    cfg = config(held_model(gate), server={"stream_in_flight": 1,
                                           "max_body_bytes": 64 << 20})
    async with serving(cfg) as gw, open_stream(gw.url, max_message_size=64 << 20) as stream:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream.infer, "held", {"x": f32(1)})
            await trio.to_thread.run_sync(gate.holding.wait)
            await stream.send("small", "held", {"x": f32(-2)})  # read; waits for room
            with trio.CancelScope() as cut:
                nursery.start_soon(_cancel_when_blocked, cut)
                await stream.infer("held", {"x": big})
            assert cut.cancelled_caught
            gate.release()
        assert (await stream.receive()).id == "small"
        assert (await stream.infer("held", {"x": f32(-3)}))["y"].tolist() == [-3]
        assert gw.statistics().streams == 1


async def _cancel_when_blocked(scope: trio.CancelScope) -> None:
    await settle()
    scope.cancel()


async def test_a_ping_is_answered_with_a_pong_carrying_its_payload():
    from wsproto.events import Ping, Pong

    async with serving(config(echo_model())) as gw:
        sock, ws = await _raw_client(gw)
        await sock.send_all(ws.send(Ping(payload=b"hello")))
        events = await _events_until(sock, ws, Pong)
        assert events[-1].payload == b"hello"
        await sock.aclose()


async def test_a_message_split_over_frames_and_reads_is_one_request():
    from wsproto.events import TextMessage

    async with serving(config(echo_model())) as gw:
        sock, ws = await _raw_client(gw)
        text = '{"id": "split", "model": "echo", "inputs": ' \
               '[{"name": "x", "shape": [2], "datatype": "FP32", "data": [7, 8]}]}'
        frames = ws.send(TextMessage(data=text[:20], message_finished=False)) + ws.send(
            TextMessage(data=text[20:], message_finished=True))
        for i in range(0, len(frames), 7):  # a few bytes at a time
            await sock.send_all(frames[i:i + 7])
            await settle()
        events = await _events_until(sock, ws, TextMessage)
        doc = __import__("json").loads(events[-1].data)
        assert doc["id"] == "split"
        assert doc["outputs"][0]["data"] == [7, 8]
        await sock.aclose()


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (_client_frame(b"{}", masked=False), 1002),  # a client frame must be masked
        (_client_frame(b"\xff\xfe"), 1007),  # text that is not UTF-8
        (_client_frame(b"x", opcode=0x3), 1002),  # a reserved opcode
    ],
)
async def test_a_protocol_error_closes_the_stream_with_its_code(frame, code):
    async with serving(config(echo_model())) as gw:
        sock, _ = await _raw_handshake(gw)
        await sock.send_all(frame)
        data = b""
        while len(data) < 4:
            chunk = await sock.receive_some(65536)
            assert chunk, "closed without a close frame"
            data += chunk
        assert data[0] == 0x88  # a close frame; its code:
        assert int.from_bytes(data[2:4], "big") == code
        await sock.aclose()


async def test_a_reset_stream_is_not_logged_as_an_error(caplog):
    import socket
    import struct

    async with serving(config(echo_model())) as gw:
        sock, _ = await _raw_handshake(gw)
        await settle()
        assert gw.statistics().streams == 1
        sock.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await sock.aclose()  # RST, not FIN
        for _ in range(100):  # until the server's read has seen the reset
            await settle()
            if gw.statistics().streams == 0:
                break
        assert gw.statistics().streams == 0
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


async def test_an_id_of_another_type_is_refused_naming_what_was_sent():
    """It said the message "needs an 'id'" though it had one (true, 1.5, a list)."""
    async with serving(config(echo_model())) as gw, open_stream(gw.url) as stream:
        for rid in (True, [1, None], {"a": "b"}):
            await stream.send_raw(json.dumps({"id": rid, "model": "echo", "inputs": []}))
            refused = await stream.receive()
            assert (refused.id, refused.status) == (rid, 400)
            assert refused.error == (  # as JSON writes it: true, [1, null], {"a": "b"}
                f"a stream message's 'id' must be a string or an integer, got {json.dumps(rid)}"
            )


async def test_an_integer_id_past_64_bits_is_refused_saying_so():
    """JSON parsers read it as a float: the error says what an integer id may be."""
    async with serving(config(echo_model())) as gw, open_stream(gw.url) as stream:
        for rid in (2**64 - 1, 10**30, 1.5):
            await stream.send_raw(json.dumps({"id": rid, "model": "echo", "inputs": [
                {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}))
        replies = sorted([await stream.receive() for _ in range(3)], key=lambda r: r.id)
    assert [r.id for r in replies] == [1.5, 2**64 - 1, 1e30]
    assert replies[1].error is None
    assert (replies[0].status, replies[0].error) == (
        400, "a stream message's 'id' must be a string or an integer, got 1.5")
    assert replies[2].status == 400
    assert "within 64 bits" in replies[2].error


async def test_an_integer_id_just_below_64_bits_is_refused_saying_so():
    """-2**63 - 1 (to -2**63 - 1024) is read as the float -2**63, the least id, and
    was refused as "got -9223372036854775809", not saying why: the bound was checked
    on the float, which rounded back into range."""
    async with serving(config(echo_model())) as gw, open_stream(gw.url) as stream:
        for rid in (-(2**63), -(2**63) - 1, -(2**63) - 1024):
            await stream.send_raw(json.dumps({"id": rid, "model": "echo", "inputs": [
                {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}))
        replies = [await stream.receive() for _ in range(3)]
    least = [r for r in replies if type(r.id) is int]
    assert [(r.id, r.error) for r in least] == [(-(2**63), None)]
    refused = [r for r in replies if r not in least]
    assert [r.status for r in refused] == [400, 400]
    assert all("within 64 bits" in r.error for r in refused), [r.error for r in refused]


@pytest.mark.parametrize(("rate", "retry_after"), [(1.0, 1), (1e-320, 86_400)])
async def test_a_429_frame_says_when_to_retry_and_the_stream_goes_on(rate, retry_after):
    # An infinite refill time (1e-320) crashed the connection (OverflowError turning
    # it into whole seconds); the client read "the server is shutting down".
    tenants = (trioserve.TenantConfig(name="acme", api_keys=("k1",), credit_rate=rate,
                                      credit_burst=1.0),)
    async with serving(config(echo_model(), tenants=tenants)) as gw, \
            open_stream(gw.url, api_key="k1") as stream:
        await stream.send("a", "echo", {"x": f32(1)})
        assert (await stream.receive()).error is None
        await stream.send("b", "echo", {"x": f32(1)})
        refused = await stream.receive()
        assert (refused.id, refused.status, refused.retry_after) == ("b", 429, retry_after)
        with pytest.raises(trioserve.QuotaExceeded) as over:
            await stream.infer("echo", {"x": f32(1)})
        assert over.value.retry_after == retry_after
        await stream.send("c", "missing", {"x": f32(1)})
        assert ((await stream.receive()).id, gw.statistics().streams) == ("c", 1)


async def test_an_echoed_id_that_is_a_list_or_object_reaches_receive():
    """The server echoes a refused id as it read it; a list or an object, unhashable,
    crashed the client's dispatcher (and the stream) while an infer was waiting."""
    gate = Gate()
    async with serving(config(held_model(gate))) as gw, open_stream(gw.url) as stream:
        async with trio.open_nursery() as nursery:
            held: dict[str, np.ndarray] = {}

            async def waiting() -> None:
                held.update(await stream.infer("held", {"x": f32(1)}))

            nursery.start_soon(waiting)
            await trio.to_thread.run_sync(gate.holding.wait)
            for rid in ([1, 2], {"a": 1}):
                await stream.send_raw(json.dumps({"id": rid, "model": "held", "inputs": []}))
                refused = await stream.receive()
                assert (refused.id, refused.status) == (rid, 400)
            gate.release()
        assert held["y"].tolist() == [1]


@pytest.mark.parametrize("bound", [0, -1, 1.5])
async def test_a_max_in_flight_under_one_is_refused_before_connecting(bound):
    """0 opened a stream on which every send waited for ever (no slot)."""
    with pytest.raises(ValueError, match="max_in_flight must be an integer of at least 1"):
        async with open_stream("http://127.0.0.1:9", max_in_flight=bound):
            pass


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://host:8000", "ws://host:8000/v2/stream"),
        ("http://host:8000/", "ws://host:8000/v2/stream"),
        ("https://host", "wss://host/v2/stream"),
        # a server behind a path prefix (a proxy's route): the stream is under it
        ("http://host/prefix", "ws://host/prefix/v2/stream"),
        ("https://host/a/b/", "wss://host/a/b/v2/stream"),
        # the stream's own URL, in either scheme, is taken as it is
        ("http://host/prefix/v2/stream", "ws://host/prefix/v2/stream"),
        ("ws://host:8000", "ws://host:8000/v2/stream"),
        ("ws://host/prefix/v2/stream", "ws://host/prefix/v2/stream"),
        ("wss://host/socket", "wss://host/socket"),
        ("http://host/prefix?token=t", "ws://host/prefix/v2/stream?token=t"),
    ],
)
def test_stream_url_puts_the_stream_under_a_base_urls_path(url, expected):
    """``http://host/prefix`` was taken as the stream's path itself (``/prefix``): a
    server URL names where the server's routes begin, so its stream is
    ``/prefix/v2/stream``; a ``ws://`` URL is the stream's own."""
    assert stream_url(url) == expected


def widens(items):
    """A model whose answer is far larger than its request: 1.5 M floats an item
    (about 19 MB of JSON)."""
    return [{"y": np.full(1_500_000, -0.123456789, np.float32)} for _ in items]


async def test_an_answer_over_16_mib_reaches_the_stream_client():
    """The client refused messages over 16 MiB (its default max_message_size) and the
    stream failed with 1009, while the server sends answers of any size and takes
    messages up to its max_body_bytes (as large as 4 GiB): its default now takes
    what a server may send; a caller may still set a lower one."""
    cfg = config(callable_model("wide", widens))
    async with serving(cfg) as gw, open_stream(gw.url) as stream:
        out = await stream.infer("wide", {"x": f32(1)})
        assert out["y"].shape == (1_500_000,)
        assert out["y"][-1] == np.float32(-0.123456789)
    async with serving(cfg) as gw, open_stream(gw.url, max_message_size=1 << 20) as stream:
        with pytest.raises(ConnectionClosed) as failed:
            await stream.infer("wide", {"x": f32(1)})
        assert failed.value.reason.code == 1009


def test_the_stream_clients_default_bound_is_the_servers_largest_body():
    from trioserve._config import MAX_BODY_BYTES
    from trioserve.transport._stream_client import MAX_MESSAGE_SIZE

    assert MAX_MESSAGE_SIZE == MAX_BODY_BYTES


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ('{"id": "v", "model": "echo", "version": 1, "inputs": []}',
         "a stream message's 'version' must be a string, got 1"),
        ('{"id": "v", "model": "echo", "version": ["1"], "inputs": []}',
         """a stream message's 'version' must be a string, got ["1"]"""),
        ('{"id": "v", "model": 7, "inputs": []}',
         "a stream message's 'model' must be a string, got 7"),
        ('{"id": "v", "model": null, "inputs": []}',
         "a stream message's 'model' must be a string, got null"),
        ('{"id": "v", "inputs": []}', "a stream message needs a 'model' (string)"),
        ('[1, 2]', "a stream message must be a JSON object, got [1, 2]"),
        ('"echo"', """a stream message must be a JSON object, got "echo\""""),
    ],
)
async def test_a_message_field_of_the_wrong_type_is_refused_saying_what_was_given(
    message, error
):
    async with serving(config(echo_model())) as gw, open_stream(gw.url) as stream:
        await stream.send_raw(message)
        reply = await stream.receive()
    assert (reply.status, reply.error) == (400, error)


@pytest.mark.parametrize(
    "params",
    [{"outputs": [{"name": "x", "parameters": {"binary_data": True}}]},
     {"parameters": {"binary_data_output": True}}],
    ids=["binary_data", "binary_data_output"],
)
async def test_an_output_asked_for_as_binary_data_is_answered_as_json_on_the_stream(params):
    """The stream's frames are JSON text: the answer's output carries ``data`` and no
    ``binary_data_size``, which tells a client of the binary tensor extension which
    form it takes; a request written for HTTP is served unchanged."""
    from wsproto.events import TextMessage

    async with serving(config(echo_model())) as gw:
        sock, ws = await _raw_client(gw)
        await sock.send_all(ws.send(TextMessage(data=json.dumps({
            "id": "b", "model": "echo", **params,
            "inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1.5, 2]}],
        }))))
        events = await _events_until(sock, ws, TextMessage)
        await sock.aclose()
    frame = json.loads(events[-1].data)
    (out,) = frame["outputs"]
    assert out == {"name": "x", "datatype": "FP32", "shape": [2], "data": [1.5, 2.0]}


async def test_a_message_sent_again_with_the_same_id_runs_again():
    """No idempotency keys on the stream: each message is a request of its own."""
    calls = []

    def count(items):
        calls.append(len(items))
        return [{"y": it["x"]} for it in items]

    model = callable_model("c", count, execution="inline", max_wait_ms=0)
    async with serving(config(model)) as gw, open_stream(gw.url) as stream:
        for _ in range(2):
            await stream.send("same", "c", {"x": f32(1)})
            reply = await stream.receive()
            assert (reply.id, reply.outputs["y"].tolist()) == ("same", [1.0])
    assert calls == [1, 1]


@pytest.mark.parametrize("coalesce", [False, True])
async def test_messages_read_together_are_queued_in_the_order_they_were_sent(coalesce):
    """A stream's messages are admitted in the order they came: the first of those
    a read brings is queued first. Each used to be queued by a task of its own, in
    the order trio ran the new tasks, which it reverses half the time: a client's
    later message could take the queue place, or the credits, of an earlier one.
    A model whose requests in flight are coalesced (or cached) submits each from a
    computation the cache actor starts: those began in trio's order too."""
    from wsproto.events import TextMessage

    ran: list[float] = []

    def record(items):
        ran.extend(float(it["x"][0]) for it in items)
        return [{"y": it["x"]} for it in items]

    model = callable_model("rec", record, max_batch_size=1, max_wait_ms=0.0,
                           coalesce=coalesce)
    async with serving(config(model)) as gw:
        sock, ws = await _raw_client(gw)
        for round_ in range(6):
            sent = [float(16 * round_ + i) for i in range(16)]
            await sock.send_all(b"".join(
                _infer_frame(f"r{x:g}", (x,), model="rec") for x in sent
            ))
            answers = 0
            while answers < len(sent):
                ws.receive_data(await sock.receive_some(65536))
                answers += sum(isinstance(e, TextMessage) for e in ws.events())
        await sock.aclose()
    assert ran == [float(i) for i in range(96)]
