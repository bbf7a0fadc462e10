"""A Ray replica's death is worded one way whichever path found it: a batch's result,
or the watch on an idle actor. No running Ray: Ray's answers are stood in for."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from runtime_helpers import config  # noqa: E402
from trioserve import ModelConfig, RayReplica  # noqa: E402
from trioserve import _ray as ray_module  # noqa: E402
from trioserve.actors._worker_feed import WorkerFeed  # noqa: E402

DEATH = (
    "The actor died unexpectedly before finishing this task.\n\tpid: 4242\n"
    "The actor is dead because it was killed by `ray.kill`."
)


class _Died(ray.exceptions.RayError):
    def __str__(self) -> str:
        return DEATH


class _Feed:
    """What WorkerFeed._watch asks of its batcher: the loss it reports."""

    _worker_kind = RayReplica.KIND
    _died = WorkerFeed._died

    def _lose(self, worker, why, *, died=False):
        self.why = why
        raise RuntimeError(why)


def _replica() -> RayReplica:
    m = config(ModelConfig(name="m", backend="mlp", execution="ray")).model("m")
    replica = RayReplica(m, m.backend, "cpu", 1, name="m#0")
    # started, as far as it knows: an actor, its watch, one batch in flight
    replica._actor = object()
    replica._watch = object()
    replica._refs.append(object())
    replica.pid = 4242
    return replica


async def test_an_actor_death_is_worded_the_same_by_a_result_and_by_the_watch(monkeypatch):
    async def dies(ref):
        raise _Died()

    monkeypatch.setattr(ray_module, "wait_ref", dies)
    # found by a batch's result: its error says what the feed says of the death
    replica = _replica()
    with pytest.raises(RayReplica.Died) as died:
        await replica.result()
    feed = _Feed()
    by_result = feed._died(replica)
    assert by_result == f"its {RayReplica.KIND} died ({died.value})"
    # found by the watch on an idle actor: it said "its Ray actor exited (pid 4242)",
    # and the first "... died (the Ray actor trioserve:m#0:<id> died: ...)"
    with pytest.raises(RuntimeError):
        await WorkerFeed._watch(feed, _replica())
    assert feed.why == by_result == (
        "its Ray actor died (pid 4242: it was killed by `ray.kill`.)"
    )
    # what is not known is left out
    replica = _replica()
    replica.pid = None
    replica.ended_how = "it was killed by `ray.kill`."
    assert replica.died_of() == "it was killed by `ray.kill`."
    replica.ended_how = None
    assert replica.died_of() == "Ray gave no reason"
