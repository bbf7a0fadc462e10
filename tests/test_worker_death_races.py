"""A worker process that dies at an awkward moment for its batcher: while a batch is
still being written into its pipe (that batch never reached it: it goes back as
never run, no suspect). Stand-in workers in trio time, whose death the test sets
off; the batcher's two ways of finding it (the watch on its exit, and the call
that failed on its pipe) both taken."""

from __future__ import annotations

import pytest
import trio
import trio.testing
import trioserve
from runtime_helpers import NoZygote, _StandIn, callable_model, item
from trioserve import TenantConfig


def _config(**cfg) -> trioserve.Config:
    """Tenant a with 10 credits (1/s) and a one-replica worker-process model of
    batches of one."""
    return trioserve.Config(
        models=(callable_model(
            "m", lambda items: items, execution="process", adaptive_limit=False,
            max_batch_size=1, max_wait_ms=0, timeout_ms=None, **cfg,
        ),),
        tenants=(TenantConfig(name="a", default=True, credit_rate=1.0, credit_burst=10.0),),
    )


def _credits(rt) -> tuple[int, int]:
    tenant = rt.tenant_statistics()["a"]
    return tenant["credits_used"], tenant["credits_refunded"]


class _Worker(_StandIn):
    """A worker process in trio time. Every one but the first echoes each batch
    (``y = x``) as soon as it is asked for its result. The first answers nothing:
    its results are read only once the runtime kills it; the test makes it die
    (:meth:`die`), and may hold the sending of a batch (``hold_send``) until it
    dies."""

    made: list[_Worker] = []

    def __init__(self, cfg, backend, device, torch_threads, *, zygote=None) -> None:
        self.pid = len(_Worker.made)
        self.busy_seconds = self.last_run_seconds = 0.0
        self.first = not _Worker.made
        self.sent: list[list] = []  # every batch whose sending began
        self.hold_send = False
        self.seen_by = "watch"  # which of the batcher's calls finds the death
        self._read = 0  # results read
        self._killed = trio.Event()
        self._gone = trio.Event()  # exited on its own
        self._exited = self._killed  # (the base's, for aclose)
        _Worker.made.append(self)

    @property
    def alive(self) -> bool:
        return not self._killed.is_set()

    def kill(self) -> None:
        self._killed.set()

    def die(self) -> None:
        self._gone.set()

    async def wait_exited(self) -> None:
        await (self._gone if self.seen_by == "watch" else self._killed).wait()

    async def submit(self, items) -> None:
        self.sent.append(items)
        await trio.lowlevel.checkpoint()
        if self.hold_send:
            await self._gone.wait()  # the worker reads a part of it, and dies
            await trio.lowlevel.checkpoint()
            raise self.Died("pipe broke")

    async def result(self):
        if self.first:
            await self._killed.wait()
            raise self.Died("killed")
        await trio.lowlevel.checkpoint()
        self._read += 1
        return [{"y": it["x"]} for it in self.sent[self._read - 1]]


@pytest.fixture
def worker_class(monkeypatch):
    import trioserve._runtime
    import trioserve.actors._batcher

    _Worker.made = []
    monkeypatch.setattr(trioserve._runtime, "Zygote", NoZygote)
    monkeypatch.setattr(trioserve.actors._batcher, "WorkerProcess", _Worker)
    return _Worker


@pytest.mark.parametrize("seen_by", ["watch", "the send"])
@pytest.mark.parametrize("its_caller", ["stays", "left"])
async def test_a_batch_whose_sending_its_worker_died_in_never_ran(
    autojump_clock, manual_watchdog, worker_class, seen_by, its_caller
):
    """The worker answered a; b was being written into its pipe (longer than the
    pipe holds: the worker reading it) when it died. b never reached the model:
    it goes back as it was, no suspect (no poison attempt counted), not charged
    when its caller left. It used to be taken for the batch the worker died
    running: split as a suspect, an attempt counted towards poison (two such
    deaths made a sound request "poison"), marked as having run, and charged."""
    cfg = _config()
    answers: dict[float, object] = {}
    scope = trio.CancelScope()

    async def caller(rt, value: float) -> None:
        with scope if value == 2.0 else trio.CancelScope():
            answers[value] = (await rt.infer("m", item(value)))["y"].tolist()

    async with trioserve.open_runtime(cfg) as rt, trio.open_nursery() as nursery:
        batcher = rt.models["m"].batchers[0]
        (first,) = worker_class.made
        first.first = False  # it answers a
        nursery.start_soon(caller, rt, 1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert answers[1.0] == [1.0]
        first.hold_send = True
        first.seen_by = "watch" if seen_by == "watch" else "nobody"
        nursery.start_soon(caller, rt, 2.0)
        await trio.testing.wait_all_tasks_blocked()
        ((b,),) = batcher._in_flight
        assert batcher._sending is not None
        if its_caller == "left":
            scope.cancel("the caller left")
            await trio.testing.wait_all_tasks_blocked()
        first.die()
        await trio.testing.wait_all_tasks_blocked()
        assert batcher.workers_lost == 1
        assert batcher._worker is not first
    assert not b.reply.suspect
    assert b.reply.attempts == 0
    assert not b.reply.ran
    if its_caller == "stays":
        assert answers[2.0] == [2.0]  # run on the next worker
        assert _credits(rt) == (2, 0)
    else:
        assert 2.0 not in answers
        assert _credits(rt) == (1, 1)  # b never ran: refunded
