"""``Idempotency-Key``: a client retrying a request gets the first answer again.

An infer request sent with ``Idempotency-Key: K`` is answered once per (tenant, model,
K) within ``window`` seconds: a repeat while the first is running waits for it and
gets its answer; a repeat after it gets the same status and body, with
``Idempotent-Replayed: true``. The same key with a different request (body, or the
version it runs) is 422. Answers that invite a retry (429, 5xx) are not kept, so the
retry runs.

The store is bounded twice: at most ``max_keys`` answers, and at most ``max_bytes``
bytes, counted as each entry's answer body and its key's strings (as
``sys.getsizeof`` counts them) and :data:`ENTRY_OVERHEAD` for the rest (the entry,
the digest, the key's tuple, the answer's tuple and header list, its place in the
store's dicts; the event repeats wait on while the key runs, made by the first
repeat, is dropped once the key is answered). Over either bound the oldest answers
go first, before their window. Each answer is forgotten ``window`` seconds after it
was given.

Keys still running are never evicted (evicting one let its repeat run the model a
second time): they count in the bytes (their overhead and key) and evict answers to
make room, so the bytes held stay within ``max_bytes`` unless the running keys alone
take more (they are as many as the infer requests in flight with a key, at most about
one an HTTP connection, ``ENTRY_OVERHEAD`` each). Then every answer is evicted as soon as it is
given (its waiting repeats still get it), until enough of them finish. An answer
whose entry alone costs more than ``max_bytes`` is not kept at all: the request and
the repeats already waiting for it are answered, and a later retry runs again.
"""

from __future__ import annotations

import collections
import hashlib
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from ._v2 import compact

Answer = tuple[int, list[tuple[bytes, bytes]], bytes]
REPLAYED = (b"idempotent-replayed", b"true")

#: Bytes counted for each entry besides its answer's body and its key's strings.
#: Measured with tracemalloc (CPython 3.11, 100 to 350,000 answers of 100 bytes, the
#: key's tuple and the dicts' growth included): at most 490 bytes an entry with a
#: JSON answer, 590 with a binary one (its header list holds its own
#: Inference-Header-Content-Length); 760 and 860 while each kept the ~270-byte
#: event its repeats waited on. Counted as 768, so the count is never below what
#: is held.
ENTRY_OVERHEAD = 768


@attrs.frozen(kw_only=True)
class IdempotencyStatistics:
    """A snapshot of the store: answers kept (``keys``), keys still running, the bytes
    both hold as counted and the bound, repeats answered with a kept answer
    (``replayed``), answers evicted before their window to stay within
    ``max_keys`` or ``max_bytes`` (``evicted_keys``, ``evicted_bytes``), answers not
    kept because their entry alone costs more than ``max_bytes`` (``too_large``), and
    answers forgotten at the end of their window (``expired``)."""

    keys: int
    running: int
    bytes: int
    max_bytes: int
    replayed: int
    evicted_keys: int
    evicted_bytes: int
    too_large: int
    expired: int


@attrs.define(eq=False)
class _Entry:
    digest: bytes
    cost: int
    #: what repeats wait on while the first of the key runs: made by the first
    #: repeat, and dropped when the key is answered (a repeat woken holds its own
    #: reference; one that comes later finds the answer), so a kept answer holds none
    done: trio.Event | None = None
    answer: Answer | None = None
    expires: float = float("inf")


def key_bytes(key: Any) -> int:
    """The bytes of ``key``'s strings (``key`` or, for a tuple, its items), as
    ``sys.getsizeof`` counts them; other objects count 0 (in the entry's overhead)."""
    parts = key if type(key) is tuple else (key,)
    return sum(sys.getsizeof(p) for p in parts if isinstance(p, (str, bytes)))


