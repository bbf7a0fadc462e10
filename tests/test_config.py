"""Configuration: TOML files and Python values; every bad value is a ConfigError
naming its key."""

from __future__ import annotations

import math
import re
import socket
import textwrap
from pathlib import Path

import attrs
import numpy as np
import pytest
import trioserve
from trioserve import (
    CacheConfig,
    Config,
    ConfigError,
    ModelConfig,
    RuntimeLimits,
    ServerConfig,
    TenantConfig,
)
from trioserve._config import MAX_BATCH_SIZE, default_classes, minilm_available
from trioserve.cli import main

#: An integer no float holds (a float key's value must be finite as a float).
HUGE = "9" * 400
HUGE_SHOWN = "9" * 40 + "... (400 digits)"


def write(tmp_path, text: str):
    path = tmp_path / "trioserve.toml"
    path.write_text(textwrap.dedent(text))
    return path


VALID = """
    [models.mlp]
    backend = "mlp"
    devices = ["cpu", "cuda:1"]
    replicas = 3
    max_batch_size = 32
    max_batch_tokens = 4096
    max_wait_ms = 2.5
    oversize = "alone"
    timeout_ms = 1500
    torch_threads = 2
    execution = "thread"
    options = { seed = 7 }

    [models.echo]
    backend = "echo"
    versions = ["1", "2"]

    [tenants.acme]
    api_keys = ["key-a1", "key-a2"]
    weight = 3.0

    [tenants.demo]
    default = true

    [runtime]
    queue_bound = 100
    inbox_bound = 10
    restart_intensity = 2
    restart_period_s = 5.0
    graceful_timeout_s = 0.5

    [server]
    host = "0.0.0.0"
    port = 9000
    control_port = 9001
    max_body_bytes = 1024
"""


def test_load_config_reads_every_table(tmp_path):
    cfg = trioserve.load_config(write(tmp_path, VALID))
    assert cfg == Config(
        models=(
            ModelConfig(
                name="mlp",
                backend="mlp",
                devices=("cpu", "cuda:1"),
                replicas=3,
                max_batch_size=32,
                max_batch_tokens=4096,
                max_wait_ms=2.5,
                oversize="alone",
                timeout_ms=1500,
                torch_threads=2,
                execution="thread",
                options={"seed": 7},
            ),
            ModelConfig(name="echo", backend="echo", versions=("1", "2")),
        ),
        tenants=(
            TenantConfig(name="acme", api_keys=("key-a1", "key-a2"), weight=3.0),
            TenantConfig(name="demo", default=True),
        ),
        runtime=RuntimeLimits(
            queue_bound=100,
            inbox_bound=10,
            restart_intensity=2,
            restart_period_s=5.0,
            graceful_timeout_s=0.5,
        ),
        server=ServerConfig(host="0.0.0.0", port=9000, control_port=9001, max_body_bytes=1024),
    )
    mlp = cfg.model("mlp")
    assert mlp.replica_devices == ("cpu", "cuda:1", "cpu")
    # Defaults fill what the file leaves out.
    echo = cfg.model("echo")
    assert (echo.max_batch_size, echo.max_wait_ms, echo.oversize) == (64, 2.0, "reject")
    assert cfg.server.stream_in_flight == ServerConfig().stream_in_flight
    assert cfg.server.max_connections == ServerConfig().max_connections == 4096
    assert cfg.server.stream_in_flight_bytes == ServerConfig().stream_in_flight_bytes == 16 << 20
    assert cfg.server.drain_delay_s == ServerConfig().drain_delay_s == 0.0
    assert cfg.server.idempotency_max_bytes == ServerConfig().idempotency_max_bytes == 64 << 20


def test_one_write_timeout_serves_http_and_the_stream_unless_the_stream_has_its_own(
    tmp_path,
):
    """``server.write_timeout_s`` bounds both; ``stream_write_timeout_s`` (the stream's
    own, older key) is still read, and set it wins for the stream."""
    assert (ServerConfig().write_timeout_s, ServerConfig().stream_write_timeout_s) == (30.0, None)
    head = '[models.e]\nbackend = "echo"\n[server]\n'
    cfg = trioserve.load_config(write(tmp_path, head + "stream_write_timeout_s = 5\n"))
    assert (cfg.server.write_timeout_s, cfg.server.stream_write_timeout_s) == (30.0, 5)


def test_the_queue_bounds_are_capped_and_the_cap_is_accepted():
    from trioserve._config import MAX_QUEUE_BOUND

    top = trioserve.RuntimeLimits(queue_bound=MAX_QUEUE_BOUND, inbox_bound=MAX_QUEUE_BOUND)
    assert (top.queue_bound, top.inbox_bound) == (1_048_576, 1_048_576)
    for key in ("queue_bound", "inbox_bound"):
        with pytest.raises(ConfigError) as exc:
            trioserve.RuntimeLimits(**{key: 10**12})
        assert str(exc.value) == (
            f"runtime.{key}: must be an integer <= 1048576, got 1000000000000")


def test_a_minimal_file_gets_the_default_tenant_runtime_and_server(tmp_path):
    cfg = trioserve.load_config(write(tmp_path, '[models.e]\nbackend = "echo"\n'))
    assert cfg.tenants == (TenantConfig(name="default", default=True),)
    assert cfg.runtime == RuntimeLimits()
    assert cfg.server == ServerConfig()


