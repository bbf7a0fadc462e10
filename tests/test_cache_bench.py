"""The trace bench's references: Belady against an exhaustive search of every caching
decision on small traces, Perfect-LFU and the LFU oracle on traces worked by hand."""

from __future__ import annotations

import functools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from trioserve.scenarios._cache import belady, lfu_oracle, perfect_lfu


def optimum(trace: list[int], capacity: int) -> int:
    """Most hits any policy (admit or not, evict anything) gets: a search over every
    cache state after every request."""

    @functools.cache
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(trace):
            return 0
        k = trace[i]
        if k in cache:
            return 1 + best(i + 1, cache)
        options = [best(i + 1, cache)]  # decline to cache it
        if len(cache) < capacity:
            options.append(best(i + 1, cache | {k}))
        else:
            options += [best(i + 1, (cache - {v}) | {k}) for v in cache]
        return max(options)

    return best(0, frozenset())


@settings(max_examples=200, deadline=None)
@given(
    trace=st.lists(st.integers(0, 4), min_size=1, max_size=12),
    capacity=st.integers(1, 3),
)
def test_belady_is_the_optimum(trace, capacity):
    hits = belady(np.array(trace, dtype=np.int64), capacity) * len(trace)
    assert round(hits) == optimum(trace, capacity)


def test_perfect_lfu_remembers_the_counts_of_evicted_keys():
    trace = [1, 1, 2, 2, 3, 3, 3, 1, 2]
    # 1 and 2 fill the cache and hit once each (count 2). 3 is refused at counts 1 and
    # 2 (not more than 2) and displaces 1 at count 3. 1 was evicted but keeps its count:
    # its next request makes it 3, which displaces 2 (2). 2 then has 3, which does not
    # beat 3 or 1 (3 each). Two hits.
    assert perfect_lfu(trace, 2) == 2 / 9
    assert perfect_lfu(trace, 3) == 6 / 9  # room for all: every repeat hits


def test_the_lfu_oracle_holds_the_most_frequent_keys_less_their_first_request():
    trace = np.array([5, 5, 5, 7, 7, 9])
    assert lfu_oracle(trace, 1) == 2 / 6
    assert lfu_oracle(trace, 2) == 3 / 6
    assert lfu_oracle(trace, 3) == 3 / 6
