"""The runtime suite's model and simulated device.

The model (:class:`EchoModel`) runs inline and echoes its input, each item's input
naming its call and item (:func:`item_input`, :func:`part_id`), so an answer says whose
it is. The batchers are the product's (:func:`batcher_class`), with ``_execute``
preceded by a trio sleep for the batch's latency (the slowest item's, a straggler holds
the whole batch back) and, for a "crash" item, a raise that crashes the replica so its
supervisor restarts it; a replica with ``Scenario.pipeline`` above 1 holds that many
batches in flight, as a worker process's pipeline does. Every batch a replica starts
is noted as an :class:`Execution` and checked as it starts (``Run.check_started``).

In a ``Scenario.running`` scenario the replicas run their batches off the event loop:
the product's worker-process path (``BatcherActor._serve_worker``, ``_collect``,
``_lose``) feeds a :class:`SimWorker`, a worker process in trio time
(:class:`TrioWorker`, which the cache suite uses too) whose batches complete when
their latency says (a "crash" item kills it, :func:`death_of`: at the end of its
batch, or after writing that batch's result, its exit found before the results it
wrote are read, or while its batch is sent; killed as a straggler, it may have
written the late batch's result just as its deadline passed,
:meth:`SimWorker._writes_as_cut_off`; dead or cut off so, it may not have read
the batch after it yet, and says so, ``never_read``, or cannot say,
:meth:`SimWorker._reads_next`), and the watchdog is a
:class:`~fuzz._driven.DrivenWatchdog`, whose clock is trio's and whose deadlines a task of the
scenario fires: so the runtime's deadlines of requests in running batches, the batch
cut-off and a dead worker's hand-back all run as they do in production, and replay
exactly.
"""

from __future__ import annotations

import collections
import math
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import trio
import trioserve
import trioserve.actors
from trioserve import ModelBackend, TensorSpec, WorkerProcess

from ._scenario import MS
from ._stats import note

if TYPE_CHECKING:
    from ._runtime import Run

#: An item's x is KEY_SPAN * key + [0, 1, ..., cost - 1]: each part of a split item
#: still names its call and item, and the exact output proves whose answer it is.
KEY_SPAN = 1000


# ---------------------------------------------------------------- the model
X = TensorSpec(name="x", datatype="FP64", shape=(-1,))
Y = TensorSpec(name="y", datatype="FP64", shape=(-1,))


def item_input(key: int, cost: int) -> np.ndarray:
    return KEY_SPAN * key + np.arange(cost, dtype=np.float64)


def item_key(call: int, item: int) -> int:
    """The key of item ``item`` of call ``call`` (a call has at most four items)."""
    return call * 4 + item


def part_id(x: np.ndarray) -> tuple[int, int]:
    """(item key, offset of the part's first element)."""
    first = int(x[0])
    return first // KEY_SPAN, first % KEY_SPAN