# ---------------------------------------------------------------- bad files
@pytest.mark.parametrize(
    ("table", "shown"),
    [('"a/b"', '"a/b"'), ('".."', '".."'), ('"."', '"."'), ('"a\\u0007b"', '"a\\x07b"')],
)
def test_a_model_name_that_cannot_be_a_url_segment_is_refused(tmp_path, table, shown):
    """/v2/models/NAME/...: a name with '/' (or '.', '..', a control character) was
    accepted, and then no request could reach it (such segments are 404)."""
    path = write(tmp_path, f'[models.{table}]\nbackend = "echo"\n')
    with pytest.raises(ConfigError) as excinfo:
        trioserve.load_config(path)
    assert str(excinfo.value).startswith(
        f"models.{shown}.name: must be usable as one segment of a URL path"
    )


def test_a_name_that_is_no_bare_toml_key_is_quoted_in_errors(tmp_path):
    path = write(
        tmp_path,
        '[models.m]\nbackend = "echo"\n[tenants."a.b"]\nclasses = ["nope"]\n',
    )
    with pytest.raises(ConfigError) as excinfo:
        trioserve.load_config(path)
    assert str(excinfo.value).startswith('tenants."a.b".classes: unknown class \'nope\'')
    path = write(tmp_path, '[models."a b"]\nbackend = "echo"\nzzz = 1\n')
    with pytest.raises(ConfigError) as excinfo:
        trioserve.load_config(path)
    assert str(excinfo.value).startswith('models."a b".zzz: unknown key')


def test_model_names_that_are_url_segments_are_taken(tmp_path):
    path = write(
        tmp_path, '[models."resnet50_v1.5"]\nbackend = "echo"\n[models."a b"]\nbackend = "echo"\n'
    )
    assert [m.name for m in trioserve.load_config(path).models] == ["resnet50_v1.5", "a b"]


def test_unknown_model_key_is_named(tmp_path):
    path = write(tmp_path, '[models.mlp]\nbackend = "mlp"\nmax_batch = 8\n')
    with pytest.raises(ConfigError) as excinfo:
        trioserve.load_config(path)
    msg = str(excinfo.value)
    assert msg.startswith(
        "models.mlp.max_batch: unknown key; did you mean 'max_batch_size'? "
        "expected one of backend, "
    )


def test_an_unknown_key_far_from_every_key_gets_no_guess(tmp_path):
    path = write(tmp_path, '[models.mlp]\nbackend = "mlp"\nzzz = 8\n')
    with pytest.raises(ConfigError) as excinfo:
        trioserve.load_config(path)
    assert str(excinfo.value).startswith("models.mlp.zzz: unknown key; expected one of backend, ")


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ('execution = "ray"\nray = { num_cpu = 1 }',
         "models.m.ray.num_cpu: unknown key; did you mean 'num_cpus'? expected one of "
         "num_cpus, "),
        ('rollout = { stable = "1", stpes = [0.5] }',
         "models.m.rollout.stpes: unknown key; did you mean 'steps'? expected one of "
         "stable, "),
        ('versions = { "1" = { backnd = "echo" } }',
         "models.m.versions.1.backnd: unknown key; did you mean 'backend'? a version may "
         "override backend, options"),
    ],
)
def test_an_unknown_key_of_a_models_inner_table_is_guessed_too(tmp_path, lines, message):
    """The tables within a model's (ray, rollout, a version's) name the nearest key,
    as every other table does; they only listed the keys."""
    path = write(tmp_path, f'[models.m]\nbackend = "echo"\n{lines}\n')
    with pytest.raises(ConfigError) as excinfo:
        trioserve.load_config(path)
    assert str(excinfo.value).startswith(message), str(excinfo.value)