class IdempotencyStore:
    def __init__(
        self, *, window: float = 60.0, max_keys: int = 10_000, max_bytes: int = 64 << 20
    ) -> None:
        self.window = window
        self.max_keys = max_keys
        self.max_bytes = max_bytes
        self._running: dict[Any, _Entry] = {}
        #: answered entries, in the order they were answered (so of their expiry)
        self._answered: collections.OrderedDict[Any, _Entry] = collections.OrderedDict()
        #: the entries' costs, running and answered
        self._bytes = 0
        self.replayed = 0
        self.waiting = 0  # repeats waiting for the first of their key to be answered
        self.evicted_keys = 0
        self.evicted_bytes = 0
        self.too_large = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._running) + len(self._answered)

    @property
    def bytes(self) -> int:
        """The bytes the entries hold, as counted (see :data:`ENTRY_OVERHEAD`)."""
        return self._bytes

    def statistics(self) -> IdempotencyStatistics:
        return IdempotencyStatistics(
            keys=len(self._answered),
            running=len(self._running),
            bytes=self._bytes,
            max_bytes=self.max_bytes,
            replayed=self.replayed,
            evicted_keys=self.evicted_keys,
            evicted_bytes=self.evicted_bytes,
            too_large=self.too_large,
            expired=self.expired,
        )

    @staticmethod
    def digest(body: bytes) -> bytes:
        return hashlib.blake2b(body, digest_size=16).digest()

    def _expire(self, now: float) -> None:
        """Forget the answers whose window passed, then the oldest answers while over
        ``max_keys`` or ``max_bytes``."""
        answered = self._answered
        while answered:
            e = next(iter(answered.values()))
            if e.expires <= now:
                self.expired += 1
            elif len(answered) > self.max_keys:
                self.evicted_keys += 1
            elif self._bytes > self.max_bytes:
                self.evicted_bytes += 1
            else:
                break
            answered.popitem(last=False)
            self._bytes -= e.cost

    async def run(
        self, key: Any, body: bytes, answer: Callable[[], Awaitable[Answer]]
    ) -> Answer:
        """The answer of the request ``key`` (``answer()`` runs at most once per
        window unless it fails in a way worth retrying, or its answer was not kept).
        A checkpoint when ``answer()`` runs or a repeat waits. Cancelling it while
        ``answer()`` runs forgets the key: a repeat waiting for it runs it."""
        digest = self.digest(body)
        while True:
            now = trio.current_time()
            self._expire(now)
            entry = self._running.get(key) or self._answered.get(key)
            if entry is None:
                break
            if entry.digest != digest:
                return 422, [(b"content-type", b"application/json")], (
                    b'{"error":"Idempotency-Key was already used with a different request"}'
                )
            if entry.answer is None:
                done = entry.done
                if done is None:
                    done = entry.done = trio.Event()
                self.waiting += 1
                try:
                    await done.wait()  # the first is running; then look again
                finally:
                    self.waiting -= 1
                if entry.answer is None:
                    continue  # it failed, or was cancelled: this repeat may run it
            # a kept answer, or the one this repeat waited for (kept or not)
            self.replayed += 1
            status, headers, body_out = entry.answer
            return status, [*headers, REPLAYED], body_out
        entry = _Entry(digest=digest, cost=ENTRY_OVERHEAD + key_bytes(key))
        self._running[key] = entry
        self._bytes += entry.cost
        self._expire(now)  # over max_bytes: answers make room for the running key
        try:
            result = await answer()
        except BaseException:
            self._forget(key, entry)
            raise
        if result[0] == 429 or result[0] >= 500:
            self._forget(key, entry)  # worth retrying: keep nothing
            return result
        # kept in a block of its own length (orjson's output holds far more)
        result = result[0], result[1], compact(result[2])
        entry.answer = result  # the repeats waiting for it get it, kept or not
        cost = entry.cost + sys.getsizeof(result[2])
        if cost > self.max_bytes:
            self.too_large += 1
            self._forget(key, entry)
            return result
        del self._running[key]
        self._bytes += cost - entry.cost
        entry.cost = cost
        entry.expires = trio.current_time() + self.window
        self._answered[key] = entry
        self._expire(trio.current_time())  # over a bound: the oldest answers go
        _wake(entry)
        return result

    def _forget(self, key: Any, entry: _Entry) -> None:
        if self._running.get(key) is entry:
            del self._running[key]
            self._bytes -= entry.cost
        _wake(entry)


def _wake(entry: _Entry) -> None:
    """Wake the repeats waiting for ``entry``'s key, and drop their event."""
    done, entry.done = entry.done, None
    if done is not None:
        done.set()
