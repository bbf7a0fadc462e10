"""The rollout suite's scenarios: a model with three versions (1: the model's backend,
the stable one; 2: weights of its own, the canary; 3: weights of its own, the shadow),
a rollout's rules, the inputs each version fails on, per-version latencies, the
callers (:class:`RCall`) and the operator's actions (:class:`ROp`), their times in
ticks. :func:`rollout_scenarios` draws one;
``fuzz/_rollout.py`` plays it.
"""

from __future__ import annotations

from typing import Any

import attrs
from hypothesis import strategies as st

#: One tick of scenario time: a power of two, so every sum of ticks is exact.
TICK = 2.0**-10
#: How long after the last arrival a caller may take before it counts as lost.
HORIZON_S = 3600.0
#: The inputs callers send: 0 .. INPUTS - 1.
INPUTS = 8


@attrs.frozen(kw_only=True)
class RCall:
    """A caller arriving at ``at`` (ticks) with the inputs ``xs``: ``infer`` of one
    (``batch`` False and one input) or ``infer_batch``; ``version`` names a version,
    or None for an unversioned request the rollout routes."""

    at: int = 0
    xs: tuple[int, ...] = (0,)
    batch: bool = False
    version: str | None = None


#: The operator's actions (docs/rollout.md), as the runtime's methods name them.
ACTIONS = ("promote", "rollback", "pause", "resume", "start")


@attrs.frozen(kw_only=True)
class ROp:
    """The operator's ``action`` at ``at`` (ticks): promote, rollback (for ``reason``;
    an empty one is refused as invalid input), pause, resume, or start (a new trial
    of ``canary``, with ``steps`` of its own or the configuration's; the stable or
    the shadow as its canary is refused as invalid input), through the runtime's
    public methods, whether the rollout's state allows it or not."""

    at: int = 0
    action: str = attrs.field(default="pause", validator=attrs.validators.in_(ACTIONS))
    reason: str | None = None
    canary: str | None = None
    steps: tuple[float, ...] | None = None


@attrs.frozen(kw_only=True)
class RolloutScenario:
    """``canary``: version 2 on trial (else no canary: state stable); ``shadow``:
    version 3 gets copies of stable's answers. ``step_s`` in ticks. ``latency``: each
    version's time per batch (ticks). ``bad``: the inputs the canary raises on,
    ``shadow_bad`` those the shadow raises on. ``timeout``: the callers' deadline
    (ticks; None: none), so that their requests may pass it in a queue (late) or
    while their batch runs; the shadow's copies have none. ``ops``: the operator's
    actions, in time order."""

    canary: bool = True
    shadow: bool = False
    steps: tuple[float, ...] = (0.5,)
    step_s: int = 4
    min_requests: int = 2
    max_error_rate: float = 0.25
    max_latency_ratio: float = 100.0
    shadow_share: float = 1.0
    shadow_queue: int = 2
    max_batch_size: int = 2
    latency: tuple[int, int, int] = (0, 0, 0)
    bad: tuple[int, ...] = ()
    shadow_bad: tuple[int, ...] = ()
    timeout: int | None = None
    calls: tuple[RCall, ...] = ()
    ops: tuple[ROp, ...] = ()


# ---------------------------------------------------------------- strategies
def _timed_ops(ops: list[ROp]) -> tuple[ROp, ...]:
    """The operator's actions at the sums of their gaps; a reason only for a rollback,
    a canary and steps only for a start."""
    at, timed = 0, []
    for op in ops:
        at += op.at
        start = op.action == "start"
        timed.append(attrs.evolve(
            op, at=at, reason=op.reason if op.action == "rollback" else None,
            canary=op.canary if start else None, steps=op.steps if start else None,
        ))
    return tuple(timed)


# Built once, never inside a draw (a fresh strategy object is validated again on its
# first draw).
_GAP = st.sampled_from([0, 0, 0, 1, 1, 2, 3, 4, 8])
_X = st.integers(0, INPUTS - 1)
_XS = st.tuples(_X) | st.lists(_X, min_size=1, max_size=4).map(tuple)
_VERSION = st.sampled_from([None, None, None, None, None, None, "1", "2", "3"])
_CALL = st.builds(RCall, at=_GAP, xs=_XS, batch=st.sampled_from([False, False, True]),
                  version=_VERSION)