def test_an_unknown_option_of_a_built_in_backend_is_guessed():
    from trioserve._builtin import resolve_backend

    m = ModelConfig(name="m", backend="mlp", options={"sed": 1})
    with pytest.raises(
        ConfigError,
        match=r"^models\.m\.options\.sed: unknown option for backend 'mlp'; did you mean "
        r"'seed'\? expected one of seed$",
    ):
        resolve_backend(m)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("max_batch_size = 0", "models.mlp.max_batch_size: must be an integer >= 1, got 0"),
        ('max_batch_size = "8"', "models.mlp.max_batch_size: must be an integer >= 1, got '8'"),
        ("max_batch_size = true", "models.mlp.max_batch_size: must be an integer >= 1, got True"),
        (
            'oversize = "bogus"',
            "models.mlp.oversize: must be one of 'reject', 'alone', 'split', got 'bogus'",
        ),
        ('devices = ["gpu"]', "models.mlp.devices: device 'gpu' is not 'cpu' or 'cuda:N'"),
        ('devices = ["cuda:x"]', "models.mlp.devices: device 'cuda:x' is not 'cpu' or 'cuda:N'"),
        # torch refused these at load: "Invalid device string"
        ('devices = ["cuda:"]', "models.mlp.devices: device 'cuda:' is not 'cpu' or 'cuda:N'"),
        ('devices = ["cpu:"]', "models.mlp.devices: device 'cpu:' is not 'cpu' or 'cuda:N'"),
        ('devices = ["cuda:\u0661"]',
         "models.mlp.devices: device 'cuda:\u0661' is not 'cpu' or 'cuda:N'"),
        ("devices = []", "models.mlp.devices: must not be empty"),
        ("replicas = 0", "models.mlp.replicas: must be an integer >= 1, got 0"),
        ("max_batch_tokens = 0", "models.mlp.max_batch_tokens: must be an integer >= 1, got 0"),
        ("max_wait_ms = -1", "models.mlp.max_wait_ms: must be a finite number >= 0.0, got -1"),
        ("max_wait_ms = nan", "models.mlp.max_wait_ms: must be a finite number >= 0.0, got nan"),
        ("timeout_ms = 0", "models.mlp.timeout_ms: must be a finite number > 0.0, got 0"),
        ('execution = "gpu"', "models.mlp.execution: must be one of 'thread', 'inline'"),
        ("versions = []", "models.mlp.versions: must not be empty"),
        ('versions = ["1", "1"]', "models.mlp.versions: has duplicates: ['1', '1']"),
        ('versions = ["1/2"]', "models.mlp.versions: must be usable as one segment of a URL"),
        ('versions = [".."]', "models.mlp.versions: must be usable as one segment of a URL"),
        ("options = 3", "models.mlp.options: must be a table, got 3"),
        ('backend = "bogus"', "models.mlp.backend: 'bogus' is neither a built-in backend"),
        ('backend = ":"', "models.mlp.backend: ':' is neither a built-in backend"),
        ('backend = "pkg..mod:f"', "models.mlp.backend: 'pkg..mod:f' is neither a built-in"),
        ('backend = "pkg.mod:"', "models.mlp.backend: 'pkg.mod:' is neither a built-in"),
        (
            'backend = "pkg.mod.attr"',
            "models.mlp.backend: 'pkg.mod.attr' is neither a built-in backend (mlp, echo, "
            "sleep, minilm) nor an import string 'module:attr' (did you mean 'pkg.mod:attr'?)",
        ),
        (f"max_wait_ms = {HUGE}", f"models.mlp.max_wait_ms: must be a finite number >= 0.0, "
                                  f"got {HUGE_SHOWN}"),
        (f"timeout_ms = {HUGE}", "models.mlp.timeout_ms: must be a finite number > 0.0, got 9"),
        (
            f"max_batch_size = {MAX_BATCH_SIZE + 1}",
            f"models.mlp.max_batch_size: must be an integer <= {MAX_BATCH_SIZE}, got 65537",
        ),
        (
            "max_batch_size = 9223372036854775807",
            "models.mlp.max_batch_size: must be an integer <= 65536, got 9223372036854775807",
        ),
        (
            "torch_threads = 9223372036854775807",
            "models.mlp.torch_threads: must be an integer <= 1024, got 9223372036854775807",
        ),
        ("replicas = 257", "models.mlp.replicas: must be an integer <= 256, got 257"),
        ("slow_lane_replicas = 257", "models.mlp.slow_lane_replicas: must be an integer <= 256"),
    ],
)
def test_bad_model_values_name_the_key(tmp_path, line, message):
    key = line.split(" =")[0]
    lines = [line] if key == "backend" else ['backend = "mlp"', line]
    path = write(tmp_path, "[models.mlp]\n" + "\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as excinfo:
        trioserve.load_config(path)
    assert str(excinfo.value).startswith(message)


@pytest.mark.parametrize(
    "keys", [["sk-secret-1", "sk-secret-1"], ["sk-secret-1", ""], ["sk-secret-1", 7]]
)
def test_a_bad_list_of_api_keys_is_refused_without_showing_a_key(keys):
    with pytest.raises(trioserve.ConfigError) as tenant:
        trioserve.TenantConfig(name="t", api_keys=tuple(keys))
    with pytest.raises(trioserve.ConfigError) as server:
        trioserve.ServerConfig(control_plane_keys=tuple(keys))
    for error, key in ((tenant, "api_keys"), (server, "control_plane_keys")):
        assert key in str(error.value)
        assert "sk-secret" not in str(error.value)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[models.m]\nmax_batch_size = 4\n", "models.m.backend: is required"),
        (
            "[modelz.m]\nbackend = 'echo'\n",
            "modelz: unknown key; did you mean 'models'? expected one of models, ",
        ),
        ("models = 3\n", "models: must be a table of [models.NAME] tables"),
        ("[models]\nm = 3\n", "models.m: must be a table, got 3"),
        ("[tenants.t]\ndefault = true\n", "models: at least one model must be configured"),
        ("[runtime]\nqueue_bound = 1\n", "models: at least one model must be configured"),
        (
            "[models.m]\nbackend = 'echo'\n[runtime]\nrestart_period_s = 0\n",
            "runtime.restart_period_s: must be a finite number > 0.0, got 0",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[runtime]\nunload_timeout_s = -1\n",
            "runtime.unload_timeout_s: must be a finite number >= 0.0, got -1",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[runtime]\nunload_timeout_s = inf\n",
            "runtime.unload_timeout_s: must be a finite number >= 0.0, got inf",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[runtime]\nqueue_bound = 0\n",
            "runtime.queue_bound: must be an integer >= 1, got 0",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[runtime]\nqueue_bound = 1048577\n",
            "runtime.queue_bound: must be an integer <= 1048576, got 1048577",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[runtime]\nqueue_bound = 9223372036854775807\n",
            "runtime.queue_bound: must be an integer <= 1048576, got 9223372036854775807",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[runtime]\ninbox_bound = 1048577\n",
            "runtime.inbox_bound: must be an integer <= 1048576, got 1048577",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[runtime]\nrollout_state_file = ''\n",
            "runtime.rollout_state_file: must be a file's path (a non-empty string), got ''",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[runtime]\nrestarts = 3\n",
            "runtime.restarts: unknown key; did you mean 'restart_period_s'? "
            "expected one of queue_bound, ",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[server]\nport = -1\n",
            "server.port: must be a port number, 0 to 65535 (0: any free port), got -1",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[server]\nport = 70000\n",
            "server.port: must be a port number, 0 to 65535 (0: any free port), got 70000",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[server]\ncontrol_port = 70000\n",
            "server.control_port: must be an integer <= 65535, got 70000",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[server]\nwrite_timeout_s = 0\n",
            "server.write_timeout_s: must be a finite number > 0.0, got 0",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[server]\ndrain_delay_s = -1\n",
            "server.drain_delay_s: must be a finite number >= 0.0, got -1",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[server]\ndrain_delay_s = inf\n",
            "server.drain_delay_s: must be a finite number >= 0.0, got inf",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[server]\ndrain_delay_s = 301\n",
            "server.drain_delay_s: must be a finite number <= 300.0, got 301",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[server]\nmax_connections = 0\n",
            "server.max_connections: must be an integer >= 1, got 0",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[server]\nstream_in_flight_bytes = 0\n",
            "server.stream_in_flight_bytes: must be an integer >= 1, got 0",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[server]\nstream_write_timeout_s = 0\n",
            "server.stream_write_timeout_s: must be a finite number > 0.0, got 0",
        ),
        (  # a size meant in MiB: it would keep next to nothing (~1 KiB an answer)
            "[models.m]\nbackend = 'echo'\n[server]\nidempotency_max_bytes = 64\n",
            "server.idempotency_max_bytes: must be an integer >= 65536, got 64",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[server]\nidempotency_max_bytes = '64MiB'\n",
            "server.idempotency_max_bytes: must be an integer >= 65536, got '64MiB'",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[tenants.t]\nweight = 0\n",
            "tenants.t.weight: must be a finite number >= 0.001, got 0",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[tenants.t]\napi_keys = 'k'\n",
            "tenants.t.api_keys: must be a list of non-empty strings",  # no key shown
        ),
        (
            "[models.m]\nbackend = 'echo'\n[tenants.t]\napi_keys = ['k', 'k']\n",
            "tenants.t.api_keys: has duplicates: 2 keys, 1 distinct",  # no key shown
        ),
        (
            "[models.m]\nbackend = 'echo'\n[tenants.a]\ndefault = true\n"
            "[tenants.b]\ndefault = true\n",
            "tenants: only one tenant may be default, got ['a', 'b']",
        ),
        (
            f"[models.m]\nbackend = 'echo'\n[tenants.t]\nweight = {HUGE}\n",
            f"tenants.t.weight: must be a finite number >= 0.001, got {HUGE_SHOWN}",
        ),
        (
            f"[models.m]\nbackend = 'echo'\n[tenants.t]\ncredit_rate = -{HUGE}\n",
            f"tenants.t.credit_rate: must be a finite number > 0.0, got -{HUGE_SHOWN[1:]}",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[runtime]\nswitch_interval_us = 1e300\n",
            "runtime.switch_interval_us: must be a finite number <= 1000000.0, got 1e+300",
        ),
        (
            "[models.m]\nbackend = 'echo'\n[server]\nmax_body_bytes = 9223372036854775807\n",
            "server.max_body_bytes: must be an integer <= 4294967296, got 9223372036854775807",
        ),
        (
            f"[models.m]\nbackend = 'echo'\nmax_wait_ms = 0x{'f' * 4000}\n",
            "models.m.max_wait_ms: must be a finite number >= 0.0, got an integer of thousands "
            "of digits",
        ),
    ],
)
def test_bad_tables_name_the_key(tmp_path, toml, message):
    with pytest.raises(ConfigError) as excinfo:
        trioserve.load_config(write(tmp_path, toml))
    assert str(excinfo.value).startswith(message)


