"""The inputs that hung a model's worker thread, remembered by the model's queue, so
that the same input sent again (a new request: its client's retry, a hedge copy) is
not fresh work that may take the model's last ready thread replica.

Sans-IO. A digest of an item (the result cache's canonical hash of its input tensors:
``_cachekey``) is computed only by a queue whose replicas hung a thread at least once
and still remember an input: never on the hot path of a model that has not.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Any

from trioserve import ActorClosed, ModelError, Request

from ._cachekey import _feed
from ._straggler import Hang

#: Inputs one queue remembers at most (the least recently seen go first).
HUNG_INPUTS = 1024


def digest(item: Any) -> bytes | None:
    """A canonical digest of ``item``'s inputs (equal values, equal digests, whatever
    their arrays; another dtype or shape, another digest); None for an item that
    cannot be hashed so (an object of a backend's own, or one nested past the
    interpreter's recursion limit): it is not remembered."""
    h = hashlib.blake2b(digest_size=16)
    try:
        _feed(h, item)
    except (TypeError, ValueError, RecursionError):
        return None
    return h.digest()


class HungInputs:
    """The inputs of the batches that hung a worker thread of one queue's replicas
    (``Hang``), each while the call it hung still runs: at most ``size``, the least
    recently noted or matched dropped first. An input that runs to completion in
    time is forgotten (:meth:`forget`); one whose call returned is forgotten at the
    next look (:meth:`match`, :meth:`drop_returned`). Of those, the ones answered
    poison after running alone (:meth:`poisoned`) are marked, for as long as they are
    remembered: another request with such an input held for a retry is poison too
    (:meth:`was_poisoned`)."""

    __slots__ = ("_hangs", "_poisoned", "size")

    def __init__(self, size: int = HUNG_INPUTS) -> None:
        self.size = size
        self._hangs: collections.OrderedDict[bytes, Hang] = collections.OrderedDict()
        #: the digests of ``_hangs`` whose input was answered poison after it ran
        #: alone (a subset of its keys: dropped with them)
        self._poisoned: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._hangs)

    def note(self, item: Any, hang: Hang) -> None:
        """``item`` was in the batch whose call ``hang`` is (it ran past its
        deadline in a worker thread, and runs on)."""
        key = digest(item)
        if key is None:
            return
        hangs = self._hangs
        hangs[key] = hang
        hangs.move_to_end(key)
        if len(hangs) > self.size:
            self._poisoned.discard(hangs.popitem(last=False)[0])

    def match(self, item: Any) -> Hang | None:
        """The call that ``item``'s input hung and that still runs; None: none
        (it is then forgotten, if its call returned)."""
        if not self._hangs:
            return None
        key = digest(item)
        if key is None:
            return None
        hang = self._hangs.get(key)
        if hang is None:
            return None
        if hang.returned:
            del self._hangs[key]
            self._poisoned.discard(key)
            return None
        self._hangs.move_to_end(key)
        return hang

    def poisoned(self, item: Any) -> bool:
        """``item``'s input ran alone, hung a thread and was answered poison: mark
        it, if it is remembered (its call, or the one it hung alone, runs). Returns
        whether it was marked. Not for an input it does not remember: no other
        request with it is held for a retry (its batch did not hang)."""
        if not self._hangs:
            return False
        key = digest(item)
        if key is None:
            return False
        hang = self._hangs.get(key)
        if hang is None or hang.returned:
            return False
        self._poisoned.add(key)
        return True

    def any_poisoned(self) -> bool:
        """Whether an input remembered was answered poison after it ran alone."""
        return bool(self._poisoned)

    def was_poisoned(self, item: Any) -> bool:
        """Whether ``item``'s input was answered poison after it ran alone
        (:meth:`poisoned`) and is still remembered. Digests ``item`` only while
        one is marked."""
        if not self._poisoned:
            return False
        key = digest(item)
        return key is not None and key in self._poisoned

    def forget(self, item: Any) -> None:
        """``item``'s input ran to completion within its batch deadline: it did not
        hang that call."""
        key = digest(item)
        if key is not None:
            self._hangs.pop(key, None)
            self._poisoned.discard(key)

    def ran(self, batch: list[Request]) -> None:
        """``batch`` ran to completion in time: forget the inputs of its requests
        that hung a call, or were in a batch that did, or came remembered
        (``Reply.hung``): no digest is taken of the others."""
        for r in batch:
            if r.reply.hung is not None:
                self.forget(r.item)

    def drop_returned(self) -> None:
        """Forget the inputs whose call returned."""
        hangs = self._hangs
        for key in [k for k, hang in hangs.items() if hang.returned]:
            del hangs[key]
            self._poisoned.discard(key)


