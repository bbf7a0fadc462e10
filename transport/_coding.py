"""Content codings of answers: ``Accept-Encoding`` (RFC 9110 §12.5.3) and gzip or
deflate compression in bounded steps.

A request's body may come compressed (``decode_body`` in ``._inflate``); an answer
is compressed when its request asks for it with ``Accept-Encoding``, as Triton does
and as ``tritonclient``'s ``response_compression_algorithm`` asks: gzip, or deflate
in the zlib format (what Triton sends and ``tritonclient`` reads with
``zlib.decompress``). An answer is coded whole, so for a binary-tensor answer
``Inference-Header-Content-Length`` keeps counting the JSON part before
compression, as Triton sends it and as ``tritonclient`` reads it (after
decompressing).
"""

from __future__ import annotations

import functools
import re
import zlib
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from ._answers import Answer


GZIP = b"gzip"
DEFLATE = b"deflate"
#: Every answer to a request with Accept-Encoding says that its coding depends on it.
VARY = (b"vary", b"accept-encoding")
#: Answers shorter than this go out plain when the client takes plain (HTTP allows
#: it): below 1 KiB an answer and its head fit one 1,500-byte packet either way, and
#: gzip would save a JSON answer of 750 bytes ~300 (less its 47 bytes of
#: Content-Encoding and Vary) for ~9 us of the loop's time, a tenth of a request's;
#: small binary answers (float32 tensors) even grow (392 -> 405 bytes).
MIN_COMPRESS = 1024
#: zlib's fastest level: ~10 us per KiB of JSON floats here (106 MB/s), against
#: ~70 us at the default level 6, for output 2-7% larger (5.1 MB of floats: 2.53 MB
#: against 2.35 MB).
COMPRESS_LEVEL = 1
#: Input one step of an answer's compression takes: the loop checkpoints between
#: steps, as it does when inflating a request (``INFLATE_STEP``). A step of JSON
#: floats takes ~0.3 ms here, of float32 bytes (which hardly compress: 28 us per
#: KiB) ~0.9 ms. A 16 MiB answer in one call held every other connection 170 ms
#: (JSON) or 460 ms (float32); in steps, the longest wait another task saw was
#: 1.5-3.7 ms and 2.7-4.3 ms (two steps, since trio may run it just before one step
#: and just after the next, and the output's final join); 64 KiB steps left
#: 2.1-3.0 and 4.6-6.2 ms, for the same total time.
COMPRESS_STEP = 32 * 1024
_checkpoint = trio.lowlevel.checkpoint
#: RFC 9110 §12.4.2's qvalue: 0 to 1, at most three decimals.
_QVALUE = re.compile(rb"0(?:\.[0-9]{0,3})?|1(?:\.0{0,3})?")
_OWS = b" \t"
#: The weight of identity when Accept-Encoding leaves it unlisted: acceptable, and
#: below the least qvalue (0.001), so that any coding listed is preferred.
_LEAST = 0.0001


@functools.lru_cache(maxsize=256)
def negotiate(accept: bytes) -> tuple[bytes | None, bool]:
    """The coding an answer worth compressing gets under the ``Accept-Encoding``
    value ``accept`` (gzip, deflate, or None: plain), and whether a small answer may
    go plain.

    Each coding's weight is its ``q`` (1 when none; ``q=0``: not acceptable); an
    element with a malformed ``q`` is ignored. ``*`` weighs every coding not listed;
    a coding neither listed nor covered by ``*`` is not acceptable, except identity,
    which is unless excluded by ``identity;q=0`` (or ``*;q=0`` without an identity
    element), and then comes after every coding listed. The heaviest of gzip,
    deflate and identity wins; on a tie a coding wins over identity, and gzip over
    deflate. ``x-gzip`` is gzip (RFC 9110 §8.4.1.3). When nothing is acceptable the
    answer goes plain, as the RFC lets a server do. Values are few (a client sends
    the same one every time), so their verdicts are kept (bounded)."""
    weights: dict[bytes, float] = {}
    for element in accept.lower().split(b","):
        coding, _, params = element.partition(b";")
        coding = coding.strip(_OWS)
        if not coding:
            continue
        q = 1.0
        for param in params.split(b";") if params else ():
            name, _, value = param.strip(_OWS).partition(b"=")
            if name.rstrip(_OWS) == b"q":
                value = value.strip(_OWS)
                q = float(value) if _QVALUE.fullmatch(value) else -1.0
        if q < 0:
            continue  # a malformed weight: the element says nothing
        if coding == b"x-gzip":
            coding = GZIP
        weights[coding] = max(q, weights.get(coding, 0.0))
    star = weights.get(b"*")
    # identity unlisted (and no ``*``) is acceptable, after any coding the client lists
    identity = weights.get(b"identity", _LEAST if star is None else star)
    gzip_q = weights.get(GZIP, star or 0.0)
    deflate_q = weights.get(DEFLATE, star or 0.0)
    best, q = (GZIP, gzip_q) if gzip_q >= deflate_q else (DEFLATE, deflate_q)
    if q <= 0 or identity > q:
        return None, True
    return best, identity > 0


class _Compressor:
    """One answer's compression, :data:`COMPRESS_STEP` bytes of input at a time."""

    __slots__ = ("_body", "_done", "_out", "_z")

    def __init__(self, body: bytes, coding: bytes) -> None:
        # gzip: a gzip header and trailer (wbits 31); deflate: the zlib format (15)
        self._z = zlib.compressobj(COMPRESS_LEVEL, zlib.DEFLATED, 31 if coding == GZIP else 15)
        self._body = body
        self._done = 0
        self._out: list[bytes] = []

    def step(self) -> bool:
        """Compress the next step; returns whether the compression is over."""
        start, body = self._done, self._body
        end = self._done = min(start + COMPRESS_STEP, len(body))
        z = self._z
        if start == 0 and end == len(body):
            self._out.append(z.compress(body))
        else:
            with memoryview(body) as view:
                self._out.append(z.compress(view[start:end]))
        if end < len(body):
            return False
        self._out.append(z.flush())
        return True

    def result(self) -> bytes:
        return b"".join(self._out)


async def encode_body(body: bytes, coding: bytes) -> bytes:
    """``body`` compressed with ``coding`` (gzip, or deflate: the zlib format).

    Compresses in steps of :data:`COMPRESS_STEP` bytes of input with a checkpoint
    between them, so only a body longer than one step is a checkpoint. Cancelling
    it abandons the compression.
    """
    compressor = _Compressor(body, coding)
    while not compressor.step():
        await _checkpoint()
    return compressor.result()


async def encode_answer(answer: Answer, accept: bytes) -> Answer:
    """``answer`` (a 200 without a Content-Encoding of its own) as the request's
    ``Accept-Encoding`` value ``accept`` takes it: compressed (Content-Encoding; the
    framing counts the compressed bytes), or plain when it is under
    :data:`MIN_COMPRESS` bytes, when compression would not make it shorter, or when
    the client takes no coding the server has (and plain is acceptable, or nothing
    is). Either way with ``Vary: Accept-Encoding``. The headers are a new list: a
    kept answer's (the edge cache's) are shared by its later hits.

    A checkpoint only when the body is longer than :data:`COMPRESS_STEP`."""
    status, headers, body = answer
    coding, plain_ok = negotiate(accept)
    if coding is None or (plain_ok and len(body) < MIN_COMPRESS):
        return status, [*headers, VARY], body
    coded = await encode_body(body, coding)
    if plain_ok and len(coded) >= len(body):
        return status, [*headers, VARY], body
    return status, [*headers, (b"content-encoding", coding), VARY], coded
