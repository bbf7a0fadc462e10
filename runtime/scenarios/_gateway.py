"""``trioserve bench --scenario gateway``: the gateway's three figures on ``mlp``, in one
run on one machine, so their ratios are not spoilt by the machine's drift.

(a) HTTP: ``wrk``, 64 connections, one ``[1, 256]`` FP32 item per POST → req/s (= items/s),
    p50, p99.
(b) The batch dimension: ``wrk``, 16 connections, one ``[32, 256]`` request (32 items) per
    POST → items/s, against the model's offline items/s (a bare forward loop at batch 64,
    one torch thread: ``offline_throughput``), measured before the server starts and after
    it stops; the median of the two. Target: ≥ 0.8 of offline.
(b') The same ``[32, 256]`` requests in Triton's binary tensor extension (what
    ``tritonclient`` sends by default): reported beside (b), not a check of its own.
(c) WebSocket: one connection to ``/v2/stream`` with 256 ``[1, 256]`` requests in flight
    → items/s. Target: ≥ 0.80 of (a).

Order: offline; then three rounds of (a), (b), (c), each ``--duration`` / 3 s measured
after a short warm-up; then offline again. Figures per round, medians, and the two
ratios from the medians.

The WebSocket load comes from :func:`ws_load`, a blocking-socket client run in its own
process (``python -m trioserve.scenarios._gateway ws-client URL``): the handshake by
hand, the 256 masked request frames encoded once (frame k carries id k and is sent again
when answer k comes back, so ids are unique among those in flight), and a loop that
reads the server's frame headers only, counting answers and finding each one's id in its
first bytes. Like ``wrk``, it costs the server's two cores little, so the figure is the
server's.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ._cache_http import _serving, _wrk

ROUNDS = 3
HTTP_CONNECTIONS = 64
BATCH_CONNECTIONS = 16
BATCH_ITEMS = 32
STREAM_IN_FLIGHT = 256
WARMUP_S = 2.0
WS_WARMUP_S = 3.0
BODIES = 1000  # distinct [1, 256] bodies; [32, 256] ones: BODIES // BATCH_ITEMS
BATCH_TARGET = 0.8
WS_TARGET = 0.80

CONFIG = """
[server]
stream_in_flight = {in_flight}

[models.mlp]
backend = "mlp"
execution = "process"
max_batch_size = 64
max_wait_ms = 2.0

[tenants.demo]
default = true

[cache]
capacity_bytes = 0
"""

# ---------------------------------------------------------------- the WebSocket client
WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
#: The client's masking key. RFC 6455 asks for a fresh one per frame, against proxies
#: that cache; on loopback a fixed one lets every frame be encoded once.
MASK = b"\x37\xfa\x21\x3d"
OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
RECV_SIZE = 256 * 1024


def handshake_request(host: str, port: int, path: str, key: bytes) -> bytes:
    """The HTTP/1.1 Upgrade request opening a WebSocket with ``key`` (base64 of 16
    random bytes)."""
    return (
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key.decode()}\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


def check_handshake_response(head: bytes, key: bytes) -> None:
    """Raise ConnectionError unless ``head`` (the response up to its blank line) is a
    101 whose ``Sec-WebSocket-Accept`` matches ``key``."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(None, 2)
    if len(parts) < 2 or parts[1] != b"101":
        raise ConnectionError(f"the WebSocket handshake was refused: {lines[0]!r}")
    want = base64.b64encode(hashlib.sha1(key + WS_GUID).digest())
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"sec-websocket-accept":
            if value.strip() != want:
                raise ConnectionError(
                    f"Sec-WebSocket-Accept is {value.strip()!r}, expected {want!r}"
                )
            return
    raise ConnectionError("the 101 answer has no Sec-WebSocket-Accept")


