"""`models.precision.GroupNorm` (PyTorch's grouping, the groups' layer norm on `kernels.layer_norm`) against
MLX's `nn.GroupNorm` of the input widened to float32: the forward bit for bit, the gradients within float32
rounding (the C++ backward is the closed form), in float32 and bfloat16 (the result and dx rounded to it), on
maps of the input projection's shape and an odd one."""

from deformable_detr.models.precision import GroupNorm

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest


def norms(rng, channels, groups):
    ours, mlx_own = (
        GroupNorm(groups, channels, pytorch_compatible=True),
        nn.GroupNorm(groups, channels, pytorch_compatible=True),
    )
    ours.weight = mlx_own.weight = mx.array(rng.standard_normal(channels).astype(np.float32))
    ours.bias = mlx_own.bias = mx.array(rng.standard_normal(channels).astype(np.float32))
    return ours, mlx_own


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("shape, groups", [((2, 16, 22, 256), 32), ((1, 5, 7, 12), 3)])
def test_group_norm_is_mlx_group_norm_of_the_widened_input(shape, groups, dtype, rng):
    ours, mlx_own = norms(rng, shape[-1], groups)
    x = mx.array((rng.standard_normal(shape) * 3 + 1).astype(np.float32)).astype(dtype)
    cotangent = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    def with_parameters(norm):
        def apply(x, weight, bias):
            norm.weight, norm.bias = weight, bias
            return norm(x) if norm is ours else norm(x.astype(mx.float32)).astype(dtype)

        return apply

    parameters = [ours.weight, ours.bias]
    got, got_grads = mx.vjp(with_parameters(ours), [x, *parameters], [cotangent])
    want, want_grads = mx.vjp(with_parameters(mlx_own), [x, *parameters], [cotangent])
    assert got[0].dtype == dtype and got_grads[0].dtype == dtype
    assert mx.array_equal(got[0], want[0]).item()
    # dx: float32 rounding of the closed form, then dtype's rounding (bfloat16: one unit of its last place)
    step = {mx.float32: 1e-5, mx.bfloat16: 2**-7}[dtype]
    for name, g, w in zip(("dx", "dweight", "dbias"), got_grads, want_grads, strict=True):
        g, w = (np.array(a.astype(mx.float32)) for a in (g, w))
        scale = np.abs(w).max()
        assert np.abs(g - w).max() <= step * scale, name
