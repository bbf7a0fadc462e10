"""The harness's stand-in for a worker process (fuzz/_device.py ``TrioWorker``) answers
as a ``WorkerProcess`` does where the runtime relies on it."""

from __future__ import annotations

import pytest
from trioserve import WorkerProcess

from fuzz._device import TrioWorker


class _Worker(TrioWorker):
    def _stage(self, items):
        return object(), 0.001


async def test_a_result_asked_of_a_killed_worker_is_died_as_a_worker_process_says():
    """``WorkerProcess.result`` raises Died when the worker was killed before the call:
    the runtime's collecting task may ask for the next staged batch's result after the
    pulling task killed the worker. The stand-in failed there with an IndexError (its
    batches cleared by the kill), which crashed the batcher in the cache suite."""
    worker = _Worker(lambda items: [{"y": 1} for _ in items], slots=2)
    await worker.submit([{"x": 1}])
    await worker.submit([{"x": 2}])
    assert await worker.result() == [{"y": 1}]
    worker.kill()
    with pytest.raises(WorkerProcess.Died, match="killed"):
        await worker.result()
    with pytest.raises(WorkerProcess.Died):
        await worker.result()


async def test_a_result_asked_of_a_live_worker_holding_no_batch_is_a_harness_error():
    worker = _Worker(lambda items: [], slots=1)
    with pytest.raises(RuntimeError, match="holding no batch"):
        await worker.result()
