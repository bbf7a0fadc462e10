"""The cuda:N path: runs where torch sees a GPU, skips cleanly where none is."""

import numpy as np
import pytest
import torch
import trioserve

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")


@needs_cuda
@pytest.mark.parametrize("execution", ["thread", "process"])
async def test_mlp_on_cuda_matches_cpu(execution):
    x = np.random.default_rng(3).standard_normal(256).astype(np.float32)
    config = trioserve.Config(
        models=(
            trioserve.ModelConfig(name="gpu", backend="mlp", devices=("cuda:0",),
                                  execution=execution),
            trioserve.ModelConfig(name="cpu", backend="mlp", execution="thread"),
        )
    )
    async with trioserve.open_runtime(config) as rt:
        gpu = await rt.infer_batch("gpu", [x] * 8)
        cpu = await rt.infer("cpu", x)
    for out in gpu:
        np.testing.assert_allclose(out["y"], cpu["y"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("execution", ["thread", "process"])
async def test_unavailable_cuda_device_fails_at_start_with_a_clear_error(execution):
    n = torch.cuda.device_count()  # 0 without a GPU: cuda:0 is unavailable then
    config = trioserve.Config(
        models=(trioserve.ModelConfig(name="m", backend="mlp", devices=(f"cuda:{n}",),
                                      execution=execution),)
    )
    with pytest.raises(Exception, match=r"cuda"):
        async with trioserve.open_runtime(config):
            pass


@needs_cuda
async def test_unavailable_cuda_index_fails_at_start():
    n = torch.cuda.device_count()
    config = trioserve.Config(
        models=(trioserve.ModelConfig(name="m", backend="mlp", devices=(f"cuda:{n}",),
                                      execution="thread"),)
    )
    with pytest.raises(Exception, match="cuda"):
        async with trioserve.open_runtime(config):
            pass
