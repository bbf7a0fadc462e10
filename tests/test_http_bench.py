"""``trioserve bench --url``: closed-loop load over HTTP and over the stream."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys

import pytest
import trio
import trioserve
from http_helpers import config, echo_model, serving
from trioserve.transport import bench_http_main
from trioserve.transport._client import open_http


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


async def test_bench_reaches_a_model_whose_name_needs_encoding_in_a_url(tmp_path, capsys):
    """A model's name is any path segment: bench put it in its URLs as it is, so a
    space crashed it (h11: illegal target characters) and "?" or "#" asked for
    another model (404 for 'q'), and so did the tests' HttpClient.infer. The name (and
    a version) is now percent-encoded in the URLs."""
    import trioserve

    out = tmp_path / "bench.json"
    model = trioserve.ModelConfig(name="a b?#q", backend="echo", max_wait_ms=0.0)
    async with serving(config(model)) as gw:
        args = argparse.Namespace(
            url=gw.url, model="a b?#q", concurrency=2, duration=0.5, warmup=0.0,
            batch_dim=1, stream=False, json=str(out), no_offline=True,
        )
        rc = await trio.to_thread.run_sync(bench_http_main, args)
        # and the tests' client, which bench's requests are made with
        async with open_http(gw.url) as client:
            answer = await client.infer("a b?#q", {"x": [[1.0]]}, version="1")
    assert answer.status == 200, answer.body
    assert answer.json()["model_name"] == "a b?#q"
    assert rc == 0, capsys.readouterr()
    res = json.loads(out.read_text())
    assert res["errors"] == 0
    assert res["requests"] > 0
    assert res["mean_batch"] >= 1  # the server's counters for it were found too


@pytest.mark.parametrize("stream", [False, True])
async def test_bench_sends_its_api_key_to_a_server_without_an_open_tenant(tmp_path, capsys, stream):
    """With no default tenant every request needs a key: bench had no way to send
    one, so each of its requests was 401. ``--api-key`` is sent on each request
    (and stream), and a wrong key is counted as errors, not as service."""
    import trioserve

    tenants = (trioserve.TenantConfig(name="acme", api_keys=["k1"]),)
    async with serving(config(echo_model(), tenants=tenants)) as gw:
        results = {}
        for key in ("k1", None):
            out = tmp_path / f"bench-{key}.json"
            args = argparse.Namespace(
                url=gw.url, model="echo", concurrency=2, duration=0.5, warmup=0.0,
                batch_dim=1, stream=stream, json=str(out), no_offline=True, api_key=key,
            )
            rc = await trio.to_thread.run_sync(bench_http_main, args)
            results[key] = (rc, json.loads(out.read_text()) if out.exists() else None)
    rc, res = results["k1"]
    assert rc == 0, capsys.readouterr()
    assert res["errors"] == 0
    assert res["requests"] > 0
    rc, res = results[None]
    assert rc == 1
    err = capsys.readouterr().err
    if stream:  # the handshake is refused: said in a line, no traceback
        assert res is None
        assert "refused the stream: HTTP 401; a server with no open tenant needs --api-key" in err
    else:
        assert (res["requests"], set(res["error_kinds"])) == (0, {"Unauthorized"})
        assert "trioserve: no request was answered with a result" in err
        assert "the server wants an API key: pass a tenant's with --api-key" in err


async def test_bench_of_a_model_the_server_does_not_serve_says_so_in_a_line(tmp_path):
    """It exited with the answer's body as Python writes bytes (b'{"error": ...}'),
    and no "trioserve:" as the command's other lines have."""
    async with serving(config(echo_model())) as gw:
        args = argparse.Namespace(
            url=gw.url, model="nosuch", concurrency=2, duration=0.5, warmup=0.0,
            batch_dim=1, stream=False, json=str(tmp_path / "b.json"), no_offline=True,
        )
        with pytest.raises(SystemExit) as done:
            await trio.to_thread.run_sync(bench_http_main, args)
    assert done.value.code == (
        f"trioserve: cannot bench model 'nosuch' at {gw.url}: HTTP 404: unknown model "
        "'nosuch'; serving: echo"
    )
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize("stream", [False, True])
async def test_bench_of_echo_prints_no_offline_figure_and_says_why(tmp_path, capsys, stream):
    """``echo`` does no work: a bare loop over it measures only the loop (hundreds of
    millions of items/s), so its served/offline read 0.00 and meant nothing. The report
    says so instead, and the client's own CPU is named as the bench's, not the server's."""
    out = tmp_path / "bench.json"
    async with serving(config(echo_model())) as gw:
        args = argparse.Namespace(
            url=gw.url, model="echo", concurrency=2, duration=0.5, warmup=0.0,
            batch_dim=1, stream=stream, json=str(out), no_offline=False,
        )
        rc = await trio.to_thread.run_sync(bench_http_main, args)
    assert rc == 0
    text = capsys.readouterr().out
    assert "served/offline" not in text
    assert "  offline        none: model 'echo' does no work to compare with" in text
    assert "  cpu (bench)    event loop" in text
    res = json.loads(out.read_text())
    assert "offline" not in res
    assert "served_over_offline" not in res