def test_duplicate_api_keys_name_both_tenants(tmp_path):
    toml = """
        [models.m]
        backend = "echo"
        [tenants.a]
        api_keys = ["k1", "shared"]
        [tenants.b]
        api_keys = ["shared"]
    """
    with pytest.raises(
        ConfigError, match=r"^tenants\.b\.api_keys: key already belongs to tenant 'a'$"
    ):
        trioserve.load_config(write(tmp_path, toml))


def test_unreadable_file_is_named(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as excinfo:
        trioserve.load_config(missing)
    assert str(excinfo.value) == f"{missing}: cannot read config file: No such file or directory"
    with pytest.raises(ConfigError, match="cannot read config file: Is a directory"):
        trioserve.load_config(tmp_path)


def test_a_config_path_that_never_ends_is_refused():
    """--config /dev/zero read for ever (and filled the memory)."""
    with pytest.raises(ConfigError, match=r"^/dev/zero: not a config file: over 1 MiB$"):
        trioserve.load_config("/dev/zero")


def test_a_large_config_file_is_still_read(tmp_path):
    padding = "# " + "x" * 1000 + "\n"
    path = write(tmp_path, padding * 1000 + "[models.m]\nbackend = 'echo'\n")
    assert trioserve.load_config(path).models[0].name == "m"


def test_invalid_toml_is_named(tmp_path):
    path = write(tmp_path, "[models.m\nbackend = 'echo'\n")
    with pytest.raises(ConfigError) as excinfo:
        trioserve.load_config(path)
    assert str(excinfo.value).startswith(f"{path}: invalid TOML: ")
    assert "line 1" in str(excinfo.value)


YAML_HINT = (
    " (the config file is TOML, not YAML: `key = value` lines under `[table]` headers; "
    "docs/configuration.md)"
)


# Regression: a YAML file failed with TOML's accurate but puzzling "Expected '=' after
# a key in a key/value pair", nothing saying that the config is TOML.
@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("serve.yaml", "models:\n  mlp:\n    backend: mlp\n"),
        ("serve.YML", "# my config\n\nmodels:\n  mlp:\n    backend: mlp\n"),
        ("serve.toml", "models:\n  mlp:\n    backend: mlp\n"),  # reads as YAML
        ("serve.conf", "---\nmodels: {}\n"),
        ("serve.yml", "[models.m\nbackend = 'echo'\n"),  # named so: the hint too
    ],
)
def test_a_yaml_config_that_fails_as_toml_says_the_config_is_toml(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as excinfo:
        trioserve.load_config(path)
    message = str(excinfo.value)
    assert message.startswith(f"{path}: invalid TOML: ")
    assert message.endswith(f"){YAML_HINT}")  # after TOML's own "(at line L, column C)"


def test_a_toml_error_in_a_toml_file_has_no_yaml_hint(tmp_path):
    path = write(tmp_path, "[models.m]\nbackend: 'echo'\n")
    with pytest.raises(ConfigError) as excinfo:
        trioserve.load_config(path)
    assert str(excinfo.value) == (
        f"{path}: invalid TOML: Expected '=' after a key in a key/value pair "
        "(at line 2, column 8)"
    )


# Regression: an unquoted string (`backend = mlp`) failed with TOML's bare "Invalid
# value (at line 2, column 11)", a puzzle to whoever wrote YAML or INI before.
@pytest.mark.parametrize(
    ("text", "where", "hint"),
    [
        ("[models.m]\nbackend = echo\n", "line 2, column 11", '"echo", not echo'),
        ('[models.m]\nbackend = "echo"\ndevices = [cpu]\n', "line 3, column 12",
         '"cpu", not cpu'),
        ('[models.m]\r\nbackend = "echo"\r\noversize =alone # c\r\n', "line 3, column 11",
         '"alone", not alone'),
        ('[models.m]\nbackend = "echo"\nhedge = True\n', "line 3, column 9", None),
    ],
)
def test_a_bare_word_for_a_value_says_strings_are_quoted(tmp_path, text, where, hint):
    path = tmp_path / "serve.toml"
    path.write_bytes(text.encode())
    with pytest.raises(ConfigError) as excinfo:
        trioserve.load_config(path)
    if hint is None:
        tail = " (TOML's booleans are lowercase: true, not True)"
    else:
        tail = f" (a string is quoted in TOML: {hint})"
    assert str(excinfo.value) == f"{path}: invalid TOML: Invalid value (at {where}){tail}"


def test_an_invalid_value_that_is_not_a_word_has_no_quoting_hint(tmp_path):
    path = write(tmp_path, "[models.m]\nbackend = 'echo'\nreplicas = @1\n")
    with pytest.raises(ConfigError) as excinfo:
        trioserve.load_config(path)
    assert str(excinfo.value).endswith("Invalid value (at line 3, column 12)")
    assert "quoted" not in str(excinfo.value)
    assert "lowercase" not in str(excinfo.value)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[models.e]\nbackend = "echo"\n# caf\xe9\n')
    with pytest.raises(ConfigError) as excinfo:
        trioserve.load_config(path)
    assert str(excinfo.value) == f"{path}: invalid TOML: not UTF-8 text (byte 0xe9 on line 3)"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("9" * 5000, "Exceeds the limit (4300 digits) for integer string conversion"),
        ("[" * 5000 + "]" * 5000, "arrays or tables nested too deeply"),
    ],
)
def test_toml_that_python_cannot_read_is_named(tmp_path, value, message):
    path = write(tmp_path, f'[models.e]\nbackend = "echo"\nx = {value}\n')
    with pytest.raises(ConfigError) as excinfo:
        trioserve.load_config(path)
    assert str(excinfo.value).startswith(f"{path}: invalid TOML: {message}")