def hung_input_poison(model: str) -> ModelError:
    """The error of a request whose input hung a worker thread of ``model`` earlier
    and still does, when no other replica can be spared to run it: the error a
    retried part that hung alone gets then. It never ran (``in_queue``): its caller
    is not charged."""
    error = ModelError(
        f"model {model!r}: poison request, not run: this input hung the model's worker "
        "thread earlier (its batch ran past its deadline, and that call still runs), "
        "and no other replica can be spared to run it (it would hang the model's last "
        "ready replica)"
    )
    error.in_queue = True
    return error


def same_input_poison(model: str, *, ran: bool) -> ModelError:
    """The error of a retried part of a batch that hung a worker thread of ``model``
    whose input is that of another request of the batch, answered poison after it
    ran alone (its call still runs): run again, it would hang its replica too. It
    ran in the hung batch (``ran``): its caller is charged, unless it never reached
    the model (``in_queue``)."""
    error = ModelError(
        f"model {model!r}: poison request, not retried: its batch ran past its "
        "deadline in a worker thread, and another request of that batch with the "
        "same input was found poison when run alone (it hung the model's worker "
        "thread, and that call still runs)"
    )
    error.in_queue = not ran
    return error


def hedged_hang_poison(model: str, why: str, *, first: bool) -> ModelError:
    """The error of a hedged request whose batch ran past its deadline (``why``) in
    a worker thread, not retried: its twin (the same input) runs on another replica
    (``first``), whose run is the input's last, or hung one already. It ran: its
    caller is charged. A caller whose other twin answers gets that answer."""
    twin = (
        "while its hedge twin (the same input) runs on another replica, which is its "
        "last run" if first else "and so did its hedge twin (the same input) on "
        "another replica"
    )
    return ModelError(
        f"model {model!r}: poison request, not retried: {why} in a worker thread "
        f"{twin}; a hedged input is run on two replicas at most"
    )


def hedged_twin_poison(model: str) -> ModelError:
    """The error of a hedge twin held apart (``Reply.hung``) whose twin hung a
    worker thread and was answered poison: not run, as it would be the input's
    third run (``in_queue``: its caller, who gets its twin's error, is not charged
    for it)."""
    error = ModelError(
        f"model {model!r}: poison request, not run: its hedge twin (the same input) "
        "hung the model's worker thread and was not run again; a hedged input is run "
        "on two replicas at most"
    )
    error.in_queue = True
    return error


def hedged_twin_answered(model: str) -> ModelError:
    """The error of a hedge twin held apart (``Reply.hung``) whose twin hung a worker
    thread of ``model``, ran again and was answered otherwise than poison (a value,
    the model's own error, its deadline): not run, as it would be the input's third
    run. Not poison, and not the caller's answer: a hedged caller gets its twin's
    (``in_queue``: it never ran, and its caller is not charged for it)."""
    error = ModelError(
        f"model {model!r}: not run: its hedge twin (the same input) hung the model's "
        "worker thread, ran again and was answered; a hedged input is run on two "
        "replicas at most"
    )
    error.in_queue = True
    return error


def unloaded_hung_error(model: str) -> ActorClosed:
    """The error of a request held to run again after its batch hung a worker thread
    of ``model`` (it waits for a replica to spare) when the model is unloaded: a
    copy that unloads runs nothing that may hang a thread again (another hung call
    would hold its unload). It ran in the hung batch: its caller is charged (not
    ``in_queue``)."""
    return ActorClosed(
        f"model {model!r} was unloaded while this request waited to be run again "
        "after its batch hung the model's worker thread (it ran past its deadline): "
        "a model that unloads runs no request that may hang a thread again"
    )
