"""A call's items queued in one pass (``FairQueue.offer_planned`` for a call that
pushes nobody out) leave the queue exactly as ``offer`` item by item does: the same
flows, order, counters, fair-share state, expiry heap and statistics, and the same
refusal at the same item. Driven directly with time as an argument.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from trioserve import Overloaded, Request
from trioserve.actors import BatchLimits, ClassSpec, FairQueue

_T = ("a", "b", "c")
_C = ("hi", "lo")


def _state(q: FairQueue, order: list[Request]) -> dict[str, Any]:
    """Everything admission reads or writes, requests named by their place in
    ``order`` (two queues hold different request objects)."""
    at = {id(r): i for i, r in enumerate(order)}

    def ids(rs: Any) -> list[int]:
        return [at[id(r)] for r in rs]

    return {
        "flows": [[(t, ids(d)) for t, d in f.items()] for f in q._flows],
        "active": [[(t, ids(d)) for t, d in f.items()] for f in q._active],
        "active_is_flow": [
            all(d is q._flows[c][t] for t, d in f.items()) for c, f in enumerate(q._active)
        ],
        "vt": [list(v.items()) for v in q._vt],
        "floor": list(q._floor),
        "arrivals": [ids(a) for a in q._arrivals],
        "cost": [list(c.items()) for c in q._cost],
        "counts": (q._count, q._dead, q._total_cost, q._seq, q._capacity),
        "tenant_count": list(q._tenant_count.items()),
        "expiry": [(d, s, at[id(r)]) for d, s, r in q._expiry],
        "copies": ids(q._copies),
        "stats": [
            (k, s.admitted, s.shed, s.hedged, s.queued, s.pushed_out, s.gave_way)
            for k, s in q.stats.items()
        ],
        "replies": [
            (r.reply.state, r.reply.on_cancel is not None, r.reply.error is not None)
            for r in order
        ],
    }


@given(
    bound=st.integers(1, 12),
    share=st.sampled_from([1.0, 1.0, 1.0, 0.5]),
    rate=st.sampled_from([0.0, 0.0, 2.0, 10.0, 100.0]),
    in_service=st.integers(0, 5),
    batch_time=st.sampled_from([0.0, 0.05, 0.5]),
    aging=st.sampled_from([math.inf, 0.1, 1.0]),
    before=st.lists(
        st.tuples(
            st.integers(0, 2),  # tenant
            st.integers(0, 1),  # class
            st.integers(1, 3),  # cost
            st.sampled_from([math.inf, 0.5, 2.0]),  # deadline
            st.sampled_from(["queued", "queued", "withdrawn", "spare"]),
        ),
        max_size=12,
    ),
    caller=st.integers(0, 2),
    cls=st.integers(0, 1),
    costs=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    deadline=st.sampled_from([math.inf, 0.3, 1.0, 5.0]),
    expiry=st.booleans(),
)
def test_a_call_queued_in_one_pass_leaves_the_queue_as_its_items_one_by_one(
    bound, share, rate, in_service, batch_time, aging, before, caller, cls, costs,
    deadline, expiry,
):
    def build() -> tuple[FairQueue, list[Request], list[Request]]:
        q = FairQueue(
            BatchLimits(max_size=2, max_wait=0.0),
            bound=bound,
            model="m",
            adaptive=False,
            classes=(ClassSpec(name="hi"), ClassSpec(name="lo", aging=aging)),
            weights={"a": 1.0, "b": 2.0, "c": 0.5},
            shares={_T[caller]: share},
        )
        q.rate, q.in_service, q.batch_time = rate, in_service, batch_time
        held = []
        for t, c, cost, d, how in before:
            r = Request(
                model="m", item=None, cost=cost, tenant=_T[t], priority=_C[c],
                deadline=d, answer_expiry=d < math.inf,
            )
            held.append(r)
            if how == "spare":
                q.offer_spare(r, 0.0)
                continue
            try:
                q.offer(r, 0.0)
            except Overloaded:
                continue
            if how == "withdrawn":
                r.reply.withdraw()
        call = [
            Request(
                model="m", item=None, cost=cost, tenant=_T[caller], priority=_C[cls],
                deadline=deadline, answer_expiry=expiry and deadline < math.inf,
            )
            for cost in costs
        ]
        return q, held, call

    q1, held1, call1 = build()
    q2, held2, call2 = build()
    assert _state(q1, held1) == _state(q2, held2)

    def run(q: FairQueue, call: list[Request], one_pass: bool) -> str | None:
        try:
            if not one_pass or not q._offer_call(call, 0.0):
                for r in call:
                    q.offer(r, 0.0)
        except Overloaded as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    assert run(q1, call1, True) == run(q2, call2, False)
    assert _state(q1, held1 + call1) == _state(q2, held2 + call2)
