"""``Idempotency-Key``: a client retrying a request gets the first answer again.

An infer request sent with ``Idempotency-Key: K`` is answered once per (tenant, model,
K) within ``window`` seconds: a repeat while the first is running waits for it; a
repeat after it gets the same status and body, with ``Idempotent-Replayed: true``. The
same key with a different request (body, or the version it runs) is 422. Answers that
invite a retry (429, 5xx) are not kept, so the retry runs. The store keeps at most
``max_keys`` answers (the oldest go first) and forgets each ``window`` seconds after it
was given. Keys still running are held apart and never evicted (they are as many as the
requests in flight): evicting one let its repeat run the model a second time.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from ._v2 import compact

Answer = tuple[int, list[tuple[bytes, bytes]], bytes]
REPLAYED = (b"idempotent-replayed", b"true")


@attrs.define(eq=False)
class _Entry:
    digest: bytes
    done: trio.Event = attrs.Factory(trio.Event)
    answer: Answer | None = None
    expires: float = float("inf")


class IdempotencyStore:
    def __init__(self, *, window: float = 60.0, max_keys: int = 10_000) -> None:
        self.window = window
        self.max_keys = max_keys
        self._running: dict[Any, _Entry] = {}
        #: answered entries, in the order they were answered (so of their expiry)
        self._answered: collections.OrderedDict[Any, _Entry] = collections.OrderedDict()
        self.replayed = 0
        self.waiting = 0  # repeats waiting for the first of their key to be answered

    def __len__(self) -> int:
        return len(self._running) + len(self._answered)

    @staticmethod
    def digest(body: bytes) -> bytes:
        return hashlib.blake2b(body, digest_size=16).digest()

    def _expire(self, now: float) -> None:
        answered = self._answered
        while answered:
            e = next(iter(answered.values()))
            if len(answered) <= self.max_keys and e.expires > now:
                break
            answered.popitem(last=False)

    async def run(
        self, key: Any, body: bytes, answer: Callable[[], Awaitable[Answer]]
    ) -> Answer:
        """The answer of the request ``key`` (``answer()`` runs at most once per
        window unless it fails in a way worth retrying)."""
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
            if entry.answer is not None:
                self.replayed += 1
                status, headers, body_out = entry.answer
                return status, [*headers, REPLAYED], body_out
            self.waiting += 1
            try:
                await entry.done.wait()  # the first is running; then look again
            finally:
                self.waiting -= 1
        entry = _Entry(digest=digest)
        self._running[key] = entry
        try:
            result = await answer()
        except BaseException:
            self._forget(key, entry)
            raise
        if result[0] == 429 or result[0] >= 500:
            self._forget(key, entry)  # worth retrying: keep nothing
        else:
            del self._running[key]
            # kept in a block of its own length (orjson's output holds far more)
            result = result[0], result[1], compact(result[2])
            entry.answer = result
            entry.expires = trio.current_time() + self.window
            self._answered[key] = entry
            self._expire(trio.current_time())  # over max_keys: the oldest answer goes
            entry.done.set()
        return result

    def _forget(self, key: Any, entry: _Entry) -> None:
        if self._running.get(key) is entry:
            del self._running[key]
        entry.done.set()