@pytest.mark.parametrize(
    "name",
    ["backend_colon", "hugeint_max_wait", "latin1", "torch_threads", "hugeint_sleep_option"],
)
def test_the_serve_command_says_what_is_wrong_in_one_line(tmp_path, capsys, name):
    text = {
        "backend_colon": b'[models.e]\nbackend = ":"\n',
        "hugeint_max_wait": f'[models.e]\nbackend = "echo"\nmax_wait_ms = {HUGE}\n'.encode(),
        "latin1": b'[models.e]\nbackend = "echo"\n# caf\xe9\n',
        "torch_threads": b'[models.e]\nbackend = "mlp"\ntorch_threads = 9223372036854775807\n',
        # checked by the backend, as the runtime starts
        "hugeint_sleep_option": f'[models.e]\nbackend = "sleep"\n'
                                f"options = {{ delay_per_batch_ms = {HUGE} }}\n".encode(),
    }[name]
    path = tmp_path / "bad.toml"
    path.write_bytes(text)
    assert main(["serve", "--config", str(path), "--port", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("trioserve: invalid configuration: ")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("text", "error"),
    [
        # found as the file is read
        ('[models.e]\nbackend = "echo"\nmax_batch_sise = 4\n',
         "models.e.max_batch_sise: unknown key; did you mean 'max_batch_size'?"),
        ('[models.e]\nbackend = "echo"\nmax_wait_ms = -1\n',
         "models.e.max_wait_ms: must be a finite number >= 0.0, got -1"),
        ('[serverr]\nport = 1\n[models.e]\nbackend = "echo"\n',
         "serverr: unknown key; did you mean 'server'?"),
        ("", "models: at least one model must be configured"),
        # found by the backend, as the runtime starts
        ('[models.e]\nbackend = "sleep"\noptions = { delay_per_batch_ms = -1 }\n',
         "models.e.options.delay_per_batch_ms: must be >= 0, got -1"),
    ],
)
def test_the_serve_command_names_the_file_then_the_key(tmp_path, capsys, text, error):
    """An operator with several files (or a unit that starts the server with one
    of them) learns which one is wrong: the line named the key alone."""
    path = tmp_path / "prod.toml"
    path.write_text(text)
    assert main(["serve", "--config", str(path), "--port", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"trioserve: invalid configuration: {path}: {error}")
    assert err.count("\n") == 1


def test_a_file_that_cannot_be_parsed_is_named_once(tmp_path, capsys):
    path = tmp_path / "prod.toml"
    path.write_text("[models.e\n")
    assert main(["serve", "--config", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trioserve: invalid configuration: {path}: invalid TOML: ")
    assert err.count(str(path)) == 1


def test_bench_names_the_file_for_its_values_not_for_its_own_options(tmp_path, capsys):
    path = write(tmp_path, '[models.mlp]\nbackend = "echo"\nreplicas = 0\n')
    assert main(["bench", "--config", str(path), "-d", "1"]) == 2
    assert capsys.readouterr().err == (
        f"trioserve: invalid configuration: {path}: models.mlp.replicas: must be an "
        "integer >= 1, got 0\n"
    )
    # a value given on the command line is no value of the file
    path = write(tmp_path, VALID)
    assert main(["bench", "--config", str(path), "--max-batch-size", "65537", "-d", "1"]) == 2
    assert capsys.readouterr().err == (
        "trioserve: invalid configuration: models.mlp.max_batch_size: must be an integer "
        "<= 65536, got 65537\n"
    )


def test_python_values_are_checked_too():
    with pytest.raises(ConfigError, match=r"^models\.m\.max_batch_size: must be an integer >= 1"):
        ModelConfig(name="m", backend="echo", max_batch_size=0)
    with pytest.raises(ConfigError, match=r"^models\.m\.backend: is required$"):
        ModelConfig(name="m")
    with pytest.raises(ConfigError, match=r"^models\.m: defined twice$"):
        Config(models=(ModelConfig(name="m", backend="echo"),) * 2)
    with pytest.raises(ConfigError, match=r"^models: must be a list of ModelConfig$"):
        Config(models=("echo",))
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"runtime": {"queue_bound": 5}},
            "runtime: must be a RuntimeLimits, got {'queue_bound': 5}",
        ),
        ({"cache": 3}, "cache: must be a CacheConfig, got 3"),
        ({"server": None}, "server: must be a ServerConfig, got None"),
        ({"runtime": CacheConfig()}, "runtime: must be a RuntimeLimits, got CacheConfig("),
        ({"tenants": None}, "tenants: must be a list of TenantConfig"),
        ({"classes": "realtime"}, "classes: must be a list of ClassConfig"),
    ],
)
def test_python_config_parts_of_the_wrong_type_are_named(kw, message):
    with pytest.raises(ConfigError) as excinfo:
        Config(models=(ModelConfig(name="e", backend="echo"),), **kw)
    assert str(excinfo.value).startswith(message)


