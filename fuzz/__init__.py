"""trioserve's property-based fuzz harness: hypothesis suites that drive the real
queue, batchers and supervisor under ``trio.testing.MockClock`` and check the
invariants of DESIGN.md. Run it with ``python -m fuzz`` (docs/fuzzing.md).

The names below are what a pasted reproduction imports.
"""

try:
    import trioserve as _trioserve  # noqa: F401  (the product under test)
except ModuleNotFoundError as _missing:
    if _missing.name != "trioserve":
        raise
    # A system ``python -m fuzz`` on a fresh checkout: say which interpreter to use,
    # not only "No module named 'trioserve'" from deep inside a suite's import.
    raise ModuleNotFoundError(
        "the fuzz harness drives the trioserve package, which this Python does not "
        "have installed: run it with the project's interpreter, `.venv/bin/python -m "
        "fuzz` from the repository root (`make setup` creates .venv)",
        name="trioserve",
    ) from None

from ._admission import BucketMachine as BucketMachine
from ._admission import BucketSetup as BucketSetup
from ._autoscale import ACall as ACall
from ._autoscale import AutoscaleScenario as AutoscaleScenario
from ._autoscale import Start as Start
from ._autoscale import run_autoscale_scenario as run_autoscale_scenario
from ._cache import run_cache_scenario as run_cache_scenario
from ._cache_scenario import Ask as Ask
from ._cache_scenario import CacheScenario as CacheScenario
from ._cache_scenario import Invalidate as Invalidate
from ._cache_scenario import ModelRule as ModelRule
from ._checker import INVARIANTS as INVARIANTS
from ._checker import InvariantViolation as InvariantViolation
from ._checker import QueueObserver as QueueObserver
from ._control import CCall as CCall
from ._control import ControlScenario as ControlScenario
from ._control import Op as Op
from ._control import run_control_scenario as run_control_scenario
from ._harness import SUITES as SUITES
from ._harness import Profile as Profile
from ._harness import run_chunk as run_chunk
from ._mutants import MUTANTS as MUTANTS
from ._product import PRODUCT as PRODUCT
from ._product import Product as Product
from ._queue import Arrival as Arrival
from ._queue import QueueMachine as QueueMachine
from ._queue import QueueSetup as QueueSetup
from ._rollout import run_rollout_scenario as run_rollout_scenario
from ._rollout_scenario import RCall as RCall
from ._rollout_scenario import RolloutScenario as RolloutScenario
from ._rollout_scenario import ROp as ROp
from ._runtime import run_scenario as run_scenario
from ._scenario import Broken as Broken
from ._scenario import Call as Call
from ._scenario import ClassSetup as ClassSetup
from ._scenario import Item as Item
from ._scenario import Scenario as Scenario
from ._scenario import TenantSetup as TenantSetup
