"""The bench's closed loop counts what finishes inside its measured window."""

import trio
import trio.testing
from trioserve._bench import run_load


def test_run_load_counts_the_measured_window_only():
    calls = 0

    async def call() -> None:
        nonlocal calls
        calls += 1
        await trio.sleep(0.1)
        if calls % 5 == 0:
            raise ValueError("every fifth call fails")

    async def main() -> dict:
        return await run_load(call, concurrency=2, duration=1.0, warmup=0.55)

    clock = trio.testing.MockClock(autojump_threshold=0)
    res = trio.run(main, clock=clock)
    # Each caller finishes a call every 0.1 s (a failed one adds the bench's 1 ms pause):
    # inside [0.55, 1.55] that is 10 per caller at most; the warm-up's are not counted.
    done = res["requests"] + res["errors"]
    assert 18 <= done <= 20
    assert res["errors"] == res["error_kinds"].get("ValueError", 0)
    assert 3 <= res["errors"] <= 5
    assert abs(res["seconds"] - 1.0) < 1e-9
    assert res["requests_per_s"] == res["requests"] / res["seconds"]


def test_an_in_process_bench_with_no_request_answered_exits_1(tmp_path, monkeypatch, capsys):
    """A model that raises on every batch: the bench reported 0 requests/s and
    latencies of 0.00 ms, and exited 0 as after a measurement (``bench --url`` exits
    1 then). Now it exits 1 with a line that says no request was answered, and why."""
    import json

    from trioserve.cli import main

    (tmp_path / "raising_model.py").write_text(
        "from trioserve import CallableBackend, TensorSpec\n"
        "def _fail(items):\n"
        "    raise RuntimeError('always fails')\n"
        "def backend():\n"
        "    x = TensorSpec(name='x', datatype='FP32', shape=(4,))\n"
        "    return CallableBackend(_fail, inputs=[x], outputs=[x], execution='inline')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    toml = tmp_path / "bad.toml"
    toml.write_text('[models.bad]\nbackend = "raising_model:backend"\n')
    out = tmp_path / "bench.json"
    code = main([
        "bench", "--config", str(toml), "--model", "bad", "-c", "2", "-d", "0.2",
        "--warmup", "0", "--no-offline", "--json", str(out),
    ])
    assert code == 1
    res = json.loads(out.read_text())  # the figures are still written
    assert res["requests"] == 0
    err = capsys.readouterr().err
    assert "trioserve: no request was answered with a result in 0.2 s" in err
    if res["errors"]:
        assert f"(errors: ModelError {res['errors']:,})" in err