def test_a_python_backend_that_is_neither_a_name_nor_a_backend_is_named():
    with pytest.raises(
        ConfigError,
        match=r"^models\.m\.backend: must be a built-in backend's name, an import string "
        r"'module:attr', a ModelBackend or a callable returning one, got 3$",
    ):
        ModelConfig(name="m", backend=3)


# ---------------------------------------------------------------- at startup
async def test_unknown_backend_option_fails_open_runtime():
    cfg = Config(models=(ModelConfig(name="e", backend="echo", options={"bogus": 1}),))
    with pytest.raises(
        ConfigError,
        match=r"^models\.e\.options\.bogus: unknown option for backend 'echo'; "
        r"expected one of none$",
    ):
        async with trioserve.open_runtime(cfg):
            pytest.fail("started with a bad option")


async def test_backend_option_of_the_wrong_type_fails_open_runtime():
    cfg = Config(
        models=(ModelConfig(name="s", backend="sleep", options={"delay_per_batch_ms": "5"}),)
    )
    with pytest.raises(
        ConfigError, match=r"^models\.s\.options\.delay_per_batch_ms: expected number, got '5'$"
    ):
        async with trioserve.open_runtime(cfg):
            pytest.fail("started with a bad option")


@pytest.mark.parametrize(
    ("backend", "options", "message"),
    [
        ("mlp", {"seed": 1.5}, r"^models\.m\.options\.seed: expected int, got 1\.5$"),
        ("mlp", {"seed": True}, r"^models\.m\.options\.seed: expected int, got True$"),
        ("sleep", {"delay_per_item_ms": -1.0},
         r"^models\.m\.options\.delay_per_item_ms: must be >= 0, got -1\.0$"),
        ("sleep", {"delay_per_item_ms": math.inf},
         r"^models\.m\.options\.delay_per_item_ms: expected number, got inf$"),
        ("minilm", {"max_length": 0}, r"^models\.m\.options\.max_length: must be >= 3, got 0$"),
        ("minilm", {"max_length": 513},
         r"^models\.m\.options\.max_length: must be <= 512, got 513$"),
        ("sleep", {"delay_per_batch_ms": int(HUGE)},
         rf"^models\.m\.options\.delay_per_batch_ms: expected number, got {HUGE_SHOWN[:40]}"),
        ("mlp", {"seed": 2**64},
         r"^models\.m\.options\.seed: must be <= 18446744073709551615, got 18446744073709551616$"),
        ("mlp", {"seed": -(2**63) - 1},
         r"^models\.m\.options\.seed: must be >= -9223372036854775808, got "),
    ],
)
async def test_a_backend_option_out_of_its_range_fails_open_runtime(backend, options, message):
    cfg = Config(models=(ModelConfig(name="m", backend=backend, options=options),))
    with pytest.raises(ConfigError, match=message):
        async with trioserve.open_runtime(cfg):
            pytest.fail("started with a bad option")


