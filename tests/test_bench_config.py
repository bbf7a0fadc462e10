"""``trioserve bench --config FILE`` (in process) runs the file's configuration: the
chosen model with the bench's overrides on top, and the file's tenants, classes,
runtime limits and cache."""

from __future__ import annotations

import json
from pathlib import Path

from trioserve import load_config
from trioserve._bench import BenchSpec, _bench_config
from trioserve.cli import main

FILE = """
[models.echo]
backend = "echo"
max_batch_size = 8
max_wait_ms = 3.0
execution = "inline"

[models.other]
backend = "echo"

[runtime]
queue_bound = 100
graceful_timeout_s = 1.5
restart_intensity = 2

[cache]
capacity_bytes = 1000000
policy = "lru"

[tenants.open]
default = true
weight = 3.0
credit_rate = 100000

[tenants.keyed]
api_keys = ["k1"]

[classes.fast]
max_queue_wait_ms = 0

[classes.slow]
max_queue_wait_ms = 50
over_quota = "wait"
"""


def test_the_bench_runs_the_files_tenants_classes_limits_and_cache(tmp_path: Path):
    path = tmp_path / "bench.toml"
    path.write_text(FILE)
    base = load_config(path)
    spec = BenchSpec(model="echo", concurrency=256, replicas=2, max_batch_size=16,
                     max_wait_ms=0.5, config=str(path))
    config = _bench_config(base, spec)
    assert config.tenants == base.tenants
    assert config.classes == base.classes
    assert config.runtime == base.runtime  # the file's queue bound stands
    assert config.cache == base.cache
    [model] = config.models
    assert model.name == "echo"
    assert model.execution == "inline"  # the file's, not overridden
    assert (model.replicas, model.max_batch_size, model.max_wait_ms) == (2, 16, 0.5)


def test_a_file_with_no_open_tenant_is_a_usage_error_naming_what_is_needed(
    tmp_path: Path, capsys
):
    path = tmp_path / "keyed.toml"
    path.write_text(FILE.replace("default = true\n", ""))
    code = main(["bench", "--config", str(path), "--model", "echo", "-d", "0.1",
                 "--warmup", "0", "--no-offline", "--json", str(tmp_path / "o.json")])
    assert code == 2
    err = capsys.readouterr().err
    assert str(path) in err
    assert "default = true" in err
    assert "open, keyed" in err
    assert not (tmp_path / "o.json").exists()


def test_a_model_the_file_does_not_serve_is_a_usage_error_naming_those_it_does(
    tmp_path: Path, capsys
):
    path = tmp_path / "bench.toml"
    path.write_text(FILE)
    code = main(["bench", "--config", str(path), "--model", "nosuch", "-d", "0.1",
                 "--warmup", "0", "--no-offline", "--json", str(tmp_path / "o.json")])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"trioserve: cannot bench model 'nosuch': --config {path} does not serve it "
        "(serving: echo, other), and it is not a built-in backend (mlp, echo, sleep, "
        "minilm) or an import string 'module:attr'"
    ]
    assert not (tmp_path / "o.json").exists()


def test_the_report_names_the_config_file_it_ran(tmp_path: Path, capsys):
    path = tmp_path / "bench.toml"
    path.write_text(FILE)
    out = tmp_path / "o.json"
    code = main(["bench", "--config", str(path), "--model", "echo", "-c", "2", "-d", "0.2",
                 "--warmup", "0", "--no-offline", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    res = json.loads(out.read_text())
    assert res["config"] == str(path)
    lines = capsys.readouterr().out.splitlines()
    assert ["config", str(path)] in [line.split() for line in lines]


def test_the_report_says_so_when_the_configuration_is_the_built_in_one(
    tmp_path: Path, capsys
):
    out = tmp_path / "o.json"
    code = main(["bench", "--model", "echo", "-c", "2", "-d", "0.2", "--warmup", "0",
                 "--no-offline", "--execution", "inline", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["config"] is None
    lines = capsys.readouterr().out.splitlines()
    assert ["config", "(built-in)"] in [line.split() for line in lines]


def test_the_built_in_benchs_queue_bound_makes_room_for_its_callers_within_its_cap():
    from trioserve._config import MAX_QUEUE_BOUND

    base = load_config(None)
    roomy = _bench_config(base, BenchSpec(model="echo", concurrency=5000))
    crowded = _bench_config(base, BenchSpec(model="echo", concurrency=MAX_QUEUE_BOUND))
    assert roomy.runtime.queue_bound == 10_000  # two requests a caller
    assert crowded.runtime.queue_bound == MAX_QUEUE_BOUND  # not a ConfigError


def test_an_in_process_bench_of_echo_has_no_offline_figure_and_says_why(
    tmp_path: Path, capsys
):
    """A bare loop over ``echo`` measures only the loop: no figure, and the reason."""
    path = tmp_path / "bench.toml"
    path.write_text(FILE)
    out = tmp_path / "o.json"
    code = main(["bench", "--config", str(path), "--model", "echo", "-c", "2", "-d", "0.2",
                 "--warmup", "0", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    assert "served/offline" not in text
    assert "  offline        none: model 'echo' does no work to compare with" in text
    assert "  cpu            event loop" in text
    res = json.loads(out.read_text())
    assert res["offline"] is None
    assert "served_over_offline" not in res
