"""Running the suites: hypothesis settings profiles, seeded chunks of examples, and a
failure turned into a pytest test a contributor can paste into tests/.

A run is a loop of *chunks*: one hypothesis run of one suite with ``max_examples``
examples and its own seed, derived from the run's seed, the suite and the chunk's
number, so ``--seed S`` replays the same search. Between chunks the time budget and
the progress line are checked. Found failures go to hypothesis's example database
(``.hypothesis/examples`` at the repository root), which the next run replays first.
A chunk draws the same examples whatever ran before it in the process
(:func:`fixed_constants`).
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase
from hypothesis.internal.conjecture import providers as _providers
from hypothesis.stateful import get_state_machine_test
from hypothesis.vendor.pretty import pretty

from . import _admission, _autoscale, _cache, _control, _queue, _rollout, _runtime
from ._product import PRODUCT, Product
from ._stats import EXAMPLES

ROOT = Path(__file__).resolve().parent.parent
DATABASE_DIR = ROOT / ".hypothesis" / "examples"


class Profile(enum.Enum):
    """``ci``: a fixed budget of examples per suite, seed 0, no database: the same
    examples on every run, well under a minute. ``long``: chunks until the time
    budget runs out, a random (printed) or given seed, the example database."""

    CI = "ci"
    LONG = "long"


@attrs.frozen(kw_only=True)
class Suite:
    """One suite: how to build its hypothesis test for a product, its example budgets,
    and the imports a pasted reproduction needs."""

    name: str
    summary: str
    build: Callable[[Product, settings, dict[str, Any]], Callable[[], None]]
    ci_examples: int
    chunk_examples: int
    repro_imports: str
    stateful: bool = True
    step_count: int = 50
    #: a scenario suite's function that a reproduction calls with the shrunk scenario
    repro_call: str = "run_scenario"


def _stateful(machine: type) -> Callable[[Product, settings, dict[str, Any]], Callable[[], None]]:
    def build(product: Product, s: settings, box: dict[str, Any]) -> Callable[[], None]:
        factory = machine
        if product is not PRODUCT:
            factory = type(machine.__name__, (machine,), {"product": product})
        return get_state_machine_test(factory, settings=s)

    return build


def _build_runtime(product: Product, s: settings, box: dict[str, Any]) -> Callable[[], None]:
    @s
    @given(scenario=_runtime.scenarios())
    def test_runtime(scenario: _runtime.Scenario) -> None:
        try:
            _runtime.run_scenario(scenario, product)
        except BaseException:
            box["example"] = scenario  # the last failing one is the shrunk one
            raise

    return test_runtime


def _build_cache(product: Product, s: settings, box: dict[str, Any]) -> Callable[[], None]:
    @s
    @given(scenario=_cache.cache_scenarios())
    def test_cache(scenario: _cache.CacheScenario) -> None:
        try:
            _cache.run_cache_scenario(scenario, product)
        except BaseException:
            box["example"] = scenario  # the last failing one is the shrunk one
            raise

    return test_cache


def _build_rollout(product: Product, s: settings, box: dict[str, Any]) -> Callable[[], None]:
    @s
    @given(scenario=_rollout.rollout_scenarios())
    def test_rollout(scenario: _rollout.RolloutScenario) -> None:
        try:
            _rollout.run_rollout_scenario(scenario, product)
        except BaseException:
            box["example"] = scenario  # the last failing one is the shrunk one
            raise

    return test_rollout


def _build_control(product: Product, s: settings, box: dict[str, Any]) -> Callable[[], None]:
    @s
    @given(scenario=_control.control_scenarios())
    def test_control(scenario: _control.ControlScenario) -> None:
        try:
            _control.run_control_scenario(scenario, product)
        except BaseException:
            box["example"] = scenario  # the last failing one is the shrunk one
            raise

    return test_control


def _build_autoscale(product: Product, s: settings, box: dict[str, Any]) -> Callable[[], None]:
    @s
    @given(scenario=_autoscale.autoscale_scenarios())
    def test_autoscale(scenario: _autoscale.AutoscaleScenario) -> None:
        try:
            _autoscale.run_autoscale_scenario(scenario, product)
        except BaseException:
            box["example"] = scenario  # the last failing one is the shrunk one
            raise

    return test_autoscale


SUITES: dict[str, Suite] = {
    s.name: s
    for s in (
        Suite(
            name="queue",
            summary="FairQueue sans-IO: arrivals, cancels, time, pulls, completions, expiry",
            build=_stateful(_queue.QueueMachine),
            ci_examples=150,
            chunk_examples=100,
            repro_imports="from fuzz import Arrival, QueueMachine, QueueSetup",
            step_count=60,
        ),
        Suite(
            name="runtime",
            summary="open_runtime under MockClock: callers, cancels, stragglers, faults, "
            "crashes, shutdown",
            build=_build_runtime,
            ci_examples=120,
            chunk_examples=60,
            repro_imports=(
                "from fuzz import Broken, Call, ClassSetup, Item, Scenario, TenantSetup, "
                "run_scenario"
            ),
            stateful=False,
        ),
        Suite(
            name="admission",
            summary="TokenBucket credits against an exact reference model",
            build=_stateful(_admission.BucketMachine),
            ci_examples=100,
            chunk_examples=100,
            repro_imports="from fuzz import BucketMachine, BucketSetup",
        ),
        Suite(
            name="cache",
            summary="the result cache and coalescing through open_runtime: hits, flights, "
            "TTLs, invalidations, errors, cancels, tenants",
            build=_build_cache,
            ci_examples=100,
            chunk_examples=60,
            repro_imports=(
                "from fuzz import Ask, CacheScenario, Invalidate, ModelRule, run_cache_scenario"
            ),
            stateful=False,
            repro_call="run_cache_scenario",
        ),
        Suite(
            name="rollout",
            summary="versions and their rollout through open_runtime: the canary's split, "
            "steps, promotion, rollback, the shadow, the operator's actions",
            build=_build_rollout,
            ci_examples=60,
            chunk_examples=40,
            repro_imports="from fuzz import RCall, ROp, RolloutScenario, run_rollout_scenario",
            stateful=False,
            repro_call="run_rollout_scenario",
        ),
        Suite(
            name="control",
            summary="explicit model control through open_runtime: load, unload and "
            "reload storms with traffic",
            build=_build_control,
            ci_examples=60,
            chunk_examples=40,
            repro_imports="from fuzz import CCall, ControlScenario, Op, run_control_scenario",
            stateful=False,
            repro_call="run_control_scenario",
        ),
        Suite(
            name="autoscale",
            summary="an autoscaled model through open_runtime: bursts, steps and idle "
            "spells, slow and failing replica starts, shutdown mid-start",
            build=_build_autoscale,
            ci_examples=40,
            chunk_examples=40,
            repro_imports=(
                "from fuzz import ACall, AutoscaleScenario, Start, run_autoscale_scenario"
            ),
            stateful=False,
            repro_call="run_autoscale_scenario",
        ),
    )
}


@attrs.define(eq=False)
class Failure:
    """A failure a suite found: what broke, and how to replay it."""

    suite: str
    seed: int
    run_seed: int | None
    error: BaseException
    example: Any = None  # a scenario suite's shrunk scenario
    elapsed: float = 0.0
    examples: int = 0

    @property
    def message(self) -> str:
        return f"{type(self.error).__name__}: {self.error}"

    def steps(self) -> list[str]:
        """A state machine's printed steps (``state = ...`` up to ``state.teardown()``)."""
        notes = [str(n) for n in getattr(self.error, "__notes__", [])]
        out: list[str] = []
        on = False
        for n in notes:
            if n.startswith("state = "):
                on = True
            if on:
                out.append(n)
                if n.startswith("state.teardown()"):
                    break
        return out

    def blob(self) -> str | None:
        for n in getattr(self.error, "__notes__", []):
            if "@reproduce_failure(" in str(n):
                start = str(n).index("@reproduce_failure(")
                return str(n)[start:].split(" as a decorator")[0]
        return None

    def as_pytest(self) -> str:
        """The failure as a test to paste into tests/ (it fails until the bug is fixed)."""
        suite = SUITES[self.suite]
        how = f"python -m fuzz --suite {self.suite}"
        if self.run_seed is not None:
            how += f" --seed {self.run_seed}"
        first_line = str(self.error).splitlines()[0] if str(self.error) else ""
        header = [
            f"# Found by `{how}` (hypothesis seed {self.seed}).",
            f"# {type(self.error).__name__}: {first_line}"[:200],
        ]
        name = f"test_fuzz_{self.suite}_seed_{self.seed}"
        if suite.stateful:
            steps = self.steps()
            if not steps:
                body = ["    pass  # hypothesis printed no steps; see the traceback above"]
            else:
                body = [textwrap.indent(s, "    ") for s in steps]
        else:
            body = [
                f"    {suite.repro_call}(",
                textwrap.indent(pretty(self.example), "        ") + ")",
            ]
        return "\n".join([*header, suite.repro_imports, "", "", f"def {name}():", *body]) + "\n"


