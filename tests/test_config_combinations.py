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


# Regression: cache_ttl_s and cache_shared on a model with cache = false were accepted
# and did nothing (coalesce, which works without the cache, is taken).
@pytest.mark.parametrize(("key", "value"), [("cache_ttl_s", 300), ("cache_shared", True)])
def test_cache_options_need_the_models_cache(tmp_path, key, value):
    with pytest.raises(ConfigError) as caught:
        ModelConfig(name="m", backend="echo", cache=False, **{key: value})
    assert str(caught.value) == (
        f"models.m.{key}: the model's results are not cached (cache = false), so {key} "
        f"would do nothing; set cache = true, or leave {key} out"
    )
    path = tmp_path / "c.toml"
    path.write_text(
        f'[models.m]\nbackend = "echo"\ncache = false\n{key} = {str(value).lower()}\n'
    )
    with pytest.raises(ConfigError, match=rf"^models\.m\.{key}: the model's results are not"):
        trioserve.load_config(path)
    assert getattr(ModelConfig(name="m", backend="echo", **{key: value}), key) == value
    off = ModelConfig(name="m", backend="echo", cache=False, cache_shared=False, coalesce=True)
    assert (off.cache_ttl_s, off.cache_shared, off.coalesce) == (None, False, True)


# Regression: cache_ttl_s and cache_shared were accepted, and did nothing, while the
# result cache itself was off ([cache] capacity_bytes = 0, the default).
@pytest.mark.parametrize(("key", "value"), [("cache_ttl_s", 300), ("cache_shared", True)])
def test_cache_options_need_the_result_cache(tmp_path, key, value):
    model = ModelConfig(name="m", backend="echo", **{key: value})
    with pytest.raises(ConfigError) as caught:
        trioserve.Config(models=(model,))
    assert str(caught.value) == (
        f"models.m.{key}: the result cache is off (cache.capacity_bytes = 0), so {key} "
        f"would do nothing; give [cache] a capacity_bytes, or leave {key} out"
    )
    path = tmp_path / "c.toml"
    path.write_text(f'[models.m]\nbackend = "echo"\n{key} = {str(value).lower()}\n')
    with pytest.raises(ConfigError, match=rf"^models\.m\.{key}: the result cache is off"):
        trioserve.load_config(path)
    path.write_text(path.read_text() + "[cache]\ncapacity_bytes = 1048576\n")
    assert getattr(trioserve.load_config(path).models[0], key) == value
    # Left at their defaults, with the cache off: taken, as is the built-in config.
    off = ModelConfig(name="m", backend="echo", cache_shared=False)
    assert trioserve.Config(models=(off,)).cache.capacity_bytes == 0
    assert trioserve.load_config(None).cache.capacity_bytes == 0


# Regression: [cache] tenant_quota_bytes was accepted, and did nothing, while the
# result cache itself was off (capacity_bytes = 0, the default), as cache_ttl_s was.
def test_a_tenant_quota_needs_the_result_cache(tmp_path):
    with pytest.raises(ConfigError) as caught:
        trioserve.CacheConfig(tenant_quota_bytes=4096)
    assert str(caught.value) == (
        "cache.tenant_quota_bytes: the result cache is off (cache.capacity_bytes = 0), "
        "so tenant_quota_bytes would do nothing; give [cache] a capacity_bytes, or "
        "leave tenant_quota_bytes out"
    )
    path = tmp_path / "c.toml"
    path.write_text('[models.m]\nbackend = "echo"\n[cache]\ntenant_quota_bytes = 4096\n')
    with pytest.raises(ConfigError, match=r"^cache\.tenant_quota_bytes: the result cache is off"):
        trioserve.load_config(path)
    path.write_text(path.read_text() + "capacity_bytes = 1048576\n")
    assert trioserve.load_config(path).cache.tenant_quota_bytes == 4096


# Regression: a tenant's credit_burst without a credit_rate was accepted and did
# nothing: the tenant had no bucket at all, its requests unlimited.
def test_a_credit_burst_needs_a_credit_rate(tmp_path):
    with pytest.raises(ConfigError) as caught:
        trioserve.TenantConfig(name="t", credit_burst=100)
    assert str(caught.value) == (
        "tenants.t.credit_burst: the tenant has no credits (no credit_rate: unlimited), "
        "so credit_burst would do nothing; set credit_rate too, or leave credit_burst out"
    )
    path = tmp_path / "c.toml"
    path.write_text('[models.m]\nbackend = "echo"\n[tenants.t]\ncredit_burst = 100\n')
    with pytest.raises(ConfigError, match=r"^tenants\.t\.credit_burst: the tenant has no"):
        trioserve.load_config(path)
    path.write_text(path.read_text() + "credit_rate = 10\n")
    assert trioserve.load_config(path).tenant("t").burst == 100


# Regression: an empty [tenants] table (or tenants=() from Python) made a runtime that
# refused every request (Unauthorized: no tenant given and no default tenant).
def test_no_tenants_at_all_is_refused(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[models.m]\nbackend = "echo"\n[tenants]\n')
    message = (
        "tenants: at least one tenant must be configured (without [tenants.*] at all: "
        "one open default tenant)"
    )
    with pytest.raises(ConfigError) as caught:
        trioserve.load_config(path)
    assert str(caught.value) == message
    with pytest.raises(ConfigError, match=r"^tenants: at least one tenant"):
        trioserve.Config(models=[ModelConfig(name="m", backend="echo")], tenants=[])
    path.write_text('[models.m]\nbackend = "echo"\n')
    assert [t.name for t in trioserve.load_config(path).tenants] == ["default"]


# Regression: a file saved with a UTF-8 byte order mark (Windows editors do) failed
# with "invalid TOML: Invalid statement (at line 1, column 1)".
def test_a_utf8_byte_order_mark_is_read_past(tmp_path):
    path = tmp_path / "c.toml"
    path.write_bytes(b'\xef\xbb\xbf[models.m]\nbackend = "echo"\nmax_batch_size = 8\n')
    assert trioserve.load_config(path).model("m").max_batch_size == 8
    path.write_bytes(b'\xef\xbb\xbf[models.m]\nbackend = "echo"\nmax_batch_size = \n')
    with pytest.raises(ConfigError, match=r"invalid TOML: .*\(at line 3, column 18\)"):
        trioserve.load_config(path)