def _factory(*, size: int = 1):
    if size < 0:
        raise ValueError("size must be >= 0")
    return trioserve.CallableBackend(lambda items: items, inputs=(), outputs=())


@pytest.mark.parametrize(
    ("options", "message"),
    [({"nope": 1}, "TypeError: .*unexpected keyword argument 'nope'"),
     ({"size": -1}, "ValueError: size must be >= 0")],
)
async def test_a_backend_factory_that_fails_is_a_config_error(options, message):
    cfg = Config(models=(ModelConfig(name="f", backend=f"{__name__}:_factory",
                                     options=options),))
    with pytest.raises(ConfigError, match=rf"^models\.f\.backend: .* failed with its "
                                          rf"options .*: {message}"):
        async with trioserve.open_runtime(cfg):
            pytest.fail("started without its model")


async def test_unimportable_backend_fails_open_runtime():
    cfg = Config(models=(ModelConfig(name="x", backend="no_such_module_here:factory"),))
    with pytest.raises(
        ConfigError,
        match=r"^models\.x\.backend: cannot import 'no_such_module_here:factory': "
        r"ModuleNotFoundError: No module named 'no_such_module_here' \(put the directory "
        r"that holds 'no_such_module_here' on PYTHONPATH, or install it\)$",
    ):
        async with trioserve.open_runtime(cfg):
            pytest.fail("started without its model")


def _model_function(items):
    return items


def _not_a_backend():
    return [1, 2]


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        # the model's function named where its backend belongs
        ("_model_function", r"failed with its options \{\}: TypeError: .*'items' \(name a "
                            r"ModelBackend, such as trioserve\.CallableBackend\(fn, "),
        ("_not_a_backend", r"is not a ModelBackend \(got list; name a ModelBackend, such as "),
    ],
)
async def test_a_backend_that_is_no_model_backend_says_what_to_name(attr, message):
    cfg = Config(models=(ModelConfig(name="f", backend=f"{__name__}:{attr}"),))
    with pytest.raises(ConfigError, match=rf"^models\.f\.backend: '{__name__}:{attr}' {message}"):
        async with trioserve.open_runtime(cfg):
            pytest.fail("started without its model")


