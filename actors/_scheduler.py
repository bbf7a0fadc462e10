"""The scheduler actor: one per model, the owner of that model's only queue.

Callers hand requests to ``submit_nowait``, which admits them into the queueing
policy at once, in the caller's task (a request that cannot be admitted is refused
with Overloaded / QuotaExceeded before it takes any memory), and wakes idle
batchers. Batchers ``pull`` closed batches when their device is free (worker-pull).
The actor's own task answers requests whose deadline passes while they wait.
"""

from __future__ import annotations

import math
from typing import Any

import trio
from trioserve import Actor, ActorBroken, ActorClosed, Overloaded, Request

from ._batching import SchedulingPolicy


class SchedulerActor(Actor):
    def __init__(self, model: str, policy: SchedulingPolicy) -> None:
        super().__init__()
        self.name = f"scheduler[{model}]"
        self.model = model
        self.policy = policy
        self._idle = trio.lowlevel.ParkingLot()  # batchers waiting for a batch
        self._timer = trio.lowlevel.ParkingLot()  # the actor's task, until the next expiry
        self._wake_at = math.inf
        self._max_size = getattr(getattr(policy, "limits", None), "max_size", 1)
        self._closed = False

    # ---- callers
    def submit_nowait(self, request: Request) -> None:
        """Admit a request into the queue without blocking.

        Raises Overloaded (or QuotaExceeded) when the policy refuses it, ActorClosed
        after shutdown, and ActorBroken if the policy itself fails.
        """
        if self._closed:
            raise ActorClosed(f"model {self.model!r}: the runtime is shut down")
        policy = self.policy
        try:
            policy.offer(request, request.arrival)
        except Overloaded:
            raise
        except Exception as exc:
            raise ActorBroken(f"model {self.model!r}: the scheduler failed to queue it") from exc
        if request.deadline < self._wake_at and request.answer_expiry:
            self._timer.unpark_all()
        idle = self._idle
        if idle:
            n = len(policy)
            # Wake a waiting batcher only when this request can change its decision:
            # a first request sets the close time; a full one closes the batch.
            if n == 1 or n >= self._max_size or getattr(policy.limits, "max_tokens", None):
                idle.unpark_all()

    # ---- batchers
    async def pull(self) -> list[Request]:
        """Wait for the next closed batch (each request already DISPATCHED).

        A checkpoint. Cancelling it takes nothing from the queue.
        """
        policy = self.policy
        # Cancellation is checked before a batch is taken, never after: once
        # next_batch has dispatched its requests only the caller holds them, and
        # a cancel delivered at a later checkpoint would lose them unanswered.
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            batch = policy.next_batch(trio.current_time())
            if batch:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return batch
            with trio.move_on_at(policy.next_close_time()):
                await self._idle.park()

    def completed(self, batch: list[Request]) -> None:
        """A batcher finished a batch it pulled (answered or failed)."""
        self.policy.completed(batch, trio.current_time())

    # ---- the actor
    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self)
        policy = self.policy
        while True:
            self._wake_at = policy.next_expiry()
            with trio.move_on_at(self._wake_at):
                await self._timer.park()
            if policy.expire(trio.current_time()) and self._idle:
                self._idle.unpark_all()  # the oldest request may have changed

    def queue_depth(self) -> int:
        return len(self.policy)

    def close(self, error: BaseException) -> int:
        """Stop taking requests and fail everything still waiting; return how many.

        Call it only after the actor's task has stopped.
        """
        self._closed = True
        n = 0
        for req in self.policy.drain():
            n += req.reply.set_error(error)
        self._idle.unpark_all()
        return n
