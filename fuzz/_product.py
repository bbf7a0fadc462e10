"""What the suites test: the product's classes, or a planted-bug variant of them.

The suites never name ``FairQueue`` or ``BatcherActor`` directly; they take a
:class:`Product`, so the self-test can hand them a broken variant without touching the
product code. :func:`observed_queue_class` wraps a queue class so that a
:class:`~fuzz._checker.QueueObserver` sees every admission and every batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trioserve.actors
from trioserve import Request

from ._checker import QueueObserver, observer_for


@attrs.frozen(kw_only=True)
class Product:
    """The classes under test. ``name`` says which variant (``"product"`` or a bug)."""

    name: str = "product"
    queue_class: type = trioserve.actors.FairQueue
    batcher_class: type = trioserve.actors.BatcherActor
    bucket_class: type = trioserve.actors.TokenBucket
    cache_class: type = trioserve.actors.Cache
    cache_actor_class: type = trioserve.actors.CacheActor


PRODUCT = Product()


def observed_queue_class(
    base: type, on_create: Callable[[Any], None] | None = None, *, lag_slack: float = 0.0
) -> type:
    """A subclass of the queue class ``base`` carrying ``.observer`` (a QueueObserver
    built from the arguments it was configured with, before ``base`` sees them) and
    reporting to it. Observation never raises into the queue's caller."""

    class Observed(base):  # type: ignore[misc, valid-type]
        observer: QueueObserver

        def __init__(self, limits: Any, **kw: Any) -> None:
            classes = tuple(kw.get("classes", ()))
            if classes:
                kw["classes"] = classes
            else:
                classes = (trioserve.actors.ClassSpec(name="default"),)
            self.observer = observer_for(
                limits,
                bound=kw["bound"],
                classes=classes,
                weights=kw.get("weights"),
                lag_slack=lag_slack,
            )
            super().__init__(limits, **kw)
            if on_create is not None:
                on_create(self)

        #: inside ``offer_all``: its items are reported once the whole call is in
        _in_call = False

        def offer(self, request: Request, now: float) -> None:
            super().offer(request, now)
            if not self._in_call:
                self.observer.offered(request, now)
                self.observer.sweep(now, len(self))

        def offer_all(self, requests: Sequence[Request], now: float) -> None:
            self._in_call = True
            try:
                super().offer_all(requests, now)
            finally:
                self._in_call = False
            for request in requests:  # admitted: a call is admitted whole
                self.observer.offered(request, now)
            self.observer.sweep(now, len(self))

        def next_batch(self, now: float) -> list[Request] | None:
            batch = super().next_batch(now)
            if batch:
                self.observer.dispatched(batch, now)
            self.observer.sweep(now, len(self))
            return batch

    Observed.__name__ = Observed.__qualname__ = f"Observed{base.__name__}"
    return Observed
