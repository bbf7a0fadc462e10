"""What a caller reads from its requests' ends: whether an error means the request
never reached a device (its credits are refunded), and how a caller that left counts
the requests it withdrew in their flows."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import trio

from ._errors import ModelError, exception_text
from ._errors import _never_ran as _never_ran
from ._messages import ABANDONED, CANCELLED, DONE, Reply, Request


def _note_withdrawal(requests: Sequence[Request]) -> None:
    """The caller of ``requests`` (one deadline) left: count those it withdrew from a
    queue in their flows, as withdrawn, or, if it left because their deadline passed,
    as that queue's expiries (as if the queue had answered them). (The queue's own
    expiry withdraws a request too, but counts it and clears its ``on_cancel``
    first.)"""
    if not requests:
        return
    now = trio.current_time()
    at_deadline = now >= requests[0].deadline
    for r in requests:
        reply = r.reply
        if reply.state is CANCELLED:
            queue = getattr(reply.on_cancel, "__self__", None)
            if at_deadline:
                note = getattr(queue, "withdrawn_at_deadline", None)
                if note is not None:
                    note(r, now)
            else:
                note = getattr(queue, "withdrawn_by_caller", None)
                if note is not None:
                    note(r)


def _refund_if_unrun(
    replies: Sequence[Reply], refund: Callable[[], None], taken: Sequence[bool] = ()
) -> None:
    """The caller of ``replies`` (a request, or a request and its hedge copy) left:
    call ``refund`` once if none of them ran. Now, when each was withdrawn queued or
    answered an error saying it never ran (still held, or, ``taken[i]``, taken by
    the caller from reply ``i``); later, when each one dispatched whose caller's
    leaving abandoned it turns out never to run (``Reply.when_unrun``: dropped or
    answered so, after the caller left or as it left); never once one of them ran
    (answered a result or the model's error, or it reached a device before:
    ``Reply.ran``, a failed batch's retry say).
    Called with the caller's cancellation only: a request that runs pays nothing
    for it. Not a checkpoint."""
    waiting = []
    for i, reply in enumerate(replies):
        state = reply.state
        if state is CANCELLED or (i < len(taken) and taken[i]):
            continue
        if state is DONE:
            error = reply.error
            if error is None or not _never_ran(error):
                return  # answered: it ran
        elif state is ABANDONED and not reply.ran:
            waiting.append(reply)  # dispatched: it may still run, or not
        else:
            return  # it reached a device (Reply.ran): it ran
    if not waiting:
        refund()
        return
    left = [len(waiting)]

    def one_unrun() -> None:
        left[0] -= 1
        if not left[0]:
            refund()

    for reply in waiting:
        reply.when_unrun(one_unrun)


def _prepare_failed(model: str, exc: Exception) -> ModelError:
    """A backend's own ``prepare`` raised something else than a trioserve error (a
    KeyError of its own making, say): the model's error, naming it, so that a caller
    only ever sees the documented errors (over HTTP a 500 with this message)."""
    return ModelError(f"model {model!r}: preparing the inputs raised {exception_text(exc)}")
