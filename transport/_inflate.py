"""A request body's Content-Encoding: :func:`decode_body` inflates gzip (of one member
or several, zero padding between and after them skipped) or deflate in steps,
checkpointing between them, within the body size limit (413 past it, 415 for a coding
it does not take)."""

from __future__ import annotations

import re
import zlib

import trio
from trioserve import InvalidInput, TrioserveError


class UnsupportedEncoding(TrioserveError):
    """The request body's Content-Encoding is not one the server decodes."""

    status = 415


class BodyTooLarge(TrioserveError):
    """The request body is over the size limit once decompressed."""

    status = 413


#: Output one step of a request body's inflate produces: the size limit is checked
#: after each step, and the loop checkpoints between steps. A 16 MiB inflate takes
#: ~50 ms here (48 ms for a JSON body of floats compressed to 7.3 MiB, 53 ms for
#: 16 MiB of spaces in 16 KiB): in one call it stalled every other connection that
#: long; a step of 256 KiB takes ~0.3-0.5 ms. (A worker thread was tried: with the loop
#: busy the two contend for the GIL, and the loop's longest stall was 5-25 ms.)
INFLATE_STEP = 256 * 1024
_checkpoint = trio.lowlevel.checkpoint


async def decode_body(body: bytes, coding: bytes | str, limit: int) -> bytes:
    """``body`` decoded from its Content-Encoding ``coding`` (gzip, x-gzip, deflate,
    identity, or a list of them in the order applied), at most ``limit`` bytes of it:
    BodyTooLarge as soon as the output passes it (a small body may inflate a
    thousandfold), UnsupportedEncoding for another coding, InvalidInput for corrupt data.

    Inflates in steps of :data:`INFLATE_STEP` bytes of output with a checkpoint
    between them, so only a body that inflates past one step is a checkpoint.
    Cancelling it abandons the inflate.
    """
    if isinstance(coding, bytes):
        coding = coding.decode("latin-1")
    for c in reversed([c.strip().lower() for c in coding.split(",") if c.strip()]):
        if c == "identity":
            continue
        if c in ("gzip", "x-gzip"):
            body = await _inflate(body, 31, c, limit)
        elif c == "deflate":
            try:  # RFC 9110's deflate is zlib-wrapped; some clients send it raw
                body = await _inflate(body, 15, c, limit)
            except InvalidInput:
                body = await _inflate(body, -15, c, limit)
        else:
            raise UnsupportedEncoding(
                f"Content-Encoding {c!r} is not supported; send gzip, deflate or identity"
            )
    return body


async def _inflate(body: bytes, wbits: int, coding: str, limit: int) -> bytes:
    inflater = _Inflater(body, wbits, coding, limit)
    while not inflater.step():
        await _checkpoint()
    return inflater.result()


#: Input fed to zlib in one call, at most: zlib copies what a call leaves unread
#: (``unconsumed_tail`` when the output is full, ``unused_data`` when a gzip member
#: ends), so a call given the whole rest of a body copied it each time: once a step,
#: and once a member, quadratic in a body of many small members. A member's first
#: call is given ``_FEED_FIRST`` bytes, each next twice as many up to ``_FEED_MAX``,
#: so what a member's end leaves unread is at most about its own size.
_FEED_FIRST = 64
_FEED_MAX = 64 * 1024
#: gzip members a step starts, at most: a member costs ~2-3 µs however little it
#: holds, so a step stays under a millisecond.
MEMBERS_PER_STEP = 256
#: A gzip body may hold one member per this many bytes of the decompressed limit
#: (16,384 for the default 16 MiB), and at least ``MIN_MEMBERS``: starting a member
#: costs ~3-4 µs, about what inflating 1 KiB does, so the members add about as much
#: again as the worst inflate within the limit (16 MiB of JSON in one member ~90 ms
#: here, in 16,384 members ~200 ms; 16,384 empty ones ~70 ms). Unbounded, a 16 MiB
#: body of empty members (20 bytes each: ~840,000) took ~3 s of the event loop.
MEMBER_BYTES = 1024
MIN_MEMBERS = 64
_GZIP_MAGIC = b"\x1f\x8b"
#: The NUL bytes from a position on: sre counts a run of one byte in a tight loop, as
#: fast as a ``bytes.count`` of it (a search for ``[^\x00]`` tries its class at each
#: byte: ~10 times as long, ~0.3-0.5 s of the loop for 16 MiB of padding).
_NUL_RUN = re.compile(rb"\x00*")


