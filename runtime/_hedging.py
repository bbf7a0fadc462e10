"""Hedging: a top-class request still unanswered after its model's p95 gets a copy
queued for another replica, and the caller takes whichever answer comes first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import outcome
import trio

from ._errors import ModelError
from ._messages import CANCELLED, DONE, Reply, Request
from ._outcomes import _never_ran, _note_withdrawal, _refund_if_unrun


class _Hedging:
    """``Runtime._hedged`` (counts its copies in the Runtime's ``hedges``)."""

    async def _hedged(
        self, scheduler: Any, request: Request, delay: float, refund: Callable[[], None]
    ) -> Any:
        """Wait for ``request``; if it is not answered within ``delay``, queue a copy
        for another replica (only into free room: with none, there is no hedge) and
        take whichever answer comes first. The other is withdrawn (or, if already
        running, its answer dropped).

        An error that says a request never ran (refused, pushed out or given its room
        back, expired queued) is no answer while the other may still run: a copy
        pushed out of the queue while its original runs does not fail the caller.
        Nor is the model's error (``ModelError``: it raised on that replica) while the
        other may still answer: a replica whose model raises on every call does not
        fail a caller whose twin another replica is running. When neither answered,
        the first model error is raised, or else (neither ran) the original's error.

        ``refund`` is called once when the caller leaves (is cancelled) and neither
        the original nor its copy ever ran: as it leaves, or later, when one that was
        dispatched turns out never to run (``_refund_if_unrun``).
        """
        answer: list[outcome.Outcome] = []
        unrun: list[outcome.Outcome | None] = [None, None]  # the original's, the copy's
        raised: list[outcome.Outcome] = []  # a model error, held while the other may answer
        won: list[int] = []  # which of the two answered first (not a never-ran error)
        pending = 1
        copy: Request | None = None
        left = False
        try:
            async with trio.open_nursery() as nursery:

                async def wait_for(i: int, reply: Reply) -> None:
                    nonlocal pending
                    try:
                        value: outcome.Outcome = outcome.Value(await reply.wait())
                        # the caller reads the execution that answered from its own
                        if reply is not request.reply and not answer:
                            request.reply.run = reply.run
                    except Exception as exc:
                        value = outcome.Error(exc)
                        never_ran = _never_ran(exc)
                        if never_ran or isinstance(exc, ModelError):
                            if never_ran:
                                unrun[i] = value
                            else:
                                raised.append(value)
                            pending -= 1
                            if pending:
                                return  # the other may still run, or answer
                            value = raised[0] if raised else unrun[0] or value
                            i = -1  # neither answered: no answer came first
                    if not answer:
                        answer.append(value)
                        if i >= 0:
                            won.append(i)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(wait_for, 0, request.reply)
                await trio.sleep(delay)
                copy = attrs.evolve(request, reply=Reply(), arrival=trio.current_time())
                if scheduler.submit_copy_nowait(request, copy):
                    self.hedges += 1
                    pending += 1
                    nursery.start_soon(wait_for, 1, copy.reply)
                else:
                    copy = None  # no free room: wait for the original alone
        except BaseException:  # the caller left: a group of Cancelled, from the nursery
            # Both waits withdrew their requests. Neither ran if each was withdrawn
            # while queued or answered a never-ran error (taken by its wait, or
            # held: answered before its wait began, which was cancelled at its
            # checkpoint); one dispatched may yet never run (then it is refunded).
            left = True
            pair = [request.reply] if copy is None else [request.reply, copy.reply]
            _refund_if_unrun(pair, refund, [u is not None for u in unrun])
            raise
        finally:
            if copy is not None:
                scheduler.forget_copy(request, copy)
            _note_hedge_over(request, copy, won, left=left)
        return answer[0].unwrap()


def _note_hedge_over(
    request: Request, copy: Request | None, won: list[int], *, left: bool
) -> None:
    """A hedged caller is done with ``request`` and its ``copy`` (None: none was
    queued); ``won`` holds which of the two answered first, if one did. Count the other
    in its flow's ``superseded`` if it was withdrawn queued; or, if the caller left
    before any answer, count each one it withdrew queued as ``_note_withdrawal`` does
    (so a copy withdrawn so counts as its original would)."""
    pair = (request,) if copy is None else (request, copy)
    if not won and left and copy is not None:
        # An answer delivered as the caller left, before its wait took it, still came
        # first (the replica withdrew the other at once).
        won = [i for i, r in enumerate(pair) if r.reply.state is DONE and r.reply.run][:1]
    if won:
        if copy is not None:
            other = pair[1 - won[0]].reply
            if other.state is CANCELLED:
                note = getattr(getattr(other.on_cancel, "__self__", None), "note_superseded", None)
                if note is not None:
                    note(pair[1 - won[0]])
    elif left:
        _note_withdrawal(pair)
