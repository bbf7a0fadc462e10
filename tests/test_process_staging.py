"""Staging a batch into a worker's shared memory: the same layout as ``np.stack``."""

from __future__ import annotations

import numpy as np
import pytest
from trioserve._process import _stack_into


@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (1, 4, 2)])
@pytest.mark.parametrize("n", [1, 7])
def test_stacking_into_a_flat_buffer_matches_np_stack(shape, n):
    rng = np.random.default_rng(n)
    base = rng.standard_normal((n, *shape)).astype(np.float32)
    # rows of one array (views, as a request with a batch dimension gives) and copies
    arrays = [base[i] for i in range(n)] if shape else [np.float32(v) for v in base]
    flat = np.empty(base.size, dtype=np.float32)
    _stack_into(flat, arrays, shape)
    np.testing.assert_array_equal(flat.reshape(base.shape), np.stack(arrays))


@pytest.mark.parametrize("odd", [(3, 2), (4, 3), (2, 3, 1)])
def test_an_item_of_another_shape_is_refused_even_when_the_sizes_add_up(odd):
    # (3, 2) has as many values as (2, 3); a concatenation alone would not notice
    arrays = [np.zeros((2, 3), np.float32), np.ones(odd, np.float32)]
    flat = np.empty(12 + 6, dtype=np.float32)
    with pytest.raises(ValueError, match="an item of shape"):
        _stack_into(flat[: 6 + int(np.prod(odd))], arrays, (2, 3))
