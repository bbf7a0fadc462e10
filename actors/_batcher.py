"""The batcher actor: one per replica (device). When its device is free it pulls a
closed batch from the scheduler, runs the model off the event loop (a worker process,
a worker thread, no lock held, or inline) and answers each request's reply slot.

Every batch runs against a deadline learnt from the model's recent batch times
(:class:`BatchTimer`). A batch past it is a straggler: a worker process is killed and
replaced (forked from the zygote, ~0.1 s); a worker thread cannot be killed, so the
replica is degraded — it pulls nothing — until the thread returns. Either way the
batch goes back to the scheduler split in ``retry_parts`` (each request alone when it
held no more), so retries narrow down to the request at fault while the rest succeed;
a request that fails alone ``poison_attempts`` times is answered with a
poison-request error and never retried. A hung thread's parts run only where a
replica can be spared (``SchedulerActor.spare``), and a request that hung a thread
alone is poison at once when running it again would take the model's last ready
replica: one hanging input cannot degrade every thread replica. A batch whose model
raised is split the same way, so only the input that raises gets the error. A worker
process runs such a retry with nothing staged behind it: were it to hang or kill its
worker again, what was staged would wait out its deadline and go back too.

A request's own deadline (its model's or class's ``timeout_ms``) that passes while its
batch is in flight (running in a thread or a worker, or staged) is answered then,
DeadlineExceeded, and the batch goes on for the others (:class:`InFlight`, on the
watchdog's wall clock); the batch's answer, and its retries, skip it. Inline, nothing
interrupts the model: its requests wait for the batch.

A model that raises counts towards the replica's breaker only on evidence that the
replica, not its inputs, is at fault (:class:`Breaker`): a part of a failed batch that
raised alone here is run once on another replica, and a result there counts; a request
alone on fresh work counts once other replicas of the model succeed meanwhile. A
replica broken while the others are fine (a sticky CUDA error) is isolated, and its
worker process replaced when the breaker opens; a model raising everywhere, or on
some inputs everywhere (poison inputs), opens none.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import outcome
import trio
from trioserve import (
    Actor,
    ActorBroken,
    ActorClosed,
    ActorState,
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
    exception_text,
    load_runner,
)

from ._in_flight import InFlight
from ._metrics import ModelMetrics
from ._retiring import Retiring
from ._scheduler import SchedulerActor, _unrun
from ._singleflight import own_error
from ._straggler import (
    BatchTimer,
    Breaker,
    Hang,
    LogThrottle,
    StragglerPolicy,
    mark_hung,
    may_hang,
    retried,
    split,
    split_failed,
    to_retry,
)
from ._watchdog import Watchdog
from ._worker_feed import WorkerFeed

log = logging.getLogger("trioserve")

#: Every health a replica may have (:attr:`BatcherActor.health`): the running
#: replica's, then the actor's states when it is not running.
REPLICA_HEALTH = (
    "ready", "half_open", "open", "degraded", "replacing", "retiring", "lost",
    "starting", "restarting", "stopped", "broken",
)
#: The healths of a replica that takes work (``BatcherActor.ready``).
_SERVING = frozenset({"ready", "half_open"})


class _DeviceLost(Exception):
    """The model raised in a worker thread and left its device unusable
    (``trioserve.device_lost``); the model's exception is its cause."""


_threads_lock = threading.Lock()
_threads_running = 0


def model_threads_running() -> int:
    """How many model calls are running in worker threads, in the whole process
    (stragglers whose batch was given up included: a thread cannot be stopped)."""
    return _threads_running