def _xor(data: bytes, mask: bytes) -> bytes:
    n = len(data)
    if n == 0:
        return b""
    key = (mask * (n // 4 + 1))[:n]
    return (int.from_bytes(data, "big") ^ int.from_bytes(key, "big")).to_bytes(n, "big")


def encode_frame(payload: bytes, *, opcode: int = OP_TEXT, mask: bytes = MASK) -> bytes:
    """One final client frame (masked with ``mask``) carrying ``payload``."""
    n = len(payload)
    if n < 126:
        head = bytes((0x80 | opcode, 0x80 | n))
    elif n < 1 << 16:
        head = bytes((0x80 | opcode, 0x80 | 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, 0x80 | 127)) + n.to_bytes(8, "big")
    return head + mask + _xor(payload, mask)


def parse_frames(
    buf: bytes | bytearray, pos: int = 0
) -> tuple[list[tuple[int, int, int, int]], int]:
    """The complete server frames in ``buf`` from ``pos``: ``(fin, opcode, start, end)``
    with the payload at ``buf[start:end]``, and the position after the last one (a
    partial frame is left for the next call). Server frames are never masked: a masked
    one raises ConnectionError."""
    frames = []
    n = len(buf)
    while n - pos >= 2:
        b0, b1 = buf[pos], buf[pos + 1]
        if b1 & 0x80:
            raise ConnectionError("the server sent a masked frame")
        length = b1 & 0x7F
        start = pos + 2
        if length == 126:
            if n - start < 2:
                break
            length = int.from_bytes(buf[start:start + 2], "big")
            start += 2
        elif length == 127:
            if n - start < 8:
                break
            length = int.from_bytes(buf[start:start + 8], "big")
            start += 8
        end = start + length
        if end > n:
            break
        frames.append((b0 >> 7, b0 & 0x0F, start, end))
        pos = end
    return frames, pos


def answer_id(head: bytes | bytearray) -> tuple[int, bool] | None:
    """``(id, is_error)`` from the first bytes of an answer to a request with an integer
    id: ``{"model_name":…,"id":7,"outputs":…}`` or ``{"id":7,"error":…}``; None when
    there is no integer id there."""
    i = head.find(b'"id":')
    if i < 0:
        return None
    j = head.find(b",", i)
    if j < 0:
        return None
    try:
        rid = int(head[i + 5:j])
    except ValueError:
        return None
    return rid, head.startswith(b'"error"', j + 1)


def request_frames(bodies: Sequence[bytes], model: str, count: int) -> list[bytes]:
    """``count`` encoded frames, frame k a v2 request with id k and body k mod len:
    each body is a v2 request JSON object without ``id`` and ``model``."""
    name = json.dumps(model).encode()
    return [
        encode_frame(b'{"id":%d,"model":%s,' % (k, name) + bodies[k % len(bodies)].lstrip()[1:])
        for k in range(count)
    ]


def ws_load(
    url: str,
    bodies: Sequence[bytes],
    *,
    model: str = "mlp",
    in_flight: int = STREAM_IN_FLIGHT,
    warmup: float = 3.0,
    duration: float = 15.0,
) -> dict[str, Any]:
    """Keep ``in_flight`` requests in flight on one WebSocket to ``url`` for ``warmup``
    then ``duration`` seconds; answers (and error frames) per second of the measured
    part, their latencies, and the error frames seen. Blocking; run it in its own
    process."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    sock = socket.create_connection((host, port), timeout=30)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        key = base64.b64encode(os.urandom(16))
        sock.sendall(handshake_request(host, port, parts.path or "/", key))
        buf = bytearray()
        while (k := buf.find(b"\r\n\r\n")) < 0:
            data = sock.recv(RECV_SIZE)
            if not data:
                raise ConnectionError("the server closed the connection in the handshake")
            buf += data
        check_handshake_response(bytes(buf[:k]), key)
        del buf[:k + 4]
        res = _load_loop(sock, buf, request_frames(bodies, model, in_flight),
                         warmup=warmup, duration=duration)
        try:
            sock.sendall(encode_frame((1000).to_bytes(2, "big"), opcode=OP_CLOSE))
        except OSError:
            pass
    finally:
        sock.close()
    res["in_flight"] = in_flight
    return res


def _load_loop(sock: socket.socket, buf: bytearray, frames: list[bytes], *,
               warmup: float, duration: float) -> dict[str, Any]:
    now = time.perf_counter
    n = len(frames)
    sent_at = [now()] * n
    outstanding = bytearray(b"\x01" * n)
    sock.sendall(b"".join(frames))
    measure_from = now() + warmup
    end = measure_from + duration
    measuring = False
    t0 = t = 0.0
    answers = errors = unmatched = 0
    warm_answers = warm_errors = 0
    first_error: str | None = None
    latencies: list[float] = []
    frag_head: bytes | None = None  # the first bytes of a fragmented message
    closed = None
    pos = 0
    while closed is None:
        data = sock.recv(RECV_SIZE)
        if not data:
            closed = "the server closed the connection"
            break
        t = now()
        if not measuring and t >= measure_from:
            warm_answers, warm_errors = answers, errors
            answers = errors = 0
            latencies.clear()
            measuring, t0 = True, t
        elif measuring and t >= end:
            break
        buf += data
        got, pos = parse_frames(buf, 0)
        again: list[bytes] = []
        resent: list[int] = []
        for fin, op, start, stop in got:
            if op == OP_TEXT or op == OP_BINARY:
                if not fin:
                    frag_head = bytes(buf[start:start + 96])
                    continue
                head = buf[start:start + 96]
            elif op == OP_CONT:
                if frag_head is None:
                    raise ConnectionError("a continuation frame outside a message")
                if not fin:
                    continue
                head, frag_head = frag_head, None
            elif op == OP_PING:
                again.append(encode_frame(bytes(buf[start:stop]), opcode=OP_PONG))
                continue
            elif op == OP_CLOSE:
                code = int.from_bytes(buf[start:start + 2], "big") if stop - start >= 2 else None
                closed = f"the server closed the stream ({code}: {bytes(buf[start + 2:stop])!r})"
                break
            else:
                continue
            found = answer_id(head)
            if found is None or not 0 <= found[0] < n or not outstanding[found[0]]:
                unmatched += 1  # its slot (if any) is lost: one fewer in flight
                continue
            k, is_error = found
            outstanding[k] = 0
            if is_error:
                errors += 1
                if first_error is None:
                    first_error = bytes(buf[start:min(stop, start + 300)]).decode(
                        "utf-8", "replace")
            else:
                answers += 1
            if measuring:
                latencies.append(t - sent_at[k])
            resent.append(k)
            again.append(frames[k])
        del buf[:pos]
        if again and closed is None:
            for k in resent:
                outstanding[k] = 1
                sent_at[k] = t
            sock.sendall(b"".join(again))
    if not measuring:
        raise ConnectionError(closed or "the warm-up did not finish")
    elapsed = t - t0
    latencies.sort()

    def pct(q: float) -> float | None:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else None

    return {
        "items": answers,
        "errors": errors,
        "unmatched": unmatched,
        "seconds": elapsed,
        "items_per_s": answers / elapsed if elapsed > 0 else 0.0,
        "p50_us": None if not latencies else pct(0.50) * 1e6,
        "p99_us": None if not latencies else pct(0.99) * 1e6,
        "warmup_items": warm_answers,
        "warmup_errors": warm_errors,
        "first_error": first_error,
        "closed_early": closed,
    }


# ---------------------------------------------------------------- the scenario
def _bodies(path: Path, *, rows: int, count: int, seed: int) -> Path:
    import numpy as np

    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for _ in range(count):
            x = rng.standard_normal((rows, 256)).astype(np.float32)
            doc = {"inputs": [{"name": "x", "shape": [rows, 256], "datatype": "FP32",
                               "data": [round(float(v), 5) for v in x.reshape(-1)]}]}
            f.write(json.dumps(doc, separators=(",", ":")) + "\n")
    return path


def _binary_bodies(path: Path, *, rows: int, count: int, seed: int) -> Path:
    """Like :func:`_bodies`, in Triton's binary tensor extension (what tritonclient
    sends by default): each line is ``HEADER_LENGTH HEX_OF_BODY`` for ``zipf.lua``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for _ in range(count):
            x = rng.standard_normal((rows, 256)).astype(np.float32)
            raw = x.tobytes()
            head = json.dumps({"inputs": [{"name": "x", "shape": [rows, 256],
                                           "datatype": "FP32",
                                           "parameters": {"binary_data_size": len(raw)}}]},
                              separators=(",", ":")).encode()
            f.write(f"{len(head)} {(head + raw).hex()}\n")
    return path


def _offline(config: Path) -> dict[str, Any]:
    """``offline_throughput`` for mlp under ``config``, in a process of its own."""
    out = subprocess.run(
        [sys.executable, "-m", "trioserve.scenarios._gateway", "offline", str(config)],
        capture_output=True, text=True, check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _ws(url: str, bodies: Path, seconds: float) -> dict[str, Any]:
    ws_url = url.replace("http://", "ws://", 1) + "/v2/stream"
    proc = subprocess.run(
        [sys.executable, "-m", "trioserve.scenarios._gateway", "ws-client", ws_url,
         "--bodies", str(bodies), "--in-flight", str(STREAM_IN_FLIGHT),
         "--warmup", f"{WS_WARMUP_S:g}", "--duration", f"{seconds:g}", "--json"],
        capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the WebSocket client failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _http(
    url: str, bodies: Path, seconds: float, connections: int, items: int, *, binary: bool = False
) -> dict[str, Any]:
    env = dict(os.environ, ZIPF_BODIES=str(bodies), ZIPF_S="0", ZIPF_PATH="/v2/models/mlp/infer",
               ZIPF_BINARY="1" if binary else "0")
    _wrk(url, WARMUP_S, env, connections=connections)
    res = _wrk(url, seconds, env, connections=connections)
    ok = res["requests"] - res["err_status"]
    res["items_per_s"] = ok * items / (res["duration_us"] / 1e6)
    return res


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1e3:.2f} ms"


def run(name: str, args: argparse.Namespace) -> int:
    if shutil.which("wrk") is None:
        print("trioserve: the gateway scenario needs wrk (apt-get install wrk)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="trioserve-gateway-") as tmp:
        return _run(name, args, Path(tmp))


def _run(name: str, args: argparse.Namespace, workdir: Path) -> int:
    """The scenario, its bodies and configurations written under ``workdir`` (removed
    afterwards by :func:`run`)."""
    duration = args.duration or 15.0
    each = duration / ROUNDS
    single = _bodies(workdir / "single.jsonl", rows=1, count=BODIES, seed=11)
    batched = _bodies(workdir / "batch.jsonl", rows=BATCH_ITEMS,
                      count=BODIES // BATCH_ITEMS, seed=12)
    batched_bin = _binary_bodies(workdir / "batch.hex", rows=BATCH_ITEMS,
                                 count=BODIES // BATCH_ITEMS, seed=12)
    cfg = workdir / "gateway.toml"
    cfg.write_text(CONFIG.format(in_flight=STREAM_IN_FLIGHT))
    print(f"scenario {name}: mlp, {ROUNDS} rounds of {each:g} s per figure "
          f"(HTTP {HTTP_CONNECTIONS} connections; [{BATCH_ITEMS}, 256] x {BATCH_CONNECTIONS} "
          f"connections; WebSocket 1 connection x {STREAM_IN_FLIGHT} in flight)", flush=True)
    offline = [_offline(cfg)]
    print(f"  offline before {offline[0]['items_per_s']:>9,.0f} items/s at batch "
          f"{offline[0]['batch_size']}", flush=True)
    rounds: list[dict[str, Any]] = []
    with _serving(cfg) as url:
        for r in range(1, ROUNDS + 1):
            http = _http(url, single, each, HTTP_CONNECTIONS, 1)
            batch = _http(url, batched, each, BATCH_CONNECTIONS, BATCH_ITEMS)
            binary = _http(url, batched_bin, each, BATCH_CONNECTIONS, BATCH_ITEMS, binary=True)
            ws = _ws(url, single, each)
            rounds.append({"http": http, "batch": batch, "binary": binary, "ws": ws})
            print(f"  round {r}        HTTP {http['items_per_s']:>7,.0f} req/s "
                  f"(p50 {_ms(http['p50_us'])}, p99 {_ms(http['p99_us'])})  "
                  f"batch {batch['items_per_s']:>7,.0f} items/s (p99 {_ms(batch['p99_us'])})  "
                  f"binary {binary['items_per_s']:>7,.0f} items/s  "
                  f"WS {ws['items_per_s']:>7,.0f} items/s (p99 {_ms(ws['p99_us'])})", flush=True)
            for label, res in (("HTTP", http), ("batch", batch), ("binary", binary)):
                bad = res["err_status"] + res["err_timeout"] + res["err_read"] + res["err_write"]
                if bad:
                    print(f"    {label}: {bad} errors ({res['err_status']} non-2xx answers)")
            if ws["errors"] or ws["unmatched"] or ws["warmup_errors"]:
                print(f"    WS: {ws['errors']} error frames ({ws['warmup_errors']} in the "
                      f"warm-up), {ws['unmatched']} unmatched; first: {ws['first_error']}")
    offline.append(_offline(cfg))
    print(f"  offline after  {offline[1]['items_per_s']:>9,.0f} items/s", flush=True)

    def median(kind: str, key: str = "items_per_s") -> float:
        return statistics.median(r[kind][key] for r in rounds)

    off = statistics.median(o["items_per_s"] for o in offline)
    med = {"http": median("http"), "batch": median("batch"), "binary": median("binary"),
           "ws": median("ws"),
           "http_p50_us": median("http", "p50_us"), "http_p99_us": median("http", "p99_us"),
           "offline": off}
    batch_ratio = med["batch"] / off
    ws_ratio = med["ws"] / med["http"]
    checks = {
        f"batch dimension items/s >= {BATCH_TARGET} x offline": batch_ratio >= BATCH_TARGET,
        f"WebSocket items/s >= {WS_TARGET:.2f} x HTTP req/s": ws_ratio >= WS_TARGET,
    }
    print(f"  median         HTTP {med['http']:>7,.0f} req/s (p50 {_ms(med['http_p50_us'])}, "
          f"p99 {_ms(med['http_p99_us'])})  batch {med['batch']:>7,.0f} items/s  "
          f"WS {med['ws']:>7,.0f} items/s  offline {off:,.0f} items/s")
    print(f"  batch/offline  {batch_ratio:.2f}  (the same requests in the binary tensor "
          f"extension: {med['binary'] / off:.2f})")
    print(f"  WS/HTTP        {ws_ratio:.2f}")
    for what, ok in checks.items():
        print(f"  [{'PASS' if ok else 'FAIL'}] {what}")
    out = {"scenario": name, "model": "mlp", "rounds": rounds, "offline": offline,
           "duration_s": duration, "seconds_per_run": each,
           "http_connections": HTTP_CONNECTIONS, "batch_connections": BATCH_CONNECTIONS,
           "batch_items": BATCH_ITEMS, "stream_in_flight": STREAM_IN_FLIGHT,
           "medians": med, "batch_over_offline": batch_ratio,
           "binary_over_offline": med["binary"] / off, "ws_over_http": ws_ratio,
           "checks": checks}
    path = Path(args.json) if args.json else (
        Path("bench-results") / f"scenario-{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"  json           {path}")
    return 0 if all(checks.values()) else 1


# ---------------------------------------------------------------- helper processes
def _read_bodies(path: str | None) -> list[bytes]:
    if path:
        return [ln for ln in Path(path).read_bytes().splitlines() if ln.strip()]
    import numpy as np

    rng = np.random.default_rng(0)
    return [
        json.dumps({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                                "data": [round(float(v), 5) for v in rng.standard_normal(256)]}]},
                   separators=(",", ":")).encode()
        for _ in range(64)
    ]


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trioserve.scenarios._gateway")
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("ws-client", help="drive /v2/stream from one blocking socket")
    w.add_argument("url", help="ws://HOST:PORT/v2/stream")
    w.add_argument("--bodies", help="JSONL of v2 request bodies (default: 64 random [1, 256])")
    w.add_argument("--model", default="mlp")
    w.add_argument("--in-flight", type=int, default=STREAM_IN_FLIGHT)
    w.add_argument("--warmup", type=float, default=3.0)
    w.add_argument("-d", "--duration", type=float, default=15.0)
    w.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    o = sub.add_parser("offline", help="print offline_throughput for mlp as JSON")
    o.add_argument("config")
    a = p.parse_args(None if argv is None else list(argv))
    if a.command == "offline":
        from trioserve import load_config
        from trioserve._bench import offline_throughput

        print(json.dumps(offline_throughput(load_config(a.config).model("mlp"))))
        return 0
    res = ws_load(a.url, _read_bodies(a.bodies), model=a.model, in_flight=a.in_flight,
                  warmup=a.warmup, duration=a.duration)
    if a.json:
        print(json.dumps(res))
    else:
        print(f"{res['items_per_s']:,.0f} items/s over {res['seconds']:.1f} s "
              f"(p50 {_ms(res['p50_us'])}, p99 {_ms(res['p99_us'])}); "
              f"{res['errors']} error frames, {res['unmatched']} unmatched"
              + (f"; {res['closed_early']}" if res["closed_early"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
