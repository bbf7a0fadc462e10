"""Example counters and coverage notes, per suite, for the progress line and the
end-of-run summary."""

from __future__ import annotations

import collections

EXAMPLES: collections.Counter[str] = collections.Counter()
#: suite -> what its examples exercised (outcome kinds, checks that had work to do)
FEATURES: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)


def count_example(suite: str) -> None:
    """One more example (one state machine, or one scenario) of ``suite`` started."""
    EXAMPLES[suite] += 1


def note(suite: str, feature: str, n: int = 1) -> None:
    """Record that an example of ``suite`` exercised ``feature``."""
    if n:
        FEATURES[suite][feature] += n
