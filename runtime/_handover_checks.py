"""The checks of the requests a reloaded model's replaced copy hands over to its new one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._errors import InvalidInput
from ._messages import Request
from ._model import ModelBackend, TensorSpec
from ._served import ServedModel


def _handed_check(
    before: ServedModel, after: ServedModel, lane: Any
) -> Callable[[Request], None] | None:
    """What checks a request handed over by ``lane`` (a queue of ``before``, a
    replaced copy's) at a reload's swap, to ``after``'s: None when ``after`` takes
    the inputs ``before`` takes (so that the requests handed over pay nothing: they
    are then as ``after``'s own, which hands them on as it does its own); else one
    that checks each against the copy whose queue takes it
    (``SchedulerActor.heir``: ``after``'s, or that of a copy a later reload put in
    its place), made once per such copy (:func:`_inputs_check`). A request handed on
    to an unloaded model's queue is not checked: that queue refuses it."""
    model = before.config.name
    if _inputs_check(model, before.backend, after.backend) is None:
        return None
    made: list[Any] = [None, None]  # the queue it was made for, and the check

    def check(request: Request) -> None:
        end = lane.heir()
        if made[0] is not end:
            served = before.successor
            while served is not None and end not in served.schedulers:
                served = served.successor
            made[:] = end, (
                None if served is None else _inputs_check(model, before.backend, served.backend)
            )
        if made[1] is not None:
            made[1](request)

    return check


def _inputs_check(
    model: str, before: ModelBackend, after: ModelBackend
) -> Callable[[Request], None] | None:
    """What checks a request checked against ``before`` (the model of the copy it
    looked up) and handed to a copy whose model is ``after``: None when ``after``
    takes the same inputs (or any); else a function that raises InvalidInput for
    one ``after`` cannot take, as a request sent to it would be refused (naming the
    input, what the model takes now, and that it was reloaded meanwhile), and
    converts the item's arrays to what ``after`` takes (a dtype it converts) for one
    it can. A backend that prepares its items its own way (its items are not its
    inputs as sent): every request handed over is refused, to be sent again."""
    if after.open_inputs or (
        before.open_inputs == after.open_inputs and tuple(before.inputs) == tuple(after.inputs)
    ):
        return None
    reloaded = (
        "the model was reloaded while this request waited: it now takes "
        f"{TensorSpec.listed(after.inputs)}"
    )
    plain = ModelBackend.prepare
    if type(before).prepare is not plain or type(after).prepare is not plain:

        def refuse(request: Request) -> None:
            raise InvalidInput(f"model {model!r}: {reloaded}; send the request again")

        return refuse

    def check(request: Request) -> None:
        try:
            item, _ = after.prepare(model, request.item)
        except InvalidInput as exc:
            raise InvalidInput(f"{exc} ({reloaded})") from None
        request.item.update(item)  # the same inputs, each of the dtype ``after`` takes

    return check
