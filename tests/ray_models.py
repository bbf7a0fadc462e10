"""Models for the Ray tests, in a module of their own: a replica's Ray actor imports
them by name (the tests put this directory on the actors' PYTHONPATH)."""

from __future__ import annotations

import os
import time

import numpy as np
from trioserve import ModelBackend, TensorSpec

#: x[0] of an item that makes its batch end the actor's process (as a segfault would)
CRASH = -1.0
#: x[0] of an item whose batch hangs, far past any batch deadline of the tests
HANG = -2.0
#: x[0] of an item whose batch raises in the model
RAISE = -3.0
#: x[0] of an item whose batch takes SLOW_S
SLOW = -4.0
SLOW_S = 1.5
#: x[0] of an item whose batch raises KeyboardInterrupt in the model (its own: no
#: signal reaches an actor's call), and of one whose batch raises a BaseException
#: of the model's own
INTERRUPT = -5.0
BASE = -6.0


class ModelsOwnBaseException(BaseException):
    pass


def doubled(items: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """``y = 2 x``, unless the batch holds one of the values above."""
    firsts = {float(it["x"][0]) for it in items}
    if CRASH in firsts:
        os._exit(3)
    if HANG in firsts:
        time.sleep(60)
    if RAISE in firsts:
        raise ValueError("x[0] == -3 is refused")
    if SLOW in firsts:
        time.sleep(SLOW_S)
    if INTERRUPT in firsts:
        raise KeyboardInterrupt("the model's own")
    if BASE in firsts:
        raise ModelsOwnBaseException("x[0] == -6")
    return [{"y": 2 * it["x"]} for it in items]


def fails_to_load() -> ModelBackend:
    """A backend whose load raises, in the replica's actor."""
    return _FailsToLoad()


class _FailsToLoad(ModelBackend):
    inputs = (TensorSpec(name="x", datatype="FP32", shape=(-1,)),)
    outputs = (TensorSpec(name="y", datatype="FP32", shape=(-1,)),)

    def load(self, device: str, *, torch_threads: int = 1):
        raise RuntimeError(f"no weights for {device} here")
