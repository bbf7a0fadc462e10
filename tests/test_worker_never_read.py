"""A killed worker process says which of its batches in flight it never read whole
(``WorkerProcess.never_read``), by what its request pipe still held as the kill was
sent: the batcher takes those for never run (docs/faults.md)."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import trio
from trioserve import ModelConfig, WorkerProcess
from trioserve._builtin import resolve_backend
from trioserve._worker import read_exact, read_frame


def _worker() -> WorkerProcess:
    cfg = ModelConfig(name="m", backend="echo")
    return WorkerProcess(cfg, resolve_backend(cfg), "cpu", 1)


@pytest.mark.parametrize(
    ("read", "never_read"),
    [("nothing", 3), ("a", 2), ("a and b's length", 2), ("a and b", 1), ("all", 0)],
)
async def test_a_killed_worker_says_which_batches_it_never_read(read, never_read):
    """Once killed, a worker process says how many of its batches in flight (the
    newest) it never read whole, by what its request pipe still held as the kill
    was sent: those it never ran. Here the test reads the pipe as the worker would
    (``read_frame``); a, b and c were sent."""
    worker = _worker()
    r, w = os.pipe()
    worker._send = trio.lowlevel.FdStream(w)
    worker._shm = mmap.mmap(-1, worker._shm_size)
    try:
        for v in (1.0, 2.0, 3.0):
            await worker.submit([{"x": np.full(4, v, np.float32)}])
        frames = {"nothing": 0, "a": 1, "a and b's length": 1, "a and b": 2, "all": 3}
        for _ in range(frames[read]):
            read_frame(r)
        if read == "a and b's length":
            read_exact(r, 4)
        worker.kill()
        assert worker.never_read == never_read
    finally:
        os.close(r)


async def test_a_worker_killed_as_a_batch_is_written_says_nothing_it_never_read():
    """Killed while a batch's message is being written into its pipe (how much of
    it is there is not known), it says nothing of which it never read: 0."""
    worker = _worker()

    class Unsent:
        def fileno(self):
            raise AssertionError("not asked")

        def close(self):
            pass

    worker._send = Unsent()
    worker._writing = True
    worker.kill()
    assert worker.never_read == 0