class EchoModel(ModelBackend):
    """Items cost their length; returns each input as its output; raises on a batch
    holding an item whose fault is "error". Runs inline."""

    inputs = (X,)
    outputs = (Y,)
    default_execution = "inline"
    supports_split = True

    def __init__(self, run: Run, *, padded: bool) -> None:
        self._run = run
        self.padded = padded

    def prepare(self, name: str, inputs: Any) -> tuple[Any, int]:
        it, _ = super().prepare(name, inputs)
        return it, int(it["x"].shape[0])

    def load(self, device: str, *, torch_threads: int = 1) -> Any:
        run = self._run

        def forward(items: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
            ex = run.current
            run.current = None
            parts = [part_id(it["x"]) for it in items]
            if ex is None or ex.parts != parts:
                run.violations.append(
                    ("duplicated", f"the model ran {parts} outside a batch a replica started")
                )
            bad = [k for k, _ in parts if run.fault(k) == "error"]
            broken = ex is not None and run.broken_at(ex.replica, trio.current_time())
            if ex is not None:
                run.replicas.at_model(ex, ex.reqs, broken)
                ex.status = "error" if bad or broken else "ok"
            if broken:
                raise RuntimeError(f"planted broken replica {ex.replica}")  # type: ignore[union-attr]
            if bad:
                raise ValueError(f"planted model error on item {bad[0]}")
            return [{"y": it["x"].copy()} for it in items]

        return forward

    def split(self, item: Any, budget: int) -> list[tuple[Any, int]]:
        x = item["x"]
        chunks = [x[i : i + budget] for i in range(0, len(x), budget)]
        return [({"x": c}, len(c)) for c in chunks]

    def merge(self, parts: list[Any]) -> dict[str, np.ndarray]:
        return {"y": np.concatenate([p["y"] for p in parts])}


@attrs.define(eq=False)
class Execution:
    """One batch a replica started: when, which parts, and how it ended: "ok" (the
    model answered), "error" (the model raised), "crash" (the replica crashed), or
    "cut" (cancelled at shutdown before the model ran); on a worker
    (``Scenario.running``) also "died" (its worker died running it), "killed" (its
    worker was killed while it ran: cut off, or lost; the replica retries it as a
    suspect), "returned" (staged behind, handed back as it was when its worker
    went) and "wrote" (its worker, dead or cut off, had written its result, unread:
    it ran to its end, never to run again; "ok" or "error" once the result is
    read)."""

    at: float
    replica: int
    parts: list[tuple[int, int]]
    #: its requests (for the reference of the replicas, fuzz/_replicas.py)
    reqs: list[Any] = attrs.Factory(list)
    status: str = "cut"
    end: float | None = None
    #: per request: (part, hedge copy?), and whether it ran before (a retry)
    keys: list[tuple[int, int, bool]] = attrs.Factory(list)
    retried: list[bool] = attrs.Factory(list)
    #: when the model was called: its replica broken, each reply still answerable,
    #: another replica of its lane ready, each hedge twin still answerable
    broken: bool = False
    answerable: list[bool] = attrs.Factory(list)
    others_ready: bool = False
    twins_answerable: list[bool] = attrs.Factory(list)
    #: it raised on a part alone that is to run once on another replica
    marked: bool = False
    #: on a worker: when the device begins it, and when it is done
    begins: float = 0.0
    done: float = 0.0
    #: on a worker: the device began it (the model ran it, or its worker was lost
    #: or replaced while it ran it); one handed back unsent or staged never began
    reached: bool = False


def batch_latency(run: Run, replica: int, parts: list[tuple[int, int]]) -> float:
    """Seconds of trio time the batch of ``parts`` takes on replica ``replica``."""
    return (
        run.scenario.batch_latency_ms + run.replica_delay(replica)
        + max(run.latency(k) for k, _ in parts)
    ) * MS


class TrioWorker:
    """A worker process in trio time, as the product's worker-process path drives one
    (``submit``, ``result``, ``kill``, ``alive``, ``wait_exited``, ``aclose``): its
    device runs the batches submitted in order, each for its latency from when the
    one before is done; ``result`` answers the oldest when it is done (the model,
    ``runner``, runs then), or raises ``Died`` when the worker was killed (a cut-off,
    a loss) or died. What a suite sees of it is in its hooks: :meth:`_stage` (a batch
    is handed to it: its record and latency), :meth:`_dies` (whether it dies at the
    end of a batch), :meth:`_runs` (the model is about to run a batch) and
    :meth:`_killed_holding` (it was killed holding these batches). The batcher that
    kills it as a straggler says so first (:meth:`cut_off`): the results it wrote by
    then are unread in its pipe, as a dead worker's are. Used by the runtime suite
    (:class:`SimWorker`) and the cache suite (``fuzz/_cache.py``)."""

    Died = WorkerProcess.Died
    Failed = WorkerProcess.Failed
    TooLarge = WorkerProcess.TooLarge
    pid: int | None = None
    ended_how: str | None = None
    stderr_tail: str | None = None

    def __init__(self, runner: Any, slots: int) -> None:
        self.SLOTS = slots
        self._runner = runner
        #: per batch held: (its record, its items, when the device begins it, when done)
        self._held: collections.deque[tuple[Any, list[Any], float, float]] = (
            collections.deque()
        )
        self._exited = trio.Event()
        self._killed = False
        self._free_at = -math.inf
        #: the batch being sent now (the worker reads a batch whole before it runs it)
        self._sending: Any = None
        #: once it died on its own: when, and the batch it died running (None: it died
        #: after writing the results of those before, or while one was sent)
        self._death: tuple[float, Any] | None = None
        #: once killed after dying: the batches it finished, their results not read
        self._unread: list[tuple[Any, list[Any], float, float]] = []
        #: and the batch after them, which it died running (None: none, or one sent)
        self._after_unread: Any = None
        #: once killed: how many batches it held, the oldest first, whose results
        #: were written unread (as ``_unread`` was then)
        self.unread_upto = 0
        #: killed as a straggler (:meth:`cut_off`), not dead on its own
        self._cut = False
        #: once killed: how many of the batches it held, the oldest first, reached the
        #: device (those it finished, its results read or not, and the one it ran)
        self.reached_upto = 0
        self.busy_seconds = 0.0
        self.last_run_seconds = 0.0
        #: as a WorkerProcess's: once killed, how many of the batches it held it never
        #: started (those after the first whose result it had not written)
        self.never_started = 0
        #: as a WorkerProcess's: once killed, how many of the batches it held, the
        #: newest, it never read whole (its pipe's word: 0 when it cannot say, a
        #: batch being sent, or :meth:`_reads_next` None)
        self.never_read = 0
        #: what it died of, once it died on its own (a planted death's words)
        self._why: str | None = None

    # ------------------------------------------------ the suite's hooks
    def _stage(self, items: list[Any]) -> tuple[Any, float]:
        """``items`` are handed to the worker: the batch's record, and its latency in
        seconds."""
        raise NotImplementedError

    def _dies(self, record: Any) -> str | None:
        """Why the worker dies at the end of this batch (None: it does not)."""
        return None

    def _runs(self, record: Any) -> None:
        """The model is about to run this batch (synchronously, in ``result``, or in
        ``unread_results`` for one whose result its dead worker wrote unread)."""

    def _killed_holding(self, records: list[Any]) -> None:
        """The worker was killed holding these batches, the oldest first."""

    def _dies_after_writing(self, record: Any) -> bool:
        """Whether the worker dies as soon as it has written this batch's result,
        its exit found (by the batcher's watch on it) before the result is read."""
        return False

    def _died_after_writing(self, record: Any) -> None:
        """It died as soon as it wrote this batch's result (:meth:`_dies_after_writing`)."""

    def _dies_sending(self, record: Any) -> str | None:
        """Whether the worker dies while this batch is sent to it: "send" (the send
        fails), "watch" (its exit is found by the batcher's watch), None: no."""
        return None

    def _read_unread(self, records: list[Any], after: Any) -> None:
        """The batcher read the results its dead or cut-off worker wrote for
        ``records`` (:meth:`unread_results`); ``after``: the batch after them, the
        one it died running, or had just begun when cut off (None: none, or one
        that was being sent)."""

    def _writes_as_cut_off(self, record: Any) -> bool:
        """Whether the worker, killed as this batch (the oldest, running) ran past
        its deadline, had just written its result: done then, unread."""
        return False

    def _reads_next(self, record: Any) -> bool | None:
        """Whether the worker, dead or cut off just as it wrote the result of the
        batch before ``record`` (its results unread), had read ``record`` whole:
        True (it had begun it), False (it had not, and its pipe says so:
        ``never_read``), None (it had not, and its pipe cannot say: ``never_read``
        is 0, and the batcher takes it for begun, as it must)."""
        return True

    # ------------------------------------------------ the worker
    @property
    def alive(self) -> bool:
        return not self._killed  # as WorkerProcess: not killed (it may have died)

    async def start(self) -> None:
        await trio.lowlevel.checkpoint()

    def cut_off(self) -> None:
        """The batcher is about to kill it as a straggler: its oldest batch ran past
        its deadline. What it wrote by then waits in its pipe, unread (the kill
        finds it): that batch's result when it was done just then (the deadline
        and its end at one time), or when it wrote it as the deadline passed
        (:meth:`_writes_as_cut_off`: it is done now)."""
        if self._killed or self._death is not None:
            return
        self._cut = True
        if not self._held:
            return
        record, items, begins, done = self._held[0]
        now = trio.current_time()
        if (
            begins <= now < done and record is not self._sending
            and self._writes_as_cut_off(record)
        ):
            self._held[0] = (record, items, begins, now)

    def kill(self) -> None:
        if not self._killed:
            self._killed = True
            held = list(self._held)
            self._held.clear()
            if self._death is not None:
                # it died: the results it wrote before are in its pipe, unread
                at, running = self._death
                written = 0
                while (
                    written < len(held) and held[written][3] <= at
                    and held[written][0] is not running
                ):
                    written += 1
                self._unread = held[:written]
            else:
                now = trio.current_time()
                written = sum(1 for _, _, _, done in held if done <= now)
                if self._cut:  # (cut off: its results written by now are unread)
                    self._unread = held[:written]
            self.unread_upto = len(self._unread)
            rest = held[written:]
            # (the oldest unfinished was running, unless it was still being sent)
            began = 1 if rest and rest[0][0] is not self._sending else 0
            # Those after it it never read (it reads a batch once the one before is
            # done), nor one being sent (but its pipe cannot say then: a message
            # half written). The oldest unfinished, right after the results it
            # wrote (unread) and not one it died running, it may not have read
            # yet: its pipe may say so.
            self.never_read = len(rest) - began if self._sending is None else 0
            died_running = self._death is not None and self._death[1] is not None
            if began and self._unread and not died_running:
                reads = self._reads_next(rest[0][0])
                if reads is False:
                    began = 0
                    self.never_read = len(rest)
                elif reads is None:
                    self.never_read = 0  # (not known: taken for begun)
            self.never_started = max(0, len(rest) - began)
            self._after_unread = rest[0][0] if began else None
            self.reached_upto = written + began
            self._killed_holding([record for record, _, _, _ in held])
        self._exited.set()

    async def aclose(self) -> None:
        self.kill()
        await trio.lowlevel.checkpoint()

    def died_of(self) -> str:
        """As a WorkerProcess's: its death in words (a planted death's own)."""
        return self._why or "killed"

    def unread_results(self) -> list[tuple[Any, float]]:
        """As a WorkerProcess's: once killed after dying on its own, or as a
        straggler (:meth:`cut_off`), what it wrote for the batches it finished and
        nobody read (a worker that dies after writing them, its exit found first;
        one cut off as it wrote the late batch's), oldest first; the model runs
        them now. A result is read the moment its batch is done otherwise: none
        waits."""
        unread, self._unread = self._unread, []
        if not unread:
            return []
        results: list[tuple[Any, float]] = []
        for record, items, begins, done in unread:
            self._runs(record)
            try:
                results.append((self._runner(items), done - begins))
            except Exception as exc:
                results.append((self.Failed(f"{type(exc).__name__}: {exc}"), 0.0))
        self._read_unread([record for record, _, _, _ in unread], self._after_unread)
        return results

    async def wait_exited(self) -> None:
        await self._exited.wait()

    async def submit(self, items: list[Any]) -> None:
        record, latency = self._stage(items)
        now = trio.current_time()
        if self._death is not None:
            # dead, its exit not found yet: the send fails (it never has the batch)
            self._held.append((record, items, math.inf, math.inf))
            self._sending = record
            raise self.Died("the worker is dead: the send failed")
        dies = self._dies_sending(record)
        if dies is not None:
            # it dies while the batch is sent: it never has it whole, never runs it
            self._held.append((record, items, math.inf, math.inf))
            self._sending = record
            self._death = (now, None)
            self._why = "planted worker death while a batch was sent"
            self._exited.set()
            if dies == "send":
                raise self.Died(self._why)
            await trio.sleep_forever()  # the exit is found first (the batcher's watch)
        begins = max(now, self._free_at)
        self._free_at = begins + latency
        self._held.append((record, items, begins, self._free_at))
        self._sending = record  # (a kill meanwhile finds it never run)
        try:
            await trio.lowlevel.checkpoint()
        finally:
            if not self._killed:
                self._sending = None

    async def result(self) -> Any:
        if self._killed:  # killed before the call: as a WorkerProcess's, Died
            await trio.lowlevel.checkpoint()
            raise self.Died("killed")
        if not self._held:
            raise RuntimeError("fuzz: a result asked of a worker holding no batch")
        record, items, begins, done = self._held[0]
        with trio.move_on_at(done):
            await self._exited.wait()
        if self._exited.is_set():
            raise self.Died("killed")
        why = self._dies(record)
        if why is not None:
            self._death = (done, record)
            self._why = why
            self._exited.set()
            raise self.Died(why)
        writes = [(d, r) for r, _, _, d in self._held if self._dies_after_writing(r)]
        if writes:
            # It dies once it has written a result still to come, its exit found
            # before this one and those up to it are read: they wait in its pipe.
            with trio.move_on_at(writes[0][0]):
                await self._exited.wait()
            if self._exited.is_set():
                raise self.Died("killed")
            self._died_after_writing(writes[0][1])
            self._death = (writes[0][0], None)
            self._why = "planted worker death after writing a result"
            self._exited.set()
            await trio.sleep_forever()  # the batcher's watch finds the exit first
        self._held.popleft()
        self.last_run_seconds = done - begins
        self.busy_seconds += self.last_run_seconds
        self._runs(record)
        try:
            return self._runner(items)
        except Exception as exc:
            raise self.Failed(f"{type(exc).__name__}: {exc}") from exc


class SimWorker(TrioWorker):
    """The runtime suite's worker (``Scenario.running``): a batch's latency is
    :func:`batch_latency`, a batch holding a "crash" item kills it when it is done.
    Killed, it notes how each batch it held ended (the oldest "killed" or "died",
    those staged behind "returned")."""

    def __init__(self, batcher: Any, run: Run, slots: int) -> None:
        super().__init__(batcher._backend.load(batcher.device), slots)
        self._batcher = batcher
        self._run = run
        #: handed back whole when killed (its breaker replaced it): none a suspect
        self.whole = False
        #: when killed: the suspects its oldest batch added, and each batch's key
        #: in the batcher's executions (see :meth:`_read_unread`)
        self._added: set[Any] = set()
        self._gone: dict[int, int] = {}
        #: once killed: the batches it held, the oldest first
        self.held: list[Execution] = []

    def _stage(self, items: list[Any]) -> tuple[Execution, float]:
        batcher = self._batcher
        batch = batcher._in_flight[-1]  # appended just before it is sent
        if len(batch) != len(items) or any(
            r.item is not it for r, it in zip(batch, items, strict=True)
        ):
            raise RuntimeError("fuzz: the batch submitted is not the last one in flight")
        if len(batcher._in_flight) > 1:
            note("runtime", "running: batches staged behind another")
        ex = batcher._stage(batch)
        ex.status = "staged"
        ex.begins = max(ex.at, self._free_at)
        ex.done = ex.begins + batch_latency(self._run, batcher.index, ex.parts)
        batcher._executions[id(batch)] = ex
        return ex, ex.done - ex.begins

    def _crash(self, record: Execution, how: str) -> list[int]:
        """The "crash" items of ``record`` whose worker death is ``how``
        (:func:`death_of`) and, but for "ran", not yet planted."""
        run = self._run
        return [
            k for k, _ in record.parts
            if run.fault(k) == "crash" and death_of(k) == how
            and (how == "ran" or k not in run.deaths)
        ]

    def _dies(self, record: Execution) -> str | None:
        crash = self._crash(record, "ran")
        if not crash:
            return None
        record.status = "died"
        return f"planted worker death on item {crash[0]}"

    def _dies_after_writing(self, record: Execution) -> bool:
        return bool(self._crash(record, "wrote"))

    def _died_after_writing(self, record: Execution) -> None:
        self._run.deaths.update(self._crash(record, "wrote"))
        note("runtime", "running: workers dead after writing results")

    def _writes_as_cut_off(self, record: Execution) -> bool:
        # A mapping of the key of the item that held the batch back (its slowest:
        # the first of them), so a seed's examples are as they were drawn: a
        # quarter of the calls (index 3 mod 4). Never a batch holding a "crash"
        # item (its death is its own).
        run = self._run
        if any(run.fault(k) == "crash" for k, _ in record.parts):
            return False
        slowest = max(record.parts, key=lambda p: run.latency(p[0]))[0]
        if slowest // 4 % 4 != 3:
            return False
        note("runtime", "running: stragglers cut off as they wrote their result")
        return True

    def _reads_next(self, record: Execution) -> bool | None:
        # A mapping of the key of the batch's first part, so a seed's examples are
        # as they were drawn: a third of the calls each way.
        reads = (True, False, None)[record.parts[0][0] % 3]
        note(
            "runtime",
            "running: batches after a written result "
            + {True: "begun", False: "never read", None: "not known if read"}[reads],
        )
        return reads

    def _dies_sending(self, record: Execution) -> str | None:
        crash = self._crash(record, "send")
        if not crash:
            return None
        self._run.deaths.update(crash)
        note("runtime", "running: workers dead while a batch was sent")
        return "send" if crash[0] // 3 % 2 else "watch"

    def _runs(self, record: Execution) -> None:
        record.reached = True
        self._run.current = record

    def _killed_holding(self, records: list[Execution]) -> None:
        self.held = records
        now = trio.current_time()
        replicas = self._run.replicas
        self._added = set()
        for i, ex in enumerate(records):
            if ex.status == "died":
                ex.reached = True
            elif ex.status == "staged" and i < self.unread_upto:
                # its result waits unread in its pipe: it ran to its end
                ex.status = "wrote"
                ex.reached = True
            elif ex.status == "staged":
                began = i == 0 and ex is not self._sending
                # (not only the oldest: one whose result waits unread, its worker
                # killed alive, ran to its end, and the one after it began)
                ex.reached = i < self.reached_upto
                ex.status = "killed" if began and not self.whole else "returned"
                if ex.status == "killed":
                    self._added = set(ex.keys) - replicas.suspects
            ex.end = now
            # (what the replica, handing it back, finds still waiting)
            ex.answerable = [req.reply.answerable for req in ex.reqs]
            replicas.left(ex)
        gone = {id(ex) for ex in records}
        executions = self._batcher._executions
        self._gone = {id(ex): k for k, ex in executions.items() if id(ex) in gone}
        for k in self._gone.values():
            del executions[k]

    def _read_unread(self, records: list[Execution], after: Execution | None) -> None:
        # Its batches were marked as the batcher hands them back when it reads
        # nothing (those whose results were written, "wrote"; the others killed or
        # handed back); it read what the worker wrote: those ran to their end (the
        # model ran them just now), and the one after them is the one it died
        # running, or (cut off) had just begun: handed back as it was, charged
        # (None: it had not read it, and its pipe said so, never_read).
        replicas = self._run.replicas
        replicas.suspects -= self._added
        executions = self._batcher._executions
        for ex in records:
            ex.end = None
            executions[self._gone[id(ex)]] = ex
        note(
            "runtime",
            "running: results read from a "
            + ("cut-off" if self._cut else "dead") + " worker's pipe",
            len(records),
        )
        if after is not None and after.status != "died":
            after.reached = True
            # (replaced, or cut off: it goes back as it was, charged)
            if not self.whole and not self._cut:
                after.status = "died"
                replicas.left(after)


def death_of(key: int) -> str:
    """How a "crash" item kills its worker in a running scenario (a mapping of the
    item's key, so a seed's examples are as they were drawn): "ran" (it dies at the
    end of the batch holding it, every time it runs, its result unwritten), "wrote"
    (once: it dies as soon as it has written that batch's result, its exit found
    before the results still unread are read), "send" (once: it dies while the batch
    is sent to it, which it never had whole)."""
    return ("ran", "wrote", "send")[key % 3]


def batcher_class(base: type, run: Run) -> type:
    """The product's batcher (``base``) on a simulated device: each batch first takes
    its latency in trio time, and a batch holding a "crash" item crashes the replica.
    Every batch a replica starts (fresh from the queue or handed back for a retry) is
    checked against the deadlines and budgets here."""

    class SimulatedDevice(base):  # type: ignore[misc, valid-type]
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            #: on a worker: the execution of each batch it holds, by id(batch)
            self._executions: dict[int, Execution] = {}

        def _stage(self, batch: list[Any]) -> Execution:
            """``batch`` is handed to this replica's device: checked, and noted."""
            parts = [part_id(req.item["x"]) for req in batch]
            ex = Execution(
                at=trio.current_time(), replica=self.index, parts=parts, reqs=list(batch)
            )
            run.executions.append(ex)
            run.check_started(ex, batch)
            run.replicas.started(ex, batch)
            if run.scenario.running:
                run.check_attempts(ex, batch)
            return ex

        async def _execute(self, batch: list[Any], ex: Execution | None = None) -> None:
            if ex is None:
                ex = self._stage(batch)
            try:
                latency = (
                    run.scenario.batch_latency_ms + run.replica_delay(self.index)
                    + max(run.latency(k) for k, _ in ex.parts)
                )
                if latency:
                    await trio.sleep(latency * MS)
                crash = [k for k, _ in ex.parts if run.fault(k) == "crash"]
                if crash:
                    ex.status = "crash"
                    raise RuntimeError(f"planted replica crash on item {crash[0]}")
                run.current = ex  # the inline model runs synchronously inside the next call
                await super()._execute(batch)
            finally:
                # (inline: the model ran and its answers were delivered with no
                # checkpoint since)
                ex.end = trio.current_time()
                run.replicas.ended(ex, batch, ex.end)

        # ------------------------------------------------ on a worker (running)
        def _slots(self) -> int:
            pipeline = run.scenario.pipeline
            return pipeline[self.index] if self.index < len(pipeline) else 1

        async def _start_worker(self) -> None:
            # (the product's, with the worker in trio time for a process)
            worker = SimWorker(self, run, self._slots())
            await self._load(worker.start)
            self._worker = worker

        def _left_worker(self, batch: list[Any]) -> None:
            """``batch``, collected from the worker, was answered or failed."""
            ex = self._executions.pop(id(batch), None)
            if ex is not None:
                ex.end = trio.current_time()
                run.replicas.ended(ex, batch, ex.end)

        def _deliver(self, batch: list[Any], outputs: Any, t0: float) -> None:
            try:
                super()._deliver(batch, outputs, t0)
            finally:
                if self._process:
                    self._left_worker(batch)

        def _model_failed(self, batch: list[Any], exc: BaseException) -> bool:
            try:
                return super()._model_failed(batch, exc)
            finally:
                if self._process:
                    self._left_worker(batch)

        def _lose(self, worker: Any, why: str, *, died: bool = False) -> None:
            fresh = worker.alive
            if not died and fresh:
                worker.cut_off()  # (killed as a straggler)
            try:
                super()._lose(worker, why, died=died)
            finally:
                if fresh:
                    run.check_never_reached(worker.held)

        def _replace_broken(self, worker: Any) -> None:
            worker.whole = True  # its batches go back as they were
            fresh = worker.alive
            try:
                super()._replace_broken(worker)
            finally:
                if fresh:
                    run.check_never_reached(worker.held)

        async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            if run.scenario.running:
                await super().run(task_status=task_status)
                return
            slots = self._slots()
            if slots <= 1:
                await super().run(task_status=task_status)
                return
            # The pipeline of a worker-process replica (BatcherActor._serve_worker):
            # it pulls while it has room, so it holds batches in flight when it
            # pulls (``holds``, ``_keep_apart``), and the device runs them in order.
            # Its worker's loss and replacement are not simulated.
            if self._runner is None:
                self._runner = self._backend.load(self.device)
            task_status.started(self)
            room = trio.Semaphore(slots)
            staged_send, staged_recv = trio.open_memory_channel[tuple[list[Any], Execution]](
                slots
            )
            pull = self._scheduler.pull
            twins = self._scheduler.twins
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._device, staged_recv, room)
                while True:
                    await self._wait_breaker()
                    await room.acquire()
                    batch = await pull(self)
                    if self._in_flight:
                        note("runtime", "pipeline: batches pulled while another was in flight")
                    if twins:
                        batch = self._keep_apart(batch)
                        if not batch:
                            room.release()
                            continue
                    self._in_flight.append(batch)
                    await staged_send.send((batch, self._stage(batch)))
                    if trioserve.actors.retried(batch) and self._scheduler.replicas > 1:
                        # as _serve_worker: nothing staged behind a retry
                        for _ in range(slots):
                            await room.acquire()
                        for _ in range(slots):
                            room.release()

        async def _device(self, staged: Any, room: trio.Semaphore) -> None:
            async for batch, ex in staged:
                await self._execute(batch, ex)
                if self._in_flight and self._in_flight[0] is batch:
                    self._in_flight.popleft()
                room.release()

    return SimulatedDevice

