"""The error hierarchy. Each class has one meaning; messages say what was wrong and
what was expected."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class TrioserveError(Exception):
    """Base class of every error trioserve raises on purpose."""

    #: HTTP status the gateway answers with for this error.
    status = 500
    #: The request it answers never reached a device (answered while still queued):
    #: its caller is not charged for it.
    in_queue = False


class ConfigError(TrioserveError, ValueError):
    """The configuration is invalid; the message names the key and the reason."""


class UnknownModel(TrioserveError, LookupError):
    """No model (or model version) of that name is served."""

    status = 404

    @classmethod
    def not_served(cls, model: Any, models: Mapping[str, Any]) -> UnknownModel:
        """What every entry point answers for a model of no name served: the name
        asked for, the models that answer now as serving, and the configured ones
        not loaded (explicit model control) apart. ``models``: the runtime's (name ->
        ``ServedModel``; one whose ``loaded`` is false is not loaded)."""
        serving = sorted(n for n, s in models.items() if getattr(s, "loaded", True))
        idle = sorted(n for n, s in models.items() if not getattr(s, "loaded", True))
        text = f"unknown model {model!r}; " + (
            f"serving: {', '.join(serving)}" if serving else "serving no model"
        )
        if idle:
            text += f"; not loaded: {', '.join(idle)}"
        return cls(text)

    @classmethod
    def no_version(cls, model: str, version: str, versions: Iterable[str]) -> UnknownModel:
        """What every entry point answers for a version ``model`` does not have,
        loaded or not (the versions are the configuration's): the model, the version
        asked for and the versions it has."""
        return cls(
            f"model {model!r} has no version {version!r}; versions: {', '.join(versions)}"
        )


class InvalidInput(TrioserveError, ValueError):
    """The inputs do not match the model's signature (name, dtype, shape, budget)."""

    status = 400


class Unauthorized(TrioserveError):
    """A missing or unknown API key."""

    status = 401


class Forbidden(TrioserveError):
    """The tenant may not do this (e.g. a request class it is not allowed)."""

    status = 403


class Overloaded(TrioserveError):
    """The runtime cannot take this request now; try again after ``retry_after`` s.

    ``deadline``: for a refusal measured against the request's deadline (its credits
    refill only after it, or its estimated wait runs past it), that deadline in trio
    time: a request with a later one might be taken. None for a refusal of the load
    or of the tenant's quota alone."""

    status = 503

    def __init__(
        self, message: str, *, retry_after: float = 1.0, deadline: float | None = None
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.deadline = deadline


class QuotaExceeded(Overloaded):
    """The tenant is over its quota; try again after ``retry_after`` s."""

    status = 429


class DeadlineExceeded(TrioserveError, TimeoutError):
    """The request's deadline passed before it could be answered. ``in_queue``: it
    passed while the request was still queued, so it never ran (and is not charged)."""

    status = 504

    def __init__(self, message: str = "", *, in_queue: bool = False) -> None:
        super().__init__(message)
        self.in_queue = in_queue


class ModelError(TrioserveError):
    """The model raised while running the batch that held this request, returned
    something other than one output mapping per item, or answered this request with
    outputs against its signature (a declared one missing, or of another datatype or
    shape), or its backend's own ``prepare`` raised an error of its own; the
    message names the model (and the output)."""

    status = 500


class ModelLoadError(TrioserveError):
    """A replica of a model failed to load (its backend's ``load`` raised, or its
    worker process could not start), or did not load within the model's
    ``load_timeout_s``."""

    status = 503


class ActorClosed(TrioserveError):
    """The runtime (or actor) was closed by its owner; no new work is taken."""

    status = 503


class ActorBroken(TrioserveError):
    """An actor died (crashed past its restart budget, or mid-batch)."""

    status = 500


def without_model(model: str, text: str) -> str:
    """``text``, an error's message about ``model``, without the words that name the
    model at its start (``model 'NAME': ``, ``model 'NAME', `` before a version's,
    ``unknown model 'NAME': ``), for a message that names the model itself (``failed
    to load 'NAME': …``, a log line about the model): each says the model once."""
    for head in (f"model {model!r}: ", f"model {model!r}, ", f"unknown model {model!r}: "):
        if text.startswith(head):
            return text[len(head):]
    return text


def exception_text(exc: BaseException) -> str:
    """``Type: message`` of an exception a model (or its backend) raised, or
    ``Type`` alone when it has no message (``KeyboardInterrupt: `` read as cut).
    One whose ``str()`` raises too is said so, instead of the formatting raising in
    its turn (it crashed the replica that was answering with it)."""
    try:
        text = str(exc)
        return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    except Exception as err:
        why = f"its message cannot be shown: str() raised {type(err).__name__}"
        return f"{type(exc).__name__} ({why})"


def _never_ran(exc: BaseException) -> bool:
    """Whether a request answered with ``exc`` never reached a device: pushed out of
    (or refused by) the queue, or answered while queued (expired, or failed by a
    queue that closed: ``in_queue``)."""
    return isinstance(exc, Overloaded) or (
        isinstance(exc, TrioserveError) and exc.in_queue
    )
