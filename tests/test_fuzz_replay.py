"""A seed replays exactly (docs/fuzzing.md, "Profiles"): a chunk of a suite, given
its hypothesis seed and its budget of examples, draws the same examples and the
product does the same with them, whatever ran before it in the process, and in a
fresh interpreter (another ``PYTHONHASHSEED``) alike, hypothesis's pool of the
constants of the modules loaded included (``fuzz._harness.fixed_constants``). What a
time budget changes is only how many chunks run."""

from __future__ import annotations

import collections
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fuzz import _runtime
from fuzz._harness import SUITES, chunk_seed, run_chunk
from fuzz._stats import EXAMPLES, FEATURES

ROOT = Path(__file__).resolve().parent.parent
#: (suite, examples): a stateful suite and a scenario suite
REPLAYED = (("queue", 40), ("runtime", 30))


def fingerprint(suite: str, examples: int, seed: int) -> dict[str, Any]:
    """What chunk 0 of ``suite`` on run seed ``seed`` did with a budget of
    ``examples``: the examples run, the runtime suite's scenarios (their reprs
    replay), what the examples exercised (outcome kinds, batches, retries: the
    product's behaviour), and whether it found a failure."""
    scenarios: list[str] = []
    play = _runtime.run_scenario

    def recorded(scenario: Any, *args: Any) -> None:
        scenarios.append(repr(scenario))
        play(scenario, *args)

    before_n = EXAMPLES[suite]
    before = collections.Counter(FEATURES[suite])
    _runtime.run_scenario = recorded
    try:
        failure = run_chunk(
            SUITES[suite],
            hypothesis_seed=chunk_seed(seed, suite, 0),
            max_examples=examples,
            database=None,
        )
    finally:
        _runtime.run_scenario = play
    exercised = collections.Counter(FEATURES[suite])
    exercised.subtract(before)
    return {
        "examples": EXAMPLES[suite] - before_n,
        "scenarios": scenarios,
        "exercised": sorted((k, v) for k, v in exercised.items() if v),
        "failure": None if failure is None else failure.message,
    }


def _fresh(seed: int) -> list[dict[str, Any]]:
    """The fingerprints of ``REPLAYED`` in a fresh interpreter, nothing before them."""
    code = (
        "import json\n"
        "from test_fuzz_replay import REPLAYED, fingerprint\n"
        f"print(json.dumps([fingerprint(s, n, {seed}) for s, n in REPLAYED]))\n"
    )
    path = f"{ROOT / 'tests'}{os.pathsep}{ROOT}"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": path}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("seed", [3401])
def test_a_seed_replays_the_same_examples_alone_and_after_other_suites(
    seed, tmp_path, monkeypatch
):
    alone = _fresh(seed)
    # Other suites first, in this process: their examples, runtimes and caches.
    run_chunk(SUITES["cache"], hypothesis_seed=chunk_seed(seed, "cache", 0),
              max_examples=20, database=None)
    run_chunk(SUITES["admission"], hypothesis_seed=chunk_seed(seed, "admission", 0),
              max_examples=20, database=None)
    # And one more module of the project's loaded, with a few constants: hypothesis
    # draws now and then from those of the modules loaded, and with these the queue
    # suite drew other examples (42, not 44) before fuzz._harness.fixed_constants.
    (tmp_path / "constants_pool.py").write_text(
        'SEEN = (3401, 40, 30, "queue", "runtime", "examples", "after", "tests")\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "constants_pool", raising=False)  # gone after
    importlib.import_module("constants_pool")
    after = [fingerprint(s, n, seed) for s, n in reversed(REPLAYED)][::-1]
    for (suite, n), a, b in zip(REPLAYED, alone, after, strict=True):
        assert a["examples"] >= n, suite
        assert a["exercised"], suite  # the product did something to compare
        assert a == json.loads(json.dumps(b)), suite
    assert len(alone[1]["scenarios"]) == alone[1]["examples"]
