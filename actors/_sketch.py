"""TinyLFU's frequency histogram: a count-min sketch of small counters that ages.

Sans-IO and allocation-free per access: one bytearray of counters, indexed by a few
mixes of the key's Python ``hash()``.
"""

from __future__ import annotations

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
_MIX = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, odd
_HALVE = bytes(i >> 1 for i in range(256))
_LOWBIT = bytes(i & 1 for i in range(256))
_MAX_COUNT = 15  # 4-bit counters, as in the paper and Caffeine


class CountMinSketch:
    """TinyLFU's frequency histogram: a count-min sketch of 4-bit counters with aging.

    Each key has ``depth`` = 4 counters in one table of ``width`` one-byte counters (a
    power of two, ``counters_per_entry`` × ``expected_entries`` rounded up; Caffeine uses
    16 per entry). Its estimate is the least of them, capped at 15. Every increment that
    raises the estimate counts toward ``sample_size`` (``sample_factor`` ×
    ``expected_entries``); when the count reaches it every counter is halved (the
    paper's *reset*) and the count too, so the sketch follows a shifting workload.

    Keys are given as their Python ``hash()`` (an int); the mixing is done here.
    """

    __slots__ = ("_mask", "_table", "additions", "expected_entries", "resets", "sample_size")

    def __init__(
        self,
        expected_entries: int,
        *,
        counters_per_entry: int = 16,
        sample_factor: int = 10,
    ) -> None:
        if expected_entries < 1 or counters_per_entry < 1 or sample_factor < 1:
            raise ValueError(
                "CountMinSketch: expected_entries, counters_per_entry and sample_factor "
                f"must be >= 1, got {expected_entries}, {counters_per_entry}, {sample_factor}"
            )
        width = 1 << max(6, (expected_entries * counters_per_entry - 1).bit_length())
        self.expected_entries = expected_entries
        self._table = bytearray(width)
        self._mask = width - 1
        self.sample_size = sample_factor * expected_entries
        self.additions = 0
        self.resets = 0

    @property
    def width(self) -> int:
        return len(self._table)

    def increment(self, h: int) -> None:
        """Count one access of the key whose ``hash()`` is ``h``.

        Conservative ("minimal increment", as in the TinyLFU paper): only the key's
        counters that hold its current estimate are raised, so a key sharing a counter
        with a hotter one does not inflate it further. Fewer overestimates matter most at
        the cache's boundary, where a candidate and its victim differ by one or two.
        """
        # A multiplicative mix, then its high half folded in, gives two 32-bit hashes;
        # the four counter indices are a + i·b (b odd, so they are distinct).
        h = (h * _MIX) & _M64
        h ^= h >> 29
        a = h & _M32
        b = (h >> 32) | 1
        m = self._mask
        t = self._table
        i0 = a & m
        i1 = (a + b) & m
        i2 = (a + 2 * b) & m
        i3 = (a + 3 * b) & m
        v = min(t[i0], t[i1], t[i2], t[i3])
        if v >= _MAX_COUNT:
            return
        w = v + 1
        if t[i0] == v:
            t[i0] = w
        if t[i1] == v:
            t[i1] = w
        if t[i2] == v:
            t[i2] = w
        if t[i3] == v:
            t[i3] = w
        self.additions += 1
        if self.additions >= self.sample_size:
            self.reset()

    def frequency(self, h: int) -> int:
        """The estimated count (0..15) of the key whose ``hash()`` is ``h``."""
        h = (h * _MIX) & _M64
        h ^= h >> 29
        a = h & _M32
        b = (h >> 32) | 1
        m = self._mask
        t = self._table
        return min(t[a & m], t[(a + b) & m], t[(a + 2 * b) & m], t[(a + 3 * b) & m])

    def clear(self) -> None:
        """Forget every count (a popularity shift: see ``WTinyLFU``)."""
        self._table = bytearray(len(self._table))
        self.additions = 0

    def reset(self) -> None:
        """Halve every counter (aging). The count of additions is halved too, less the
        truncation of odd counters, as the paper's reset does."""
        odd = self._table.translate(_LOWBIT).count(1)
        self._table = self._table.translate(_HALVE)  # a new bytearray
        self.additions = max(0, (self.additions - odd // 4) // 2)
        self.resets += 1
