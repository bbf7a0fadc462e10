"""What a caller reads from its requests' ends: whether an error means the request
never reached a device (its credits are refunded), and how a caller that left counts
the requests it withdrew in their flows."""

from __future__ import annotations

from collections.abc import Sequence

import trio

from ._errors import ModelError, Overloaded, TrioserveError, exception_text
from ._messages import CANCELLED, Request


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


def _never_ran(exc: BaseException) -> bool:
    """Whether a request answered with ``exc`` never reached a device: pushed out of
    (or refused by) the queue, or answered while queued (expired, or failed by a
    queue that closed: ``in_queue``)."""
    return isinstance(exc, Overloaded) or (
        isinstance(exc, TrioserveError) and exc.in_queue
    )


def _prepare_failed(model: str, exc: Exception) -> ModelError:
    """A backend's own ``prepare`` raised something else than a trioserve error (a
    KeyError of its own making, say): the model's error, naming it, so that a caller
    only ever sees the documented errors (over HTTP a 500 with this message)."""
    return ModelError(f"model {model!r}: preparing the inputs raised {exception_text(exc)}")