async def test_a_backend_module_that_fails_to_import_fails_open_runtime(tmp_path, monkeypatch):
    (tmp_path / "trioserve_test_broken_backend.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = Config(models=(ModelConfig(name="x", backend="trioserve_test_broken_backend:f"),))
    with pytest.raises(
        ConfigError,
        match=r"^models\.x\.backend: cannot import 'trioserve_test_broken_backend:f': "
        r"RuntimeError: boom$",
    ):
        async with trioserve.open_runtime(cfg):
            pytest.fail("started without its model")


# ---------------------------------------------------------------- the built-in default
async def test_default_config_serves_the_builtin_models(mlp_input):
    cfg = trioserve.load_config(None)
    names = [m.name for m in cfg.models]
    assert names[:2] == ["mlp", "echo"]
    assert ("minilm" in names) == minilm_available()
    assert [t.name for t in cfg.tenants] == ["demo"]
    assert cfg.tenants[0].default
    async with trioserve.open_runtime(cfg) as rt:
        y = (await rt.infer("mlp", mlp_input))["y"]
        assert y.shape == (16,)
        assert y.dtype == np.float32
        again = (await rt.infer("mlp", mlp_input))["y"]
        np.testing.assert_array_equal(y, again)  # a seeded, deterministic model
        echoed = await rt.infer("echo", {"a": [1, 2, 3]})
        np.testing.assert_array_equal(echoed["a"], [1, 2, 3])
        if minilm_available():
            e = (await rt.infer("minilm", {"text": "hello world"}))["embedding"]
            assert e.shape == (384,)
            assert e.dtype == np.float32
            assert abs(float(np.linalg.norm(e)) - 1.0) < 1e-5


def test_the_serve_command_says_in_one_line_that_it_cannot_listen(tmp_path, capsys):
    path = tmp_path / "echo.toml"
    path.write_bytes(b'[models.e]\nbackend = "echo"\n')
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--config", str(path), "--port", str(port)]) == 1
    out, err = capsys.readouterr()
    # at once: the address is bound before any model loads
    assert out == ""
    assert err.startswith(f"trioserve: cannot listen on 127.0.0.1:{port}: ")
    # and what to do about it
    assert err.endswith(
        " (another process listens there: stop it, or pick another port with --port "
        "or [server] port; 0 takes a free one)\n"
    )
    assert err.count("\n") == 1


def documented_example(tmp_path):
    """The TOML example of docs/configuration.md, written to a file."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    return write(tmp_path, doc.split("```toml\n", 1)[1].split("```", 1)[0])


def test_the_example_in_docs_configuration_md_names_every_key(tmp_path):
    """A reader finds every key a table takes in the example, set or commented out
    (an optional one): each field of the config classes but ``name`` (the table's)."""
    example = documented_example(tmp_path).read_text()
    keys = set(re.findall(r"^(?:# )?(\w+) = ", example, re.MULTILINE))
    keys |= set(re.findall(r"\{ (\w+) = ", example))
    for cls in (
        trioserve.RuntimeLimits, trioserve.ServerConfig, trioserve.CacheConfig,
        trioserve.ModelConfig, trioserve.TenantConfig, trioserve.ClassConfig,
    ):
        fields = {f.name for f in attrs.fields(cls)} - {"name"}
        assert fields - keys == set(), cls.__name__


async def test_the_example_in_docs_configuration_md_opens_and_serves(tmp_path):
    """The annotated file in docs/configuration.md is a configuration a reader copies:
    it loads and the runtime opens with it (its slow lane, on the only replica, was
    refused at start: ``slow_lane_replicas`` must be below ``replicas``)."""
    cfg = trioserve.load_config(documented_example(tmp_path))
    assert cfg.model("mlp").execution == "process"
    async with trioserve.open_runtime(cfg) as rt:
        out = await rt.infer("mlp", np.zeros(256, np.float32), tenant="acme")
    assert out["y"].shape == (16,)


#: Keys the example sets to something other than the code's default, each with a
#: comment saying what the default is (or, for ``backend``, that there is none).
EXAMPLE_NOT_DEFAULT = {"backend", "replicas", "execution", "options"}


def test_the_example_in_docs_configuration_md_shows_the_defaults(tmp_path):
    """``[runtime]``, ``[server]`` and ``[cache]`` "take the defaults shown", the two
    classes are the default ones, a model's keys show their defaults (but those whose
    comment names the default), and a key commented out is an optional one (default
    None, not set): a default changed in code and not in the page fails here."""
    path = documented_example(tmp_path)
    cfg = trioserve.load_config(path)
    assert cfg.runtime == RuntimeLimits()
    assert cfg.server == ServerConfig()
    assert cfg.cache == CacheConfig()
    assert cfg.classes == default_classes()
    mlp, default = cfg.model("mlp"), ModelConfig(name="mlp", backend="mlp")
    for f in attrs.fields(ModelConfig):
        if f.name not in EXAMPLE_NOT_DEFAULT:
            assert getattr(mlp, f.name) == getattr(default, f.name), f.name
    tables = {
        "runtime": RuntimeLimits, "server": ServerConfig, "cache": CacheConfig,
        "models": ModelConfig, "tenants": TenantConfig, "classes": trioserve.ClassConfig,
    }
    commented = []
    for line in path.read_text().splitlines():
        if header := re.match(r"\[(\w+)", line):
            cls = tables[header[1]]
        elif key := re.match(r"# (\w+) = ", line):
            commented.append((cls.__name__, key[1]))
            field = attrs.fields_dict(cls).get(key[1])
            assert field is not None, f"no such key: {commented[-1]}"
            assert field.default is None, commented[-1]
    assert len(commented) >= 8
