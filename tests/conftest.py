import numpy as np
import pytest
import trioserve


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
