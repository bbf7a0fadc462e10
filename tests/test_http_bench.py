"""``trioserve bench --url``: closed-loop load over HTTP and over the stream."""

from __future__ import annotations

import argparse
import json

import pytest
import trio
from http_helpers import config, echo_model, serving
from trioserve.transport import bench_http_main


@pytest.mark.parametrize(("stream", "batch_dim"), [(False, 1), (False, 4), (True, 2)])
async def test_bench_prints_the_in_process_report_and_writes_json(
    tmp_path, capsys, stream, batch_dim
):
    out = tmp_path / "bench.json"
    async with serving(config(echo_model())) as gw:
        args = argparse.Namespace(
            # wall-clock windows: long enough that a stalled machine still sees answers
            url=gw.url, model="echo", concurrency=4, duration=1.0, warmup=0.2,
            batch_dim=batch_dim, stream=stream, json=str(out), no_offline=True,
        )
        rc = await trio.to_thread.run_sync(bench_http_main, args)
    assert rc == 0
    text = capsys.readouterr().out
    mode = "websocket" if stream else "http"
    assert text.startswith(f"{mode} bench: model=echo concurrency=4")
    assert "requests/s" in text
    assert "latency ms" in text
    res = json.loads(out.read_text())
    assert res["errors"] == 0
    assert res["requests"] > 0
    assert res["batch_dim"] == batch_dim
    assert res["items_per_s"] == pytest.approx(res["requests_per_s"] * batch_dim)
    assert 0 < res["fill_ratio"] <= 1