def test_a_url_bench_says_where_its_offline_figure_was_measured():
    from trioserve._bench import format_report

    res = {
        "mode": "http", "model": "mlp", "concurrency": 4, "seconds": 1.0,
        "requests_per_s": 100.0, "requests": 100, "errors": 0, "error_kinds": {},
        "latency_ms": {"p50_ms": 1, "p90_ms": 1, "p99_ms": 1, "max_ms": 1},
        "loop_cpu_share": 0.1, "process_cpu_share": 0.1,
        "offline": {"batch_size": 64, "items_per_s": 1000.0,
                    "where": "the built-in 'mlp' at its defaults, on this machine"},
        "served_over_offline": 0.1,
    }
    text = format_report(res)
    assert ("  offline        1,000 items/s at batch 64 (the built-in 'mlp' at its "
            "defaults, on this machine)  → served/offline 0.10") in text
    assert "  requests/s     100   (100 ok, 0 errors)" in text


def test_a_url_bench_that_cannot_reach_its_server_imports_no_torch(tmp_path):
    """The offline figure of a built-in torch model (``mlp``, the default) is
    measured once the server has answered: a bench that cannot reach it exits at
    once, without torch's import (seconds) and the offline loop (3 s) first."""
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import sys\n"
        "from trioserve.cli import main\n"
        f"rc = main(['bench', '--url', 'http://127.0.0.1:{port}', '--duration', '0.1',"
        f" '--json', {str(tmp_path / 'b.json')!r}])\n"
        "print(rc, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.stdout.split() == ["1", "False"], done.stderr
    assert f"cannot reach http://127.0.0.1:{port}" in done.stderr


@pytest.mark.parametrize("served", [True, False])
async def test_a_url_bench_measures_its_offline_figure_after_the_server_answered(
    tmp_path, capsys, monkeypatch, served
):
    """The offline figure is measured after the served run, and not at all for a
    model the server does not serve."""
    from trioserve import _bench

    measured: list[int] = []

    def offline(cfg, **kw):
        measured.append(sum(n for (_, _, status), n in gw.requests.items() if status == 200))
        return {"batch_size": 64, "items_per_s": 1000.0}

    monkeypatch.setattr(_bench, "offline_throughput", offline)
    model = trioserve.ModelConfig(name="mlp" if served else "other", backend="echo",
                                  max_wait_ms=0.0)
    async with serving(config(model)) as gw:
        args = argparse.Namespace(
            url=gw.url, model="mlp", concurrency=2, duration=0.5, warmup=0.0,
            batch_dim=1, stream=False, json=str(tmp_path / "b.json"), no_offline=False,
        )
        if served:
            assert await trio.to_thread.run_sync(bench_http_main, args) == 0
        else:
            with pytest.raises(SystemExit):
                await trio.to_thread.run_sync(bench_http_main, args)
    if served:
        assert len(measured) == 1
        assert measured[0] > 0  # the served run came first
        res = json.loads((tmp_path / "b.json").read_text())
        assert res["offline"]["items_per_s"] == 1000.0
        assert "served/offline" in capsys.readouterr().out
    else:
        assert measured == []
