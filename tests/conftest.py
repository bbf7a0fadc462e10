import numpy as np
import pytest
import trioserve
from hypothesis import settings

# Property tests check results, not speed: hypothesis's per-example deadline (200 ms)
# fails them when a shared machine stalls for a moment (seen: one example at 346 ms,
# 0.33 ms when rerun). Speed is measured by the benchmarks.
settings.register_profile("trioserve", deadline=None)
settings.load_profile("trioserve")


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
