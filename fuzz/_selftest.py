"""``python -m fuzz --self-test``: the harness has teeth.

Each planted bug (fuzz/_mutants.py) is fuzzed with each suite that can see it, in short
chunks with fixed seeds, no example database and no shrinking, until the suite fails or
the per-bug budget runs out. A bug is caught when a suite catches it; a bug no suite
catches is a hole in the harness.
"""

from __future__ import annotations

import time

import attrs

from ._harness import SUITES, chunk_seed, run_chunk
from ._mutants import MUTANTS

#: examples per chunk in the self-test: small, so the suites take turns quickly
CHUNK = 25


@attrs.frozen(kw_only=True)
class Caught:
    bug: str
    description: str
    caught: bool
    seconds: float
    suite: str | None = None
    examples: int = 0
    message: str = ""


def check_bug(name: str, suite_name: str, *, budget: float = 60.0, seed: int = 0) -> Caught:
    """Fuzz the planted bug ``name`` with one suite until it fails or ``budget`` s pass."""
    description, product, _ = MUTANTS[name]
    suite = SUITES[suite_name]
    t0 = time.monotonic()
    examples = 0
    chunk = 0
    while time.monotonic() - t0 < budget:
        failure = run_chunk(
            suite,
            product=product,
            hypothesis_seed=chunk_seed(seed, f"self-test:{name}:{suite_name}", chunk),
            max_examples=CHUNK,
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
        examples += CHUNK
        chunk += 1
    return Caught(
        bug=name,
        description=description,
        caught=False,
        seconds=time.monotonic() - t0,
        suite=suite_name,
        examples=examples,
    )


def self_test(*, budget: float = 60.0, seed: int = 0) -> list[list[Caught]]:
    """Every planted bug against every suite that can see it: per bug, per suite."""
    return [
        [check_bug(name, s, budget=budget, seed=seed) for s in suites]
        for name, (_, _, suites) in MUTANTS.items()
    ]
