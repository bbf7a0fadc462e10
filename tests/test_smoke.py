import numpy as np
import trioserve


async def test_default_config_serves_mlp_and_echo(mlp_input):
    config = trioserve.load_config()
    async with trioserve.open_runtime(config) as rt:
        out = await rt.infer("mlp", mlp_input)
        assert set(out) == {"y"}
        assert out["y"].shape == (16,)
        assert out["y"].dtype == np.float32
        echoed = await rt.infer("echo", {"a": [1, 2, 3]})
        np.testing.assert_array_equal(echoed["a"], [1, 2, 3])