class _Escaped(Exception):
    """A model's StopIteration or SystemExit, carried as an ordinary error: out of a
    worker thread the first reached the batcher as "RuntimeError: coroutine raised
    StopIteration" (PEP 479), and the second ended the batcher, and with it the
    runtime. The model's own exception is ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc


#: What a model may raise that is not an ordinary error in the batcher's loop. Any
#: other BaseException (GeneratorExit, a class of the model's own) is carried so
#: too; only a KeyboardInterrupt inline is left alone: there it is the process's
#: Ctrl-C. In a worker thread it is the model's own raise (a signal's
#: KeyboardInterrupt is only ever raised in the main thread), and it used to end
#: the runtime, its request unanswered.
_ESCAPES = (StopIteration, StopAsyncIteration, SystemExit)


def _text(exc: BaseException) -> str:
    """``Type: message`` of an exception a model raised. One whose ``str()`` raises
    too is said so: formatting it crashed the replica that was answering with it
    (ActorBroken for its batch, a restart spent)."""
    return exception_text(exc.exc if type(exc) is _Escaped else exc)


def _all_lost(scheduler: SchedulerActor) -> bool:
    """Whether every replica of ``scheduler``'s queue (all of them started) lost its
    device: none will ever pull from it again."""
    return len(scheduler.batchers) == scheduler.replicas and all(
        b.lost is not None for b in scheduler.batchers
    )


def retire_if_lost(scheduler: SchedulerActor, text: str) -> None:
    """Retire ``scheduler``'s queue, and with it the model's other lanes when none
    of them serves either, once every replica of it lost its device (the last one:
    ``text``; see :meth:`BatcherActor._lose_device`). Called when a replica loses its
    device, and when an autoscaled model's retired replica leaves the replicas that
    all lost theirs. Not a checkpoint."""
    model = scheduler.model
    if not _all_lost(scheduler):
        return
    # Nothing will ever serve its queue: answer what waits, and what comes, at once
    # (not at its deadline). While another lane of the model serves, the model is
    # ready and the error names the lane; once none does, every lane refuses with
    # the model's error (a lane retired before is retired again with it).
    if any(not _all_lost(lane) for lane in scheduler.lanes):
        scheduler.retire(ModelError(
            f"model {model!r}: no replica can serve its {scheduler.lane} any "
            f"more: each left its device unusable (here: {text}); its other "
            "requests are still served; restart the server to recover the lane"
        ))
        return
    error = ModelError(
        f"model {model!r}: no replica can serve it any more: each left its "
        f"device unusable (here: {text}); restart the server"
    )
    for lane in scheduler.lanes:
        lane.retire(error)


class BatcherActor(WorkerFeed, Retiring, Actor):
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

    # ------------------------------------------------------------------ health
    @property
    def health(self) -> str:
        """``ready`` (pulling work), ``half_open`` (pulling work on probation: its
        circuit breaker's cooldown passed, and its next good batch closes it, a
        failure opens it again), ``lost`` (a thread or inline replica whose model
        left its device unusable: it serves no more), ``degraded`` (a straggling
        thread still runs),
        ``replacing`` (a new worker process is starting), ``open`` (its circuit breaker
        is open after repeated failures: it pulls nothing), ``retiring`` (the
        autoscaler retires it: it finishes what it holds and pulls no more), or the
        actor's state when it is not running (starting, restarting, stopped, broken).
        One of :data:`REPLICA_HEALTH`."""
        if self.state is not ActorState.RUNNING:
            return self.state.value
        if self.lost is not None:
            return "lost"
        if self._retire_asked.is_set():
            return "retiring"
        if self._degraded:
            return "degraded"
        if self._replacing:
            return "replacing"
        now = trio.current_time()
        if self._breaker.is_open(now):
            return "open"
        if self._breaker.half_open(now):
            return "half_open"
        return "ready"

    @property
    def ready(self) -> bool:
        """Whether it takes work: ``ready``, or ``half_open`` (its trial needs work
        to run, and a readiness probe that turned a lone replica's traffic away
        would hold its breaker half-open)."""
        return self.health in _SERVING

    async def _wait_breaker(self) -> None:
        """Wait while the breaker is open; a worker replacement falling due (another
        replica's evidence opened it) ends the wait early."""
        until = self._breaker.open_until
        if trio.current_time() < until and not self._replace_due:
            with trio.move_on_at(until):
                await self._replace_wake.wait()

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

    async def _load(self, load: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``load`` (the replica's model load, in a thread or a worker process)
        within the model's ``load_timeout_s`` of wall time (a trio timer would fire at
        once under an autojumping MockClock while a thread loads). Its failure is raised
        as ModelLoadError, naming the model, the replica and the cause."""
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
        raise ModelLoadError(
            f"{what} did not load within {limit:g} s (models.{cfg.name}.load_timeout_s)"
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
            await self._load(worker.start)
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
            # A thread cannot be killed: hand the batch back and pull nothing until
            # the thread returns (it holds the replica's limiter until then). Its
            # parts run again only where a replica can be spared (SchedulerActor.
            # _unspared), and a request that hung it alone is not run again where
            # that would take the model's last ready replica.
            self.stragglers += 1
            self._metrics.statuses["straggler"] += 1
            if not retried(batch):  # a retry's failure is its requests' (see _lose)
                self._breaker.failure(trio.current_time())
            hang = Hang()
            mark_hung(batch, hang)
            scheduler = self._scheduler
            why = f"its batch ran past its deadline of {deadline:.3f}s"
            # its inputs, should they come again; its hedge twins
            scheduler.note_hang(batch, hang, self, why)
            self._suspect(
                batch, why,
                # it ran alone (not a batch-mate left after the others' answers),
                # and other replicas serve: a lone replica's retry waits for its
                # thread, as before (the model is down until it returns anyway)
                last=len(batch) == 1 and scheduler.replicas > 1 and scheduler.spare(self) < 2,
            )
            self._in_flight.clear()  # handed back: no longer this replica's to answer
            scheduler.after_hang(hang, self)
            self._degraded = True
            try:
                async with self._limiter:
                    pass
            finally:
                self._degraded = False
                hang.returned = True
                self._scheduler.thread_returned()
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

    def _lose_device(self, batch: list[Request], exc: BaseException) -> None:
        """The model raised and left this replica's device unusable for the rest of
        the process (a CUDA device-side assert, an illegal memory access): every
        later call here would fail, and nothing can replace a thread's or the event
        loop's device context. The batch's callers get the error (not retried: each
        run of the input that did this would take one more device), and the replica
        serves no more; the model is ready while another replica is."""
        text = _text(exc)
        self.lost = text
        self._scheduler.replicas_changed()  # it is no longer ready
        self._metrics.statuses["device_lost"] += 1
        log.error(
            "%s: the model left its device unusable (%s); this replica serves no more. "
            "Restart the server to recover it; with execution = \"process\" its worker "
            "would be replaced", self.name, text,
        )
        msg = (
            f"model {self.model!r} failed on {self.device} and left it unusable: {text}"
        )
        self._answer_error(batch, [r for r in batch if r.reply.answerable], msg)
        retire_if_lost(self._scheduler, text)

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
    def _suspect(self, batch: list[Request], why: str, *, last: bool = False) -> None:
        """A batch timed out or lost its worker: retry it in parts; a request that
        fails alone too often is poison. ``last``: the batch, one request, hung
        this replica's thread, and of the model's other replicas fewer than two are
        ready to serve, so that request is poison at once: run again, it would
        hang the model's last ready replica (or wait for one to spare, while none
        may ever come back)."""
        self._scheduler.completed(batch, failed=True)
        policy = self._timer.policy
        retry, poison = split_failed(
            to_retry(batch), poison_attempts=1 if last else policy.poison_attempts,
            parts=policy.retry_parts,
        )
        for req in poison:
            if req.reply.attempts < policy.poison_attempts:
                msg = (
                    f"model {self.model!r}: poison request, not retried: {why} when "
                    "it ran alone, its worker thread still runs, and no other "
                    "replica can be spared to run it again (it would hang the "
                    "model's last ready replica)"
                )
            else:
                msg = (
                    f"model {self.model!r}: poison request, not retried: {why} each of "
                    f"the {req.reply.attempts} times it ran alone"
                )
            req.reply.set_error(ModelError(msg))
            self._metrics.statuses["poison"] += 1
        if poison:
            # its input may be in another part of a hung batch (see after_hang)
            self._scheduler.poisoned_alone(poison)
        self._metrics.statuses["retried"] += sum(len(b) for b in retry)
        self._scheduler.retry(retry)

    def _model_failed(self, batch: list[Request], exc: BaseException) -> bool:
        """The model raised. Alone, the request gets the error; in a batch, the batch
        is retried in parts (each request alone when it held no more than
        ``retry_parts``), so that only the input that raises gets it, and each part
        that succeeds is answered at once.

        On fresh work (not a retry) it is also told to the replica's breaker, which
        counts it only when other replicas succeeded since this one began failing
        (:meth:`Breaker.raised`). Returns whether that opened the breaker."""
        opened = not retried(batch) and self._breaker.raised(
            trio.current_time(), self._metrics.successes, alone=len(batch) == 1
        )
        if opened:
            log.warning(
                "%s: circuit breaker open: the model keeps raising here (%s) while "
                "other replicas succeed", self.name, _text(exc),
            )
            self._scheduler.replicas_changed()  # it is no longer ready
        alive = [r for r in batch if r.reply.answerable]
        if len(batch) > 1:  # not alone: any one of them may be the cause
            parts = alive if len(alive) == len(batch) else to_retry(batch)
            if parts:
                self._scheduler.completed(batch, failed=True)
                for r in parts:
                    r.reply.suspect = r.reply.ran = True
                self._metrics.statuses["retried"] += len(parts)
                self._scheduler.retry(split(parts, self._timer.policy.retry_parts))
                return opened
        if len(batch) == 1 and self._elsewhere(batch[0]):
            # A part of a failed batch raised alone here: run it once on another
            # replica. An input bad for the model raises there too (and gets the
            # error); a result there says this replica fails on sound input. An
            # item answered while it ran (its deadline passed) that others wait
            # for goes there too, carried (to_retry), as its request would have.
            part = alive or to_retry(batch)
            if part:
                self._scheduler.completed(batch, failed=True)
                part[0].reply.raised_on = (self, self._breaker.run)
                self._metrics.statuses["retried"] += 1
                self._scheduler.retry([part])
                return opened
        msg = f"model {self.model!r} failed on {self.device}: {_text(exc)}"
        self._answer_error(batch, alive, msg)
        self._log_model_error(msg, len(alive))
        return opened

    def _log_model_error(self, msg: str, answered: int) -> None:
        """Say in the log that callers were answered with the model's error (a 500
        over HTTP): without it, a model that raised left no trace on the server.
        Throttled (:class:`LogThrottle`): at most a line every 10 s a replica."""
        if not answered:
            return
        unlogged = self._errors_logged.admit(trio.current_time())
        if unlogged is None:
            return
        log.error(
            "%s: %s (%d %s answered with it%s)", self.name, msg, answered,
            "request" if answered == 1 else "requests",
            f"; {unlogged} more such failures since the last line" if unlogged else "",
        )

    def _answer_error(self, batch: list[Request], alive: list[Request], msg: str) -> None:
        """Answer ``alive`` (the batch's requests still waiting) with ModelError(msg):
        the batch is done, failed. A request of the batch answered while it ran (its
        deadline passed) whose item others wait for (``Reply.late``, not carried
        into a retry) hands them the same error: the model's for that item, which
        its own caller would have got, and which running the item again would
        only repeat (the model raised on it alone, it is poison, too large, or it
        left its device unusable)."""
        for req in batch:
            reply = req.reply
            late = reply.late
            if (
                late is not None and late.expected and not late.carried
                and not reply.answerable
            ):
                late.settle(outcome.Error(ModelError(msg)))
        for req in alive:
            req.reply.set_error(ModelError(msg))
        self._metrics.statuses["model_error"] += len(alive)
        self._scheduler.completed(batch, failed=True)

    def _elsewhere(self, req: Request) -> bool:
        """Whether ``req``, which raised alone here, is to run once on another
        replica: it is a retry (a part of a batch that failed) that has not raised
        alone elsewhere yet, and another replica is ready."""
        reply = req.reply
        return (
            reply.suspect and reply.raised_on is None and self._scheduler.replicas > 1
            and any(b is not self and b.ready for b in self._scheduler.batchers)
        )

    def _failed_here(self, run: int) -> None:
        """A request that raised alone here during the breaker's run ``run`` was
        answered with a result by another replica (see :meth:`Breaker.confirmed`).
        A worker process whose breaker this opens is replaced before it pulls
        again. A replica whose device is lost takes no more evidence: it serves no
        more anyway."""
        if self.lost is not None or not self._breaker.confirmed(trio.current_time(), run):
            return
        log.warning(
            "%s: circuit breaker open: the model raised here on inputs that other "
            "replicas answered", self.name,
        )
        if self._process:
            self._replace_due = True
            self._replace_wake.set()

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
