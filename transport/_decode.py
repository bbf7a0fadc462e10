"""Decoding a large request, and encoding a large answer, off the event loop.

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

An answer is the same: its outputs' JSON (a BYTES element is a Python call each,
~0.2 µs; a float ~35 ns in orjson) or binary data (a BYTES element's length prefix,
~0.4 µs) is written on the loop unless its BYTES outputs hold ``DECODE_IN_THREAD_MIN``
bytes or more (:meth:`Decoder.large_results`; an object array's 8 bytes an element),
then in a worker thread under the same limiter: 1M BYTES elements echoed as binary
data held every other client 0.4-0.5 s, 3.6M 1.6-2 s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np
import trio

T = TypeVar("T")

#: A request body (or stream message) of at least this many bytes is decoded in a
#: worker thread, and an answer whose outputs hold this many bytes is encoded in one
#: (docs/gateway.md, "Large bodies", for the figures).
DECODE_IN_THREAD_MIN = 256 * 1024
#: Large bodies decoded (or answers encoded) at once; more wait for a thread. Their
#: Python code takes the GIL in turns, so more threads would not go faster.
DECODE_THREADS = 2
#: The array kinds an answer encodes an element at a time: objects, bytes, text.
_ELEMENTWISE = frozenset("OSU")


@attrs.define(eq=False)
class Decoder:
    """Where a request is decoded and its answer encoded: :meth:`large` says whether
    a body of ``n`` bytes goes to a thread, :meth:`large_results` whether an answer
    does, :meth:`run` runs the decoder (or encoder) there."""

    #: bodies of this many bytes or more are decoded in a thread, and answers whose
    #: outputs hold as many encoded in one
    threshold: int = DECODE_IN_THREAD_MIN
    limiter: trio.CapacityLimiter = attrs.field(
        factory=lambda: trio.CapacityLimiter(DECODE_THREADS)
    )
    #: decodes and encodes run in a thread so far
    in_thread: int = 0

    def large(self, n: int) -> bool:
        """Whether a body of ``n`` bytes is decoded in a thread. Not a checkpoint."""
        return n >= self.threshold

    def large_results(self, results: Sequence[Mapping[str, Any]]) -> bool:
        """Whether the answer to items' ``results`` (their outputs, one mapping an
        item) is encoded in a thread: its BYTES outputs (arrays of objects or
        strings, a Python call an element) hold ``threshold`` bytes or more, counted
        as the first item's arrays' times the items (they are stacked, so alike).
        Numeric arrays count nothing: orjson writes them, or numpy their bytes, in
        one C call that holds the GIL in a thread too. Not a checkpoint."""
        if not results:
            return False
        n = 0
        for v in results[0].values():
            if type(v) is np.ndarray and v.dtype.kind in _ELEMENTWISE:
                n += v.nbytes
        return n * len(results) >= self.threshold

    async def run(self, decode: Callable[[], T]) -> T:
        """``decode()`` (or an answer's encoder) in a worker thread, once one of the
        limiter's is free; its exception (InvalidInput, ModelError) is raised here.
        A checkpoint. Cancelled while it waits for a thread: nothing runs. Cancelled
        while it runs: waits for it to finish, drops its result, raises Cancelled."""
        self.in_thread += 1
        result = await trio.to_thread.run_sync(
            decode, limiter=self.limiter, abandon_on_cancel=False
        )
        # trio hands back a result of a thread cancelled while it ran: dropped here,
        # or an answer encoded for a client that left would be written to it
        await trio.lowlevel.checkpoint_if_cancelled()
        return result


__all__ = ["DECODE_IN_THREAD_MIN", "DECODE_THREADS", "Decoder"]
