"""``python -m fuzz --self-test``: the harness has teeth.

Each planted bug (fuzz/_mutants.py) is fuzzed with the suites that can see it, one
after the other in the order ``MUTANTS`` lists them (the one that catches it soonest
first), in short chunks with fixed seeds, no example database and no shrinking, each
until it fails or the per-bug budget runs out; the first suite that catches the bug
ends its test (:func:`catch_bug`). A bug no suite catches is a hole in the harness.

The budget is in seconds for a person at the command line (``--self-test``), and in
examples for the tests (``tests/test_fuzz.py``): the chunks' seeds are fixed and the
suites replay exactly (trio on a MockClock, its scheduler seeded as hypothesis seeds
it), so a bug caught within n examples is caught within n examples on any machine,
however loaded, where a time budget let a slow machine miss it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import attrs

from ._harness import SUITES, chunk_seed, run_chunk
from ._mutants import MUTANTS

#: examples per chunk in the self-test: small, so the suites take turns quickly
CHUNK = 25
#: the examples budget per bug and suite of tests/test_fuzz.py (docs/fuzzing.md)
EXAMPLES = 1000
#: The seed tests/test_fuzz.py fuzzes a bug with where seed 0 takes a hundred
#: examples or more to catch it: the first of 1-15 whose chunks catch it within 100
#: (on the strategies of the time). It saves time only: the examples of a seed are
#: the same on every machine. The command line's self-test uses ``--seed`` (0) for
#: every bug. Should a change of a suite's strategies make one slow again, pick
#: again: the test still passes while the bug is caught within EXAMPLES.
TEST_SEEDS = {
    "ignore-weights": 6,
    "copy-dropped-while-running": 4,
    "apart-same-replica": 5,
    "late-answer-unguarded": 2,
    "pause-holds-checks": 1,
    "split-call-item-by-item": 2,
    "unload-before-drained": 1,
    "start-keeps-old-stable": 2,
    "unread-results-run-again": 2,
}


@attrs.frozen(kw_only=True)
class Caught:
    bug: str
    description: str
    caught: bool
    seconds: float
    suite: str | None = None
    examples: int = 0
    message: str = ""


def check_bug(
    name: str, suite_name: str, *, budget: float = 60.0, seed: int = 0,
    examples_budget: int | None = None,
) -> Caught:
    """Fuzz the planted bug ``name`` with one suite until it fails, ``budget`` s
    pass, or (when given) ``examples_budget`` examples ran: chunk after chunk, each of
    ``CHUNK`` examples, the last one cut to what the budget leaves."""
    description, product, _ = MUTANTS[name]
    suite = SUITES[suite_name]
    t0 = time.monotonic()
    examples = 0
    chunk = 0
    limit = math.inf if examples_budget is None else examples_budget
    while examples < limit and time.monotonic() - t0 < budget:
        size = int(min(CHUNK, limit - examples))
        failure = run_chunk(
            suite,
            product=product,
            hypothesis_seed=chunk_seed(seed, f"self-test:{name}:{suite_name}", chunk),
            max_examples=size,
            database=None,
            shrink=False,
        )
        if failure is not None:
            return Caught(
                bug=name,
                description=description,
                caught=True,
                seconds=time.monotonic() - t0,
                suite=suite_name,
                examples=examples + failure.examples,
                message=str(failure.error).splitlines()[0],
            )
        examples += size
        chunk += 1
    return Caught(
        bug=name,
        description=description,
        caught=False,
        seconds=time.monotonic() - t0,
        suite=suite_name,
        examples=examples,
    )


def catch_bug(
    name: str, suites: Sequence[str], *, budget: float = 60.0, seed: int = 0,
    examples_budget: int | None = None,
) -> list[Caught]:
    """Fuzz the planted bug ``name`` with ``suites`` in turn (``MUTANTS`` lists each
    bug's suites in the order that catches it soonest), each within the budget,
    until one catches it: what each suite tried, the last the one that caught it
    unless none did. The suites after it are not run: one catch is the proof."""
    results = []
    for suite in suites:
        r = check_bug(name, suite, budget=budget, seed=seed, examples_budget=examples_budget)
        results.append(r)
        if r.caught:
            break
    return results


def self_test(*, budget: float = 60.0, seed: int = 0) -> list[list[Caught]]:
    """Every planted bug against the suites that can see it, until one catches it:
    per bug, per suite tried."""
    return [
        catch_bug(name, suites, budget=budget, seed=seed)
        for name, (_, _, suites) in MUTANTS.items()
    ]
