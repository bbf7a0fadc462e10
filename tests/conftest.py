import numpy as np
import pytest
import trioserve
from hypothesis import settings
from runtime_helpers import Gate, ManualWatchdog

# Property tests check results, not speed: hypothesis's per-example deadline (200 ms)
# fails them when a shared machine stalls for a moment (seen: one example at 346 ms,
# 0.33 ms when rerun). Speed is measured by the benchmarks.
settings.register_profile("trioserve", deadline=None)
settings.load_profile("trioserve")


@pytest.fixture
def lose_devices(monkeypatch) -> set[str]:
    """The devices a model left unusable, as ``trioserve.device_lost`` reports them to
    the batchers (the tests' stand-in for a CUDA device after a device-side assert)."""
    import trioserve.actors._batcher as batcher_module

    lost: set[str] = set()
    monkeypatch.setattr(batcher_module, "device_lost", lambda device: device in lost)
    return lost


@pytest.fixture
def mlp_input():
    return np.random.default_rng(1).standard_normal(256).astype(np.float32)


def small_config(*models, **runtime):
    """A config with the given ModelConfigs and one open default tenant."""
    return trioserve.Config(
        models=tuple(models),
        tenants=(trioserve.TenantConfig(name="t", default=True),),
        runtime=trioserve.RuntimeLimits(**runtime),
    )


@pytest.fixture
def gates():
    """Make Gates; every one is released at teardown so no worker thread outlives the
    test by more than its batch."""
    made: list[Gate] = []

    def make(**kw) -> Gate:
        g = Gate(**kw)
        made.append(g)
        return g

    yield make
    for g in made:
        g.release()


@pytest.fixture
def manual_watchdog(monkeypatch):
    """The runtime's replicas keep their running deadlines on a :class:`ManualWatchdog`,
    whose wall clock the test moves; the class, whose ``made`` lists those made."""
    ManualWatchdog.made = []
    monkeypatch.setattr(trioserve.actors, "Watchdog", ManualWatchdog)
    return ManualWatchdog