_CALLS = st.lists(_CALL, min_size=5, max_size=40)
_STEPS = st.sampled_from(
    [(0.5,), (0.25, 0.5), (0.2, 0.5, 1.0), (0.1, 0.3, 0.6), (1.0,), (0.05, 0.75)]
)
_STEP_S = st.sampled_from([1, 2, 4, 8, 16])
_MIN_REQUESTS = st.sampled_from([1, 1, 2, 3, 5])
_ERROR_RATE = st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0])
_LATENCY_RATIO = st.sampled_from([1.5, 2.0, 100.0, 100.0])
_SHADOW_SHARE = st.sampled_from([1.0, 1.0, 0.5, 0.3])
_LATENCY = st.sampled_from([0, 0, 1, 2, 4, 8])
_BAD = st.sampled_from([(), (), (), (7,), (3, 7), (0, 1, 2, 3)])
_SHADOW_BAD = st.sampled_from([(), (), (5,)])
_TIMEOUT = st.sampled_from([None, None, None, 1, 2, 4, 8])
_START_CANARY = st.sampled_from(["1", "2", "3", "3"])
_START_STEPS = st.sampled_from([None, None, (0.5,), (0.25, 1.0)])
# Pauses and resumes most, so that pauses of every length hold steps (and a resume
# meets a step already long enough); a promote or rollback ends the trial, and
# later actions are refused, but a start (of any version: the stable's and the
# shadow's are refused) begins a new one.
_OP = st.builds(
    ROp,
    at=st.sampled_from([0, 1, 2, 4, 4, 8, 8, 16, 32]),
    action=st.sampled_from(["pause", "pause", "resume", "resume", "promote", "rollback",
                            "start", "start"]),
    reason=st.sampled_from(["operator", "operator", "error rate: by hand", ""]),
    canary=_START_CANARY,
    steps=_START_STEPS,
)
_OP_LIST = st.lists(_OP, max_size=5)
# A start drawn alone mostly comes while a canary is on trial (refused), or after
# the last caller: half the operator's promotes and rollbacks are followed, soon, by
# a start, a new trial against the version the ended one left taking every
# unversioned request (the promoted canary, or the stable), with callers still to
# come.
_THEN_START = st.booleans()
_START = st.builds(ROp, at=st.sampled_from([0, 1, 2, 4]), action=st.just("start"),
                   canary=_START_CANARY, steps=_START_STEPS)


@st.composite
def _op_lists(draw: st.DrawFn) -> tuple[ROp, ...]:
    ops = []
    for op in draw(_OP_LIST):
        ops.append(op)
        if op.action in ("promote", "rollback") and draw(_THEN_START):
            ops.append(draw(_START))
    return _timed_ops(ops)


_OPS = _op_lists()


@st.composite
def rollout_scenarios(draw: st.DrawFn) -> RolloutScenario:
    calls = draw(_CALLS)
    at, timed = 0, []
    for c in calls:  # times accumulate the gaps
        at += c.at
        timed.append(attrs.evolve(c, at=at))
    shadow = draw(st.booleans())
    kw: dict[str, Any] = {}
    if shadow:
        kw = {
            "shadow_share": draw(_SHADOW_SHARE),
            "shadow_queue": draw(st.integers(1, 3)),
            "shadow_bad": draw(_SHADOW_BAD),
        }
    return RolloutScenario(
        canary=draw(st.sampled_from([True, True, True, False])),
        shadow=shadow,
        steps=draw(_STEPS),
        step_s=draw(_STEP_S),
        min_requests=draw(_MIN_REQUESTS),
        max_error_rate=draw(_ERROR_RATE),
        max_latency_ratio=draw(_LATENCY_RATIO),
        max_batch_size=draw(st.integers(1, 3)),
        latency=(draw(_LATENCY), draw(_LATENCY), draw(_LATENCY)),
        bad=draw(_BAD),
        timeout=draw(_TIMEOUT),
        calls=tuple(timed),
        ops=draw(_OPS),
        **kw,
    )

