"""What a request for a configured model that is not loaded gets, by its state."""

from __future__ import annotations

import math
from urllib.parse import quote

from ._errors import Overloaded, UnknownModel
from ._model_state import ModelState

#: A request for a model whose first load is under way: the bounds of its
#: Retry-After (whole seconds), the time the load has left by the model's last load.
LOADING_RETRY_MIN_S = 1
LOADING_RETRY_MAX_S = 30


def loading_retry_after(last_load_s: float | None, loading_for: float) -> float:
    """The Retry-After of a request for a model whose load has run ``loading_for``
    seconds: what is left of ``last_load_s`` (what the model's last load in this
    process took; None: it has not loaded before, and no load time is configured to
    expect) rounded up to whole seconds, within ``LOADING_RETRY_MIN_S`` and
    ``LOADING_RETRY_MAX_S``; the least with no last load. Not a checkpoint."""
    if last_load_s is None:
        return float(LOADING_RETRY_MIN_S)
    left = math.ceil(last_load_s - loading_for)
    return float(min(max(left, LOADING_RETRY_MIN_S), LOADING_RETRY_MAX_S))


def not_loaded(
    model: str, state: ModelState = ModelState.UNAVAILABLE,
    retry_after: float = LOADING_RETRY_MIN_S,
) -> UnknownModel | Overloaded:
    """What a request for a configured model that is not loaded gets, by the model's
    ``state``: one loading is 503 (Overloaded: retry after ``retry_after`` s, as
    Triton answers a model not at its ready state), one unloading or not loaded 404
    (UnknownModel; only the second is told to load it, at a URL the name is
    percent-encoded in)."""
    if state is ModelState.LOADING:
        return Overloaded(
            f"model {model!r} is loading: it serves once its load ends; retry shortly",
            retry_after=retry_after,
        )
    if state is ModelState.UNLOADING:
        return UnknownModel(
            f"model {model!r} is unloading: it takes no new requests (those it "
            "admitted are answered)"
        )
    return UnknownModel(
        f"model {model!r} is not loaded (model control is explicit: load it with "
        f"POST /v2/repository/models/{quote(model, safe='')}/load, or "
        "Runtime.load_model)"
    )
