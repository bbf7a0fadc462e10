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
