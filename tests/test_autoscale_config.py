"""``[models.NAME.autoscaling]`` (``AutoscalingConfig``): its defaults, and each bad
value refused at start naming its key."""

from __future__ import annotations

import pytest
import trioserve
from trioserve import AutoscalingConfig, ConfigError, ModelConfig


def test_autoscaling_is_off_unless_configured():
    assert ModelConfig(name="m", backend="echo").autoscaling is None


def test_the_defaults():
    cfg = AutoscalingConfig(max_replicas=4)
    assert (
        cfg.min_replicas, cfg.max_replicas, cfg.target_queued_per_replica,
        cfg.upscale_delay_s, cfg.downscale_delay_s, cfg.interval_s, cfg.look_back_s,
    ) == (None, 4, None, 5.0, 60.0, 1.0, None)


def test_a_mapping_from_python_is_a_table():
    m = ModelConfig(name="m", backend="echo", replicas=2, autoscaling={"max_replicas": 3})
    assert m.autoscaling == AutoscalingConfig(max_replicas=3)
    given = AutoscalingConfig(max_replicas=5, min_replicas=1, interval_s=0.5)
    assert ModelConfig(name="m", backend="echo", autoscaling=given).autoscaling is given


def test_the_toml_table(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[models.m]\nbackend = "echo"\nreplicas = 2\n'
        "[models.m.autoscaling]\nmax_replicas = 6\nmin_replicas = 1\n"
        "target_queued_per_replica = 32\nupscale_delay_s = 2\ndownscale_delay_s = 30\n"
        "interval_s = 0.5\nlook_back_s = 3\n"
    )
    assert trioserve.load_config(path).model("m").autoscaling == AutoscalingConfig(
        max_replicas=6, min_replicas=1, target_queued_per_replica=32,
        upscale_delay_s=2, downscale_delay_s=30, interval_s=0.5, look_back_s=3,
    )


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({}, "models.m.autoscaling.max_replicas: is required"),
        ({"max_replicas": 1}, (
            "models.m.autoscaling.max_replicas: must be >= the replicas the model starts "
            "with (2: replicas, or one per device), got 1"
        )),
        ({"max_replicas": 4, "min_replicas": 3}, (
            "models.m.autoscaling.min_replicas: must be <= the replicas the model starts "
            "with (2), got 3"
        )),
        ({"max_replicas": 257}, (
            "models.m.autoscaling.max_replicas: must be an integer <= 256, got 257"
        )),
        ({"max_replicas": 4, "min_replicas": 0}, (
            "models.m.autoscaling.min_replicas: must be an integer >= 1, got 0"
        )),
        ({"max_replicas": 4, "target_queued_per_replica": 0}, (
            "models.m.autoscaling.target_queued_per_replica: must be a finite number > 0.0, got 0"
        )),
        ({"max_replicas": 4, "upscale_delay_s": -1}, (
            "models.m.autoscaling.upscale_delay_s: must be a finite number >= 0.0, got -1"
        )),
        ({"max_replicas": 4, "downscale_delay_s": float("inf")}, (
            "models.m.autoscaling.downscale_delay_s: must be a finite number >= 0.0, got inf"
        )),
        ({"max_replicas": 4, "interval_s": 0}, (
            "models.m.autoscaling.interval_s: must be a finite number > 0.0, got 0"
        )),
        ({"max_replicas": 4, "look_back_s": -0.5}, (
            "models.m.autoscaling.look_back_s: must be a finite number >= 0.0, got -0.5"
        )),
        ({"max_replicas": 4, "look_back_s": "5"}, (
            "models.m.autoscaling.look_back_s: must be a finite number >= 0.0, got '5'"
        )),
        ({"max_replicas": 4, "interval": 1}, (
            "models.m.autoscaling.interval: unknown key; did you mean 'interval_s'? expected "
            "one of min_replicas, max_replicas, target_queued_per_replica, upscale_delay_s, "
            "downscale_delay_s, interval_s, look_back_s"
        )),
        (3, "models.m.autoscaling: must be a table (an AutoscalingConfig), got 3"),
    ],
)
def test_a_bad_value_is_refused_naming_its_key(table, message):
    with pytest.raises(ConfigError) as caught:
        trioserve.config_from_mapping(
            {"models": {"m": {"backend": "echo", "replicas": 2, "autoscaling": table}}}
        )
    assert str(caught.value) == message


def test_a_bad_value_from_python_names_the_key():
    with pytest.raises(ConfigError, match=r"^autoscaling\.max_replicas: must be an integer >= 1"):
        AutoscalingConfig(max_replicas=0)
    with pytest.raises(ConfigError, match=r"^autoscaling\.max_replicas: is required$"):
        AutoscalingConfig()


def test_the_start_count_defaults_to_one_per_device():
    ModelConfig(name="m", backend="echo", devices=["cpu", "cpu"], autoscaling={"max_replicas": 2})
    with pytest.raises(ConfigError, match=r"starts with \(2: replicas, or one per device\), got 1"):
        ModelConfig(
            name="m", backend="echo", devices=["cpu", "cpu"], autoscaling={"max_replicas": 1}
        )


def test_autoscaling_with_a_slow_lane_is_not_supported_yet():
    with pytest.raises(ConfigError) as caught:
        ModelConfig(
            name="m", backend="echo", replicas=2, slow_lane_cost=8,
            autoscaling=AutoscalingConfig(max_replicas=4),
        )
    assert str(caught.value) == (
        "models.m.autoscaling: not supported yet with slow_lane_cost (a slow lane's "
        "replicas are fixed); leave one of them out"
    )
