"""Config values that are valid alone but not together, or whole tables and files
that hold no usable configuration: each refused at start, naming the key."""

from __future__ import annotations

import pytest
import trioserve
from trioserve import ConfigError, ModelConfig


# Regression: hedge_after_ms with hedge left false was accepted and did nothing.
def test_hedge_after_ms_needs_hedge():
    with pytest.raises(ConfigError) as caught:
        ModelConfig(name="m", backend="echo", hedge_after_ms=50)
    assert str(caught.value) == (
        "models.m.hedge_after_ms: hedged requests are off (hedge = false); set hedge = "
        "true too, or leave hedge_after_ms out"
    )
    assert ModelConfig(name="m", backend="echo", hedge=True, hedge_after_ms=50).hedge_after_ms == 50


def test_hedge_after_ms_needs_hedge_in_toml_too(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[models.m]\nbackend = "echo"\nhedge_after_ms = 20\n')
    with pytest.raises(ConfigError, match=r"^models\.m\.hedge_after_ms: hedged requests are off"):
        trioserve.load_config(path)
