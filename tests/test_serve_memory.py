"""``trioserve serve`` tunes the cyclic GC once its models are loaded."""

from __future__ import annotations

import gc

from trioserve.transport._main import GC_YOUNG_THRESHOLD, settle_memory


def test_settle_memory_freezes_what_is_loaded_and_raises_the_young_threshold():
    before = gc.get_threshold()
    loaded = [[i] for i in range(100)]  # tracked objects alive before serving starts
    try:
        settle_memory()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() >= len(loaded)
        assert gc.get_count()[0] < GC_YOUNG_THRESHOLD
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
