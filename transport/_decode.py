"""Decoding a large request off the event loop.

A request's JSON and tensors are decoded on the event loop: for the usual bodies
(a ``[32, 256]`` FP32 request is ~70 KB, decoded in well under a millisecond) a
worker thread's round trip (~55 µs) would be the larger cost. A body of
``DECODE_IN_THREAD_MIN`` bytes or more may take long, though, whatever is done to
its decoder: its cost grows with its elements, and BYTES and BOOL elements are
Python objects each (a 16 MiB body of one-byte BYTES elements: ~3 million of them,
~1 s one by one). Decoded on the loop, such a body stops every other client for
that long. So it is decoded in a worker thread, at most ``DECODE_THREADS`` at once
(a :class:`trio.CapacityLimiter`; the others wait for a thread, cancellably), while
the event loop goes on serving: the runtime's short switch interval
(``runtime.switch_interval_us``) hands it the GIL within ~0.1 ms whenever it wants
it. A single C call holds the GIL throughout (orjson's or simdjson's parse of the
whole body: ~10-30 ms for 16 MiB), so that much of a stall remains.

Cancelling a decode in a thread (its client hung up, the drain's grace ended) waits
for the thread to finish (one decode: bounded by the body's size), then drops its
result and raises :class:`trio.Cancelled`: the thread is never abandoned, so the
limiter counts every thread still decoding, and nothing outlives the request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import attrs
import trio

T = TypeVar("T")

#: A request body (or stream message) of at least this many bytes is decoded in a
#: worker thread (docs/gateway.md, "Large bodies", for the figures).
DECODE_IN_THREAD_MIN = 256 * 1024
#: Large bodies decoded at once; more wait for a thread. Their Python code takes the
#: GIL in turns, so more threads would not decode faster.
DECODE_THREADS = 2


@attrs.define(eq=False)
class Decoder:
    """Where a request is decoded: :meth:`large` says whether a body of ``n`` bytes
    goes to a thread, :meth:`run` runs its decoder there."""

    #: bodies of this many bytes or more are decoded in a thread
    threshold: int = DECODE_IN_THREAD_MIN
    limiter: trio.CapacityLimiter = attrs.field(
        factory=lambda: trio.CapacityLimiter(DECODE_THREADS)
    )
    #: decodes run in a thread so far
    in_thread: int = 0

    def large(self, n: int) -> bool:
        """Whether a body of ``n`` bytes is decoded in a thread. Not a checkpoint."""
        return n >= self.threshold

    async def run(self, decode: Callable[[], T]) -> T:
        """``decode()`` in a worker thread, once one of the limiter's is free; its
        exception (InvalidInput) is raised here. A checkpoint. Cancelled while it
        waits for a thread: nothing runs. Cancelled while it runs: waits for it to
        finish, drops its result, raises Cancelled."""
        self.in_thread += 1
        return await trio.to_thread.run_sync(
            decode, limiter=self.limiter, abandon_on_cancel=False
        )


__all__ = ["DECODE_IN_THREAD_MIN", "DECODE_THREADS", "Decoder"]
