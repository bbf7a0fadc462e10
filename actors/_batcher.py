"""The batcher actor: one per replica (device). When its device is free it pulls a
closed batch from the scheduler, runs the model off the event loop (a worker process,
a worker thread, no lock held, or inline) and answers each request's reply slot. Its
health, and whether it takes work, is in ``actors/_replica_health.py``.

Every batch runs against a deadline learnt from the model's recent batch times
(:class:`BatchTimer`). What follows a batch that runs past it (a straggler), or whose
model raised, lives in ``actors/_batch_failures.py`` (retries in parts, poison
requests, the replica's breaker, a device left unusable); feeding a worker process in
``actors/_worker_feed.py``.

A request's own deadline (its model's or class's ``timeout_ms``) that passes while its
batch is in flight (running in a thread or a worker, or staged) is answered then,
DeadlineExceeded, and the batch goes on for the others (:class:`InFlight`, on the
watchdog's wall clock); the batch's answer, and its retries, skip it. Inline, nothing
interrupts the model: its requests wait for the batch.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any

import outcome
import trio
from trioserve import (
    Actor,
    ActorBroken,
    ActorClosed,
    ConfigError,
    ModelBackend,
    ModelConfig,
    ModelError,
    ModelLoadError,
    RayReplica,
    Request,
    WorkerProcess,
    check_outputs,
    device_lost,
    load_runner,
)

from ._batch_failures import _ESCAPES, BatchFailures, _Escaped, _text
from ._batch_failures import retire_if_lost as retire_if_lost
from ._in_flight import InFlight
from ._metrics import ModelMetrics
from ._replica_health import REPLICA_HEALTH as REPLICA_HEALTH
from ._replica_health import ReplicaHealth
from ._retiring import Retiring
from ._scheduler import SchedulerActor, _unrun
from ._singleflight import own_error
from ._straggler import BatchTimer, Breaker, LogThrottle, StragglerPolicy, may_hang
from ._watchdog import Watchdog
from ._worker_feed import WorkerFeed


class _DeviceLost(Exception):
    """The model raised in a worker thread and left its device unusable
    (``trioserve.device_lost``); the model's exception is its cause."""


_threads_lock = threading.Lock()
_threads_running = 0


def model_threads_running() -> int:
    """How many model calls are running in worker threads, in the whole process
    (stragglers whose batch was given up included: a thread cannot be stopped)."""
    return _threads_running


