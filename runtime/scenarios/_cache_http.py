"""``trioserve bench --scenario cache-http``: HTTP throughput on ``mlp`` with a Zipf key
distribution, with the result cache and without.

Starts ``trioserve serve`` twice (cache on, cache off) on a free port, each with the
same ``mlp`` configuration, and drives it with ``wrk`` (``zipf.lua``: 1,000 distinct
request bodies, body k drawn with probability ∝ 1/k^s, s = 1.0) at 64 connections:
3 s warm-up, then ``--duration`` s (15 by default) measured. ``wrk`` is light on CPU,
so on a small machine the figure is the server's, not the load generator's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

KEYS = 1000
ZIPF_S = 1.0
CONNECTIONS = 64

CONFIG = """
[models.mlp]
backend = "mlp"
execution = "process"
max_batch_size = 64
max_wait_ms = 2.0

[tenants.demo]
default = true

[cache]
capacity_bytes = {capacity}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/v2/health/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become ready")


def _metric(url: str, name: str) -> float | None:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


@contextlib.contextmanager
def _serving(config: Path) -> Iterator[str]:
    """Run ``trioserve serve --config config`` on a free port until the block ends;
    yields its URL once it is ready."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trioserve.cli", "serve", "--config", str(config),
         "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        _wait_ready(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wrk(
    url: str, seconds: float, env: dict[str, str], *, connections: int = CONNECTIONS
) -> dict[str, Any]:
    """``wrk`` with ``zipf.lua`` (bodies and skew from ``env``) for ``seconds``
    (rounded to whole seconds, at least one: wrk takes no fractions): its counts and
    latency percentiles, plus ``requests_per_s`` over the time wrk measured."""
    script = str(Path(__file__).with_name("zipf.lua"))
    whole = max(1, round(seconds))
    out = subprocess.run(
        ["wrk", "-t", "1", "-c", str(connections), "-d", f"{whole}s", "-s", script, url],
        capture_output=True, text=True, env=env, check=True,
    ).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("WRKJSON "))
    res = json.loads(line[len("WRKJSON "):])
    res["requests_per_s"] = res["requests"] / (res["duration_us"] / 1e6)
    return res


def run(name: str, args: argparse.Namespace) -> int:
    if shutil.which("wrk") is None:
        print("trioserve: the cache-http scenario needs wrk (apt-get install wrk)",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="trioserve-cache-http-") as tmp:
        return _run(name, args, Path(tmp))


def _run(name: str, args: argparse.Namespace, workdir: Path) -> int:
    """The scenario, its bodies and configurations written under ``workdir`` (removed
    afterwards by :func:`run`)."""
    duration = args.duration or 15.0
    rng = np.random.default_rng(11)
    bodies = workdir / "bodies.jsonl"
    with bodies.open("w") as f:
        for _ in range(KEYS):
            x = rng.standard_normal(256).astype(np.float32)
            doc = {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                               "data": [round(float(v), 5) for v in x]}]}
            f.write(json.dumps(doc, separators=(",", ":")) + "\n")
    env = dict(os.environ, ZIPF_BODIES=str(bodies), ZIPF_S=str(ZIPF_S))
    results: dict[str, Any] = {}
    for label, capacity in (("without cache", 0), ("with cache", 256 << 20)):
        cfg = workdir / f"{capacity}.toml"
        cfg.write_text(CONFIG.format(capacity=capacity))
        with _serving(cfg) as url:
            _wrk(url, 3.0, env)  # warm-up
            res = _wrk(url, duration, env)
            res["hit_rate"] = _metric(url, "trioserve_cache_hit_rate")
            results[label] = res
            print(f"  {label:<14} {res['requests_per_s']:>9,.0f} req/s  p50 "
                  f"{res['p50_us'] / 1e3:.2f} ms  p99 {res['p99_us'] / 1e3:.2f} ms"
                  + (f"  hit rate {res['hit_rate']:.3f}" if res["hit_rate"] is not None
                     else ""))
    ratio = results["with cache"]["requests_per_s"] / results["without cache"]["requests_per_s"]
    ok = ratio >= 3.0
    print(f"scenario {name}: Zipf {ZIPF_S} over {KEYS} keys, {CONNECTIONS} connections, "
          f"{duration:g} s")
    print(f"  speed-up       {ratio:.2f}x")
    print(f"  [{'PASS' if ok else 'FAIL'}] throughput with the cache >= 3x without")
    out = {"scenario": name, "keys": KEYS, "zipf_s": ZIPF_S, "connections": CONNECTIONS,
           "duration_s": duration, "results": results, "speedup": ratio,
           "checks": {"throughput with the cache >= 3x without": ok}}
    path = Path(args.json) if args.json else (
        Path("bench-results") / f"scenario-{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"  json           {path}")
    return 0 if ok else 1