def suite_settings(
    suite: Suite,
    *,
    max_examples: int,
    database: ExampleDatabase | None,
    shrink: bool = True,
) -> settings:
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
    if shrink:
        phases.append(Phase.shrink)
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=database,
        phases=phases,
        print_blob=True,
        report_multiple_bugs=False,
        stateful_step_count=suite.step_count,
        suppress_health_check=list(HealthCheck),
    )


def chunk_seed(run_seed: int, suite: str, chunk: int) -> int:
    """The hypothesis seed of one chunk, stable across runs and Python versions."""
    digest = hashlib.sha256(f"{run_seed}:{suite}:{chunk}".encode()).digest()
    return int.from_bytes(digest[:6], "big")


@contextlib.contextmanager
def fixed_constants() -> Iterator[None]:
    """Hypothesis's draws without the constants of the local modules loaded.

    Now and then (one draw in 20) hypothesis draws a constant found in the source of
    the project's modules loaded in the process (``_get_local_constants`` in its
    ``providers``), and which are loaded depends on what ran before: a suite imports
    parts of trioserve the first time it plays, pytest's other tests import more. So
    a seed's examples depended on what ran before it (the queue suite's chunk 0 of
    seed 3401, 40 examples, drew other examples after a module of constants was
    imported). Within this the pool of local constants is empty, and hypothesis's
    own constants (powers of two, the edges of the floats, ...) are drawn as before.
    Hypothesis keeps no public switch for it: with a hypothesis that no longer has
    these names, nothing is changed (``tests/test_fuzz_replay.py`` would say if the
    examples then depend on what ran before again)."""
    get = getattr(_providers, "_get_local_constants", None)
    cache = getattr(getattr(_providers, "CONSTANTS_CACHE", None), "cache", None)
    if get is None or cache is None:
        yield
        return
    none = type(_providers.GLOBAL_CONSTANTS)()
    _providers._get_local_constants = lambda: none
    cache.clear()  # the permitted constants computed from the pool before
    try:
        yield
    finally:
        _providers._get_local_constants = get
        cache.clear()


def run_chunk(
    suite: Suite,
    *,
    product: Product = PRODUCT,
    hypothesis_seed: int,
    max_examples: int,
    database: ExampleDatabase | None,
    shrink: bool = True,
    run_seed: int | None = None,
) -> Failure | None:
    """One hypothesis run of ``suite``; the failure it found (shrunk), or None."""
    box: dict[str, Any] = {}
    test = suite.build(
        product,
        suite_settings(suite, max_examples=max_examples, database=database, shrink=shrink),
        box,
    )
    seed(hypothesis_seed)(test)
    before = EXAMPLES[suite.name]
    t0 = time.monotonic()
    try:
        with fixed_constants():
            test()
    except Exception as exc:
        return Failure(
            suite=suite.name,
            seed=hypothesis_seed,
            run_seed=run_seed,
            error=exc,
            example=box.get("example"),
            elapsed=time.monotonic() - t0,
            examples=EXAMPLES[suite.name] - before,
        )
    return None


def default_database() -> ExampleDatabase:
    DATABASE_DIR.mkdir(parents=True, exist_ok=True)
    return DirectoryBasedExampleDatabase(str(DATABASE_DIR))
