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
import trioserve
import trioserve._control
import trioserve.actors
from trioserve import Overloaded, Request, RequestState

from ._checker import QueueObserver, Tracked, observer_for


@attrs.frozen(kw_only=True)
class Product:
    """The classes under test. ``name`` says which variant (``"product"`` or a bug)."""

    name: str = "product"
    runtime_class: type = trioserve.Runtime
    queue_class: type = trioserve.actors.FairQueue
    batcher_class: type = trioserve.actors.BatcherActor
    scheduler_class: type = trioserve.actors.SchedulerActor
    breaker_class: type = trioserve.actors.Breaker
    bucket_class: type = trioserve.actors.TokenBucket
    cache_class: type = trioserve.actors.Cache
    cache_actor_class: type = trioserve.actors.CacheActor
    rollout_class: type = trioserve.actors.Rollout
    rollout_controller_class: type = trioserve.actors.RolloutController
    control_class: type = trioserve._control.ModelControl
    autoscaler_class: type = trioserve.actors.Autoscaler
    scaling_controller_class: type = trioserve.actors.ScalingController


PRODUCT = Product()


_DONE = RequestState.DONE


def submission(request: Request) -> Any:
    """What ``request`` was submitted with, all or none: the ReplyGroup of its call's
    requests, or its own reply if it came alone."""
    reply = request.reply
    return reply.group if reply.group is not None else reply


def observed_queue_class(
    base: type, on_create: Callable[[Any], None] | None = None, *, lag_slack: float = 0.0
) -> type:
    """A subclass of the queue class ``base`` carrying ``.observer`` (a QueueObserver
    built from the arguments it was configured with, before ``base`` sees them) and
    reporting to it. Observation never raises into the queue's caller.

    It also records who pushed out whom and which calls it refused, for a suite that
    judges a call queued in several queues (a model's two lanes): ``pushed`` holds
    (the request pushed out, the request whose offer pushed it out, when), and
    ``refused`` the calls refused by ``offer``, ``offer_all`` or ``plan_all`` (by the
    id of their ``submission``: it, and the request refused)."""

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
            self.refused: dict[int, tuple[Any, Request]] = {}
            self.pushed: list[tuple[Tracked, Request, float]] = []
            super().__init__(limits, **kw)
            if on_create is not None:
                on_create(self)

        #: inside ``offer_all``: its items are reported once the whole call is in
        _in_call = False

        def offer(self, request: Request, now: float) -> None:
            try:
                super().offer(request, now)
            except Overloaded:
                self._refused(request)
                raise
            if not self._in_call:
                self.observer.offered(request, now)
                self._swept(now, request)

        def offer_all(self, requests: Sequence[Request], now: float) -> None:
            self._in_call = True
            try:
                super().offer_all(requests, now)
            except Overloaded:
                self._in_call = False
                self._refused(requests[0])
                self._swept(now, requests[0])  # whom a refused call pushed out
                raise
            finally:
                self._in_call = False
            for request in requests:  # admitted: a call is admitted whole
                self.observer.offered(request, now)
            self._swept(now, requests[0])

        def _offer_call(self, requests: Sequence[Request], now: float) -> bool:
            # ``offer_planned`` queues a call that pushes nobody out in one pass,
            # not through ``offer``: its items are reported here, as ``offer_all``
            # reports a call's, once the whole call is in
            try:
                queued = super()._offer_call(requests, now)
            except Overloaded:
                self._refused(requests[0])
                raise
            if queued and not self._in_call:
                for request in requests:
                    self.observer.offered(request, now)
                self._swept(now, requests[0])
            return queued

        def offer_spare(self, request: Request, now: float) -> bool:
            spare = self.observer.spare
            spare.add(id(request.reply))
            try:
                taken = super().offer_spare(request, now)
            except BaseException:
                spare.discard(id(request.reply))
                raise
            if not taken:
                spare.discard(id(request.reply))
            return taken

        def plan_all(self, requests: Sequence[Request], now: float) -> Any:
            try:
                return super().plan_all(requests, now)
            except Overloaded:
                self._refused(requests[0])
                raise

        def _refused(self, request: Request) -> None:
            key = submission(request)
            self.refused[id(key)] = (key, request)

        def _swept(self, now: float, by: Request) -> None:
            """Sweep after ``by`` (or its call) was offered: a queued request found
            answered before its deadline was pushed out for it."""
            for t in self.observer.sweep(now, len(self)):
                if t.request.reply.state is _DONE and t.request.deadline > now:
                    self.pushed.append((t, by, now))

        def next_batch(self, now: float) -> list[Request] | None:
            batch = super().next_batch(now)
            if batch:
                self.observer.dispatched(batch, now)
            self.observer.sweep(now, len(self))
            return batch

    Observed.__name__ = Observed.__qualname__ = f"Observed{base.__name__}"
    return Observed
