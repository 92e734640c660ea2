"""The backbone's strided convolution: on the CPU its input gradient comes from a stride-1
convolution of the spread output gradient (MLX's own is ~50x slower there); same numbers."""

import mlx.core as mx
import numpy as np
import pytest

from deformable_detr.backbone import Conv2d


@pytest.mark.parametrize("kernel,size,bias", [(1, (8, 11), False), (3, (9, 12), False), (3, (10, 10), True)])
def test_strided_conv_equals_mlx_conv_with_gradients(kernel, size, bias, rng):
    conv = Conv2d(5, 4, kernel, stride=2, padding=kernel // 2, bias=bias)
    if bias:
        conv.bias = mx.array(rng.standard_normal(4).astype(np.float32))
    x = mx.array(rng.standard_normal((2, *size, 5)).astype(np.float32))

    def reference(x, weight):
        out = mx.conv2d(x, weight, stride=2, padding=kernel // 2)
        return out + conv.bias if bias else out

    def ours(x, weight):
        conv.weight = weight
        return conv(x)

    cotangent = mx.array(rng.standard_normal(reference(x, conv.weight).shape).astype(np.float32))
    weight = conv.weight
    for f in (reference, ours):
        assert f(x, weight).shape == cotangent.shape
    np.testing.assert_allclose(np.array(ours(x, weight)), np.array(reference(x, weight)), rtol=1e-6, atol=1e-6)
    got = mx.grad(lambda a, w: (ours(a, w) * cotangent).sum(), argnums=(0, 1))(x, weight)
    want = mx.grad(lambda a, w: (reference(a, w) * cotangent).sum(), argnums=(0, 1))(x, weight)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-5)
