"""Example counters and coverage notes, per suite, for the progress line and the
end-of-run summary."""

from __future__ import annotations

import collections

EXAMPLES: collections.Counter[str] = collections.Counter()
#: suite -> what its examples exercised (outcome kinds, checks that had work to do)
FEATURES: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
#: suite -> features the summary shows even when no example exercised them (a path
#: the runs never reach shows as 0, rather than missing)
EXPECTED: dict[str, list[str]] = collections.defaultdict(list)


def count_example(suite: str) -> None:
    """One more example (one state machine, or one scenario) of ``suite`` started."""
    EXAMPLES[suite] += 1


def note(suite: str, feature: str, n: int = 1) -> None:
    """Record that an example of ``suite`` exercised ``feature``."""
    if n:
        FEATURES[suite][feature] += n


def expect(suite: str, *features: str) -> None:
    """Show ``features`` of ``suite`` in the summary, 0 when never exercised."""
    EXPECTED[suite].extend(f for f in features if f not in EXPECTED[suite])
