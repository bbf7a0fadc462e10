"""The scheduler actor: one per model, the only queue of that model.

Callers put requests into its bounded inbox with ``submit_nowait`` (a full inbox is
Overloaded: the edge sheds instead of queueing without bound). Its task drains the
inbox into the queueing policy in whole runs and wakes idle batchers; batchers
``pull`` closed batches from it when their device is free (worker-pull).
"""

from __future__ import annotations

from typing import Any

import trio
from trioserve import Actor, ActorBroken, ActorClosed, Overloaded, Request

from ._batching import SchedulingPolicy


class SchedulerActor(Actor):
    def __init__(self, model: str, policy: SchedulingPolicy, *, inbox_bound: int) -> None:
        super().__init__()
        self.name = f"scheduler[{model}]"
        self.model = model
        self.policy = policy
        self._send, self._recv = trio.open_memory_channel[Request](inbox_bound)
        self._idle = trio.lowlevel.ParkingLot()
        self._closed = False

    # ---- callers
    def submit_nowait(self, request: Request) -> None:
        """Hand a request to the scheduler without blocking.

        Raises Overloaded when the inbox is full and ActorClosed after shutdown.
        """
        try:
            self._send.send_nowait(request)
        except trio.WouldBlock:
            raise Overloaded(
                f"model {self.model!r}: scheduler inbox full", retry_after=0.05
            ) from None
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise ActorClosed(f"model {self.model!r}: the runtime is shut down") from None

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
        recv = self._recv
        policy = self.policy
        idle = self._idle
        while True:
            with trio.move_on_at(policy.next_expiry()):
                request = await recv.receive()
                self._offer(request, policy)
                while True:  # drain what is ready without yielding per item
                    try:
                        request = recv.receive_nowait()
                    except trio.WouldBlock:
                        break
                    self._offer(request, policy)
            policy.expire(trio.current_time())
            if idle:
                idle.unpark_all()

    @staticmethod
    def _offer(request: Request, policy: SchedulingPolicy) -> None:
        try:
            policy.offer(request, request.arrival)
        except Overloaded as exc:
            request.reply.set_error(exc)
        except Exception as exc:
            # A policy bug must not lose the request: answer it, then crash and restart.
            request.reply.set_error(ActorBroken(f"scheduler failed to queue it: {exc!r}"))
            raise

    def queue_depth(self) -> int:
        return len(self.policy) + self._recv.statistics().current_buffer_used

    def close(self, error: BaseException) -> int:
        """Stop taking requests and fail everything still waiting; return how many.

        Call it only after the actor's task has stopped.
        """
        self._closed = True
        self._send.close()
        n = 0
        while True:
            try:
                req = self._recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            n += req.reply.set_error(error)
        for req in self.policy.drain():
            n += req.reply.set_error(error)
        self._idle.unpark_all()
        return n