class _Inflater:
    """One body's inflate, a step of at most :data:`INFLATE_STEP` bytes of output at a
    time, the size limit checked after each part (never more than ``limit + 1`` bytes
    held). gzip's body may be several members, one after another (RFC 1952 §2.2, as
    ``gzip -d`` reads them): each is inflated in turn, the limit counting all of them."""

    __slots__ = (
        "_body", "_coding", "_d", "_feed", "_limit", "_max_members", "_members", "_multi",
        "_out", "_pos", "_size", "_view", "_wbits",
    )

    def __init__(self, body: bytes, wbits: int, coding: str, limit: int) -> None:
        self._d = zlib.decompressobj(wbits)
        self._wbits = wbits
        self._multi = wbits == 31  # gzip: another member may follow one that ends
        self._body = body
        self._view = memoryview(body)
        self._pos = 0  # where in the body the current call's input begins
        self._feed = _FEED_FIRST
        self._members = 1
        self._max_members = max(MIN_MEMBERS, limit // MEMBER_BYTES)
        self._coding = coding
        self._limit = limit
        self._out: list[bytes] = []
        self._size = 0

    def step(self) -> bool:
        """Inflate the next step; returns whether the inflate is over. Raises
        BodyTooLarge or InvalidInput."""
        want = min(INFLATE_STEP, self._limit + 1 - self._size)
        got = 0
        started = 0
        view = self._view
        end = len(view)
        while True:
            d = self._d
            chunk = view[self._pos:self._pos + self._feed]
            try:
                part = d.decompress(chunk, want - got)
            except zlib.error as exc:
                raise InvalidInput(
                    f"the body is not valid {self._coding} data: {exc}"
                ) from None
            if part:
                self._out.append(part)
                self._size += len(part)
                got += len(part)
                if self._size > self._limit:
                    raise BodyTooLarge(
                        f"request body over {self._limit} bytes once decompressed"
                    )
            if d.eof:
                # what is left is in unused_data (and, in some Pythons, in
                # unconsumed_tail as well: that one is not counted twice)
                self._pos += len(chunk) - len(d.unused_data)
                if self._pos == end or not self._multi:
                    return True  # result() refuses bytes after a deflate stream
                if not self._next_member():
                    return True  # zero padding after the last member
                started += 1
                if got == want or started == MEMBERS_PER_STEP:
                    return False
                continue
            self._pos += len(chunk) - len(d.unconsumed_tail)
            if got == want:
                return False  # zlib may hold more output: the next step takes it
            if self._pos == end:
                # output short of the step with no input left: nothing is pending
                # in zlib, and the stream has not ended (result() refuses it)
                return True
            self._feed = min(2 * self._feed, _FEED_MAX)

    def _next_member(self) -> bool:
        """Start inflating the gzip member at ``_pos``, past any NUL bytes before it
        (padding to a block size, which Python's ``gzip`` skips between members and
        after the last; ``gzip -d`` only after the last). False, and the body is read
        to its end, when only NUL bytes are left; InvalidInput when the bytes there are
        not a member (nor padding: trailing bytes after the last member)."""
        pos = self._pos
        start = pos
        if self._view[pos:pos + 1] == b"\0":
            start = _NUL_RUN.match(self._body, pos).end()  # type: ignore[union-attr]
            if start == len(self._view):
                self._pos = start
                return False
        rest = self._view[start:start + 2]
        if not _GZIP_MAGIC.startswith(rest):
            left = len(self._view) - pos
            raise InvalidInput(
                f"the body is not valid {self._coding} data: it ends early or late "
                f"({left} bytes after gzip member "
                f"{self._members} are not a gzip member)"
            )
        self._pos = start
        if self._members == self._max_members:
            raise InvalidInput(
                f"the body is gzip of more than {self._max_members} members (one per "
                f"{MEMBER_BYTES} bytes of the {self._limit}-byte body limit); send "
                "fewer, larger members"
            )
        self._d = zlib.decompressobj(self._wbits)
        self._feed = _FEED_FIRST
        self._members += 1
        return True

    def result(self) -> bytes:
        if not self._d.eof or self._pos != len(self._view):
            raise InvalidInput(
                f"the body is not valid {self._coding} data: it ends early or late"
            )
        return self._out[0] if len(self._out) == 1 else b"".join(self._out)
