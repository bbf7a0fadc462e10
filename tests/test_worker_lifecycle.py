"""Worker processes with real processes: the shared memory has no name to leave
behind.
"""

from __future__ import annotations

import os

import trioserve
from runtime_helpers import config
from trioserve import ModelConfig

SLEEP = ModelConfig(name="s", backend="sleep", execution="process", max_batch_size=4,
                    max_wait_ms=1.0)


def on_disk(paths: list[str]) -> list[str]:
    """Those of ``paths`` that exist."""
    return [p for p in paths if os.path.exists(p)]


def mapped_files(pid: int | str) -> list[str]:
    """The paths of the trioserve mappings of a process (``/proc/PID/maps``)."""
    with open(f"/proc/{pid}/maps") as f:
        rows = [line.split(maxsplit=5) for line in f]
    return [row[5].rstrip("\n") for row in rows if len(row) == 6 and "trioserve" in row[5]]


async def test_the_shared_memory_has_no_name_that_a_killed_server_could_leave():
    async with trioserve.open_runtime(config(SLEEP)) as rt:
        worker = rt.models["s"].batchers[0]._worker
        ours, theirs = mapped_files("self"), mapped_files(worker.pid)
        assert ours
        assert theirs
        # Anonymous (a memfd) or already unlinked: nothing left in /dev/shm.
        assert on_disk(ours + theirs) == []