class BatcherActor(ReplicaHealth, BatchFailures, WorkerFeed, Retiring, Actor):
    def __init__(
        self,
        *,
        config: ModelConfig,
        backend: ModelBackend,
        scheduler: SchedulerActor,
        metrics: ModelMetrics,
        device: str,
        index: int,
        execution: str,
        torch_threads: int = 1,
        zygote: Any = None,
        timer: BatchTimer | None = None,
        breaker: Breaker | None = None,
        watchdog: Watchdog | None = None,
        retirable: bool = False,
        label: str | None = None,
    ) -> None:
        super().__init__()
        model = config.name
        #: what its name says it serves: the model, or ``model/version`` for a
        #: version with weights of its own (two versions' first replicas differ)
        self.label = label or model
        self.name = f"batcher[{self.label}#{index}@{device}]"
        self.model = model
        self._config = config
        self.device = device
        self.index = index
        self._backend = backend
        self._scheduler = scheduler
        self._metrics = metrics
        self._inline = execution == "inline"
        # on Ray, a replica's actor is driven as a worker process is (RayReplica)
        self._process = execution in ("process", "ray")
        self._ray = execution == "ray"
        self._worker: WorkerProcess | RayReplica | None = None
        self._torch_threads = torch_threads
        self._zygote = zygote
        self._timer = timer if timer is not None else BatchTimer(StragglerPolicy())
        self._breaker = breaker if breaker is not None else Breaker()
        self._errors_logged = LogThrottle()  # the model's errors its callers get
        self._watchdog = watchdog  # None: batches run without a deadline
        self._limiter = trio.CapacityLimiter(1)
        self._runner: Any = None
        #: its batches in flight (running, or staged for its worker process), each
        #: with its requests' deadlines kept while it runs (none inline: nothing can
        #: interrupt a model running on the event loop)
        self._in_flight = InFlight(
            model=model, watchdog=None if self._inline else watchdog,
            noted=scheduler.expired_running,
        )
        #: of those, the ones its closed worker process is known never to have started
        self._never_started: list[list[Request]] = []
        #: the batch being sent to its worker process (None: none): in flight, it
        #: has reached nothing yet
        self._sending: list[Request] | None = None
        self.busy_time = 0.0
        self._worker_seconds = 0.0  # busy seconds of workers this batcher already replaced
        self._degraded = False  # a straggling thread still runs
        #: it runs a part of a batch that hung a thread, or an input that did
        #: (``may_hang``): it may hang too, so it does not count as a replica to
        #: spare (``SchedulerActor.spare``); the scheduler sets it as it hands such
        #: a part over, before the pull returns
        self.risking = False
        #: why its device is unusable for the rest of the process (a thread or inline
        #: replica: nothing can replace it); None while it is not
        self.lost: str | None = None
        self._replacing = False  # a worker process is being replaced
        self._lost_why: str | None = None  # a dead worker's loss, logged once it is closed
        self.stragglers = 0
        self.workers_lost = 0
        self.workers_broken = 0  # workers replaced because the model kept raising there
        self.start_failures = 0  # successors of a lost worker that could not start
        #: its breaker opened on another replica's evidence: replace the worker
        self._replace_due = False
        #: set with ``_replace_due``: ends a wait for the breaker's cooldown, so that
        #: the worker is replaced when the breaker opens, not when it closes
        self._replace_wake = trio.Event()
        # (an autoscaled model's replicas retire one by one; any replica of a model
        # under explicit model control retires when its model is unloaded or reloaded)
        self._init_retiring(retirable=retirable or config.autoscaling is not None)

    # ------------------------------------------------------------------ the actor
    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        if self._retire_asked.is_set():  # restarted after a crash while retiring
            task_status.started(self)
            self._retired.set()
            return
        if self._process:
            try:
                await self._start_worker()
                task_status.started(self)
                await self._loop_process()
            finally:
                await self._close_worker()
            self._retired.set()  # the loop returns only when it is retired
            return
        if self._runner is None:
            self._runner = await self._load(
                lambda: trio.to_thread.run_sync(
                    self._load_in_thread,
                    limiter=self._limiter,
                    # a load past its time is left to finish (a thread cannot be
                    # stopped); the runtime's start fails meanwhile
                    abandon_on_cancel=True,
                )
            )
        task_status.started(self)
        pull = self._scheduler.pull
        twins = self._scheduler.twins
        retirable = self._retirable
        while self.lost is None:
            if retirable:
                taken = await self._pull_unless_retired()
                if taken is None:
                    break
                batch = taken
            else:
                await self._wait_breaker()
                batch = await pull(self)
            if twins:
                batch = self._keep_apart(batch)
                if not batch:
                    self.risking = False  # (the scheduler marked it with the batch)
                    continue
            self._in_flight.append(batch)
            self.risking = may_hang(batch)
            try:
                await self._execute(batch)
            finally:
                self.risking = False
            self._in_flight.clear()
        else:
            # Its device is lost: it pulls no more (one being retired ends, as retired)
            if not self._retire_asked.is_set():
                await trio.sleep_forever()
        # Retired: its batch answered (a straggling thread returned: _execute waits
        # for it), the model it loaded is let go.
        self._runner = None
        self._retired.set()

    @property
    def device_seconds(self) -> float:
        """Seconds its device spent running batches: measured inside the worker process,
        or around the thread/inline call."""
        if self._process:
            w = self._worker
            return self._worker_seconds + (w.busy_seconds if w is not None else 0.0)
        return self.busy_time

    def _load_in_thread(self) -> Any:
        """The backend's load, its StopIteration or SystemExit carried as an ordinary
        error (:class:`_Escaped`), as a model call's are: a load calling
        ``sys.exit()`` ended the program out of ``open_runtime``."""
        try:  # a load that returns no callable (None, say) fails here, not every batch
            return load_runner(self._backend, self.device, self._torch_threads)
        except _ESCAPES as exc:
            raise _Escaped(exc) from exc

    async def _load(
        self, load: Callable[[], Awaitable[Any]], late: Callable[[], str | None] | None = None
    ) -> Any:
        """Run ``load`` (the replica's model load, in a thread or a worker process)
        within the model's ``load_timeout_s`` of wall time (a trio timer would fire at
        once under an autojumping MockClock while a thread loads). Its failure is raised
        as ModelLoadError, naming the model, the replica and the cause (past the
        limit, what ``late`` says of it, if anything: a Ray actor never placed)."""
        cfg = self._config
        limit = cfg.load_timeout_s
        watchdog = self._watchdog
        what = f"model {cfg.name!r}: replica {self.index} on {self.device}"
        with trio.CancelScope() as scope:
            armed = (
                watchdog.arm(limit, scope) if limit is not None and watchdog is not None
                else None
            )
            try:
                return await load()
            except (ConfigError, ModelLoadError):
                raise
            except WorkerProcess.Died as exc:
                details = exc.details  # the traceback in the worker: its last line
                reason = details.rstrip().rpartition("\n")[2] if details else str(exc)
                raise ModelLoadError(
                    f"{what} failed to load: {reason}{WorkerProcess.stderr_note(exc.stderr)}"
                ) from exc
            except Exception as exc:
                cause = exc.exc if type(exc) is _Escaped else exc
                raise ModelLoadError(f"{what} failed to load: {_text(exc)}") from cause
            finally:
                if armed is not None:
                    watchdog.disarm(armed)  # type: ignore[union-attr]
        why = late() if late is not None else None
        raise ModelLoadError(
            f"{what} did not load within {limit:g} s (models.{cfg.name}.load_timeout_s)"
            + (f": {why}" if why else "")
        )

    # ------------------------------------------------------------------ worker process
    async def _start_worker(self) -> None:
        worker: Any
        if self._ray:
            worker = RayReplica(
                self._config, self._backend, self.device, self._torch_threads,
                name=f"{self.label}#{self.index}",
            )
        else:
            worker = WorkerProcess(
                self._config, self._backend, self.device, self._torch_threads,
                zygote=self._zygote,
            )
        try:
            await self._load(worker.start, worker.unplaced if self._ray else None)
        except BaseException:
            await worker.aclose()
            raise
        self._worker = worker

    # ------------------------------------------------------------------ thread, inline
    async def _execute(self, batch: list[Request]) -> None:
        t0 = trio.current_time()
        self._metrics.queue_wait.record_many([t0 - req.arrival for req in batch])
        items = [req.item for req in batch]
        if self._inline:
            try:
                try:
                    outputs = self._backend.conform_outputs(
                        self.model, check_outputs(self._runner(items), len(items))
                    )
                except _ESCAPES as exc:
                    raise _Escaped(exc) from exc
                except Exception:
                    raise
                except BaseException as exc:  # not Exception: see _ESCAPES
                    if isinstance(exc, KeyboardInterrupt):
                        raise
                    raise _Escaped(exc) from exc
            except Exception as exc:
                if device_lost(self.device):
                    self._lose_device(batch, exc)
                else:
                    self._model_failed(batch, exc)
                return
            self._breaker.success()
            self._deliver(batch, outputs, t0)
            return
        deadline = self._timer.deadline()
        with trio.CancelScope() as timer:
            armed = self._arm(deadline, timer)
            try:
                outputs = await trio.to_thread.run_sync(
                    self._run_in_thread, items, limiter=self._limiter, abandon_on_cancel=True
                )
            except _DeviceLost as lost:
                self._lose_device(batch, lost.__cause__ or lost)
                return
            except Exception as exc:
                self._model_failed(batch, exc)
                return
            finally:
                self._disarm(armed)
        if timer.cancelled_caught:
            await self._thread_hung(batch, deadline)
            return
        self._timer.record(trio.current_time() - t0)
        self._breaker.success()
        self._deliver(batch, outputs, t0)

    def _run_in_thread(self, items: list[Any]) -> Any:
        global _threads_running
        with _threads_lock:
            _threads_running += 1
        try:
            return self._backend.conform_outputs(
                self.model, check_outputs(self._runner(items), len(items))
            )
        except _ESCAPES as exc:
            raise _Escaped(exc) from exc
        except Exception as exc:
            if device_lost(self.device):  # a synchronize: here, not on the event loop
                raise _DeviceLost() from exc
            raise
        except BaseException as exc:  # KeyboardInterrupt and the rest: see _ESCAPES
            raise _Escaped(exc) from exc
        finally:
            with _threads_lock:
                _threads_running -= 1

    async def join_thread(self) -> None:
        """Wait until this replica's model call in a worker thread, if any (one given
        up as a straggler, or cut off by shutdown), has returned."""
        if not self._inline and not self._process:
            async with self._limiter:
                pass

    def _arm(self, deadline: float, scope: trio.CancelScope) -> Any:
        return self._watchdog.arm(deadline, scope) if self._watchdog is not None else None

    def _disarm(self, armed: Any) -> None:
        if armed is not None:
            Watchdog.disarm(armed)

    # ------------------------------------------------------------------ hedging
    def holds(self, reply: Any) -> bool:
        """Whether the request of ``reply`` is in one of this replica's batches in
        flight (running, or staged for its worker process)."""
        return any(r.reply is reply for b in self._in_flight for r in b)

    def _keep_apart(self, batch: list[Request]) -> list[Request]:
        """``batch`` without the requests whose hedge twin (the original of a copy, or
        the copy of an original) this replica holds, in flight or earlier in
        ``batch``: those go back to the scheduler for another replica. A copy run
        behind its original on the same device hedges nothing. Called only while
        some hedge is in flight."""
        twins = self._scheduler.twins
        kept: list[Request] = []
        for req in batch:
            twin = twins.get(req.reply)
            if twin is not None and (
                self.holds(twin) or any(r.reply is twin for r in kept)
            ):
                self._scheduler.keep_apart(req)
            else:
                kept.append(req)
        return kept

    # ------------------------------------------------------------------ answers
    def _deliver(self, batch: list[Request], outputs: Any, t0: float) -> None:
        if len(outputs) != len(batch):
            n, m = len(outputs), len(batch)
            self._model_failed(
                batch,
                RuntimeError(
                    f"returned {n} {'output' if n == 1 else 'outputs'} for "
                    f"{m} {'item' if m == 1 else 'items'}"
                ),
            )
            return
        t1 = trio.current_time()
        self.busy_time += t1 - t0
        self._metrics.record_batch(
            len(batch), t1 - t0, t1, max_batch_size=self._config.max_batch_size
        )
        run = (t0, t1 - t0)  # one object per execution: the callers tell them apart
        refused = 0
        wrong: ModelError | None = None
        for req, out in zip(batch, outputs, strict=True):
            reply = req.reply
            if not reply.answerable:
                # Answered already (its deadline passed while the batch ran: see
                # InFlight), or its caller left: one answer per request, never two.
                # Others may wait for what it computed (a coalesced flight's
                # callers): they are handed it.
                late = reply.late
                if late is not None:
                    late.settle(
                        outcome.Error(out) if isinstance(out, ModelError)
                        else outcome.Value(out)
                    )
                continue
            reply.run = run
            if isinstance(out, ModelError):
                # The model answered this item with an output its signature does not
                # declare (ModelBackend.conform_outputs): its caller alone gets that.
                refused += reply.set_error(out)
                wrong = out
                continue
            if reply.suspect and reply.raised_on is not None and reply.set_result(out):
                origin, its_run = reply.raised_on
                if origin is not self:
                    origin._failed_here(its_run)
                continue
            reply.set_result(out)
        if refused:
            self._metrics.statuses["model_error"] += refused
            self._log_model_error(str(wrong), refused)
        twins = self._scheduler.twins
        if twins:
            # Answered: a hedge twin still queued or waiting for a replica need not
            # run (its caller will withdraw it, but not before this replica pulls).
            for req in batch:
                twin = twins.get(req.reply)
                if twin is not None and twin.answerable:
                    twin.withdraw()
        self._scheduler.completed(batch)

    def fail_current(self, error: BaseException) -> int:
        """Fail every still-unanswered request of the batches in flight. A batch its
        closed worker process is known never to have started (staged behind the one
        it ran) is failed as never run (``in_queue``): its callers are not charged."""
        n = 0
        never_started, self._never_started = self._never_started, []
        while self._in_flight:
            batch = self._in_flight.popleft()
            unrun = any(b is batch for b in never_started)
            n += sum(
                # (one among them that ran before, a retry say, stays charged)
                req.reply.set_error(_unrun(own_error(error), unrun and not req.reply.ran))
                for req in batch if req.reply.answerable
            )
            self._scheduler.completed(batch, failed=True)
        return n

    def on_crash(self, exc: BaseException) -> None:
        self.fail_current(ActorBroken(f"{self.name} crashed mid-batch: {exc!r}"))
        self._scheduler.replicas_changed()  # down (restarting) until its run starts again

    def close(self) -> int:
        return self.fail_current(ActorClosed(f"{self.name}: the runtime is shut down"))
