"""The backbone's convolutions on the CPU against `mx.conv2d` with gradients, on both of its engines:
oneDNN (kernels/onednn.py, where it is built), and without it matrix products: 1 x 1 as a product of
the input (MLX's copies it twice first); the others as patches times the weight, whose gradients are
products too (the input's through col2im). Plain, strided (MLX's input gradient is ~50x slower there),
dilated (MLX's takes its generic loop), the stem's 7 x 7."""

import kernels
from deformable_detr.models.backbone import Conv2d

import mlx.core as mx
import numpy as np
import pytest


@pytest.mark.parametrize(
    "kernel,stride,dilation,size,bias",
    [
        (1, 2, 1, (8, 11), False),
        (3, 2, 1, (9, 12), False),
        (3, 2, 1, (10, 10), True),
        (1, 1, 1, (7, 9), True),
        (1, 3, 1, (10, 8), False),
        (3, 1, 2, (9, 12), False),
        (3, 1, 3, (11, 8), True),
        (3, 1, 1, (9, 12), False),
        (3, 1, 1, (8, 7), True),
        (7, 2, 1, (15, 13), False),
    ],
)
@pytest.mark.parametrize("engine", ["onednn", "products"])
def test_conv_equals_mlx_conv_with_gradients(kernel, stride, dilation, size, bias, engine, rng, monkeypatch):
    if engine == "onednn" and kernels.onednn.module() is None:
        pytest.skip(f"oneDNN: {kernels.onednn.missing()}")
    if engine == "products":
        monkeypatch.setattr(kernels.onednn, "conv2d", lambda *args, **kwargs: None)
    padding = dilation * (kernel // 2)
    conv = Conv2d(5, 4, kernel, stride=stride, padding=padding, dilation=dilation, bias=bias)
    if bias:
        conv.bias = mx.array(rng.standard_normal(4).astype(np.float32))
    x = mx.array(rng.standard_normal((2, *size, 5)).astype(np.float32))

    def reference(x, weight):
        out = mx.conv2d(x, weight, stride=stride, padding=padding, dilation=dilation)
        return out + conv.bias if bias else out

    def ours(x, weight):
        conv.weight = weight
        return conv(x)

    cotangent = mx.array(rng.standard_normal(reference(x, conv.weight).shape).astype(np.float32))
    weight = conv.weight
    for f in (reference, ours):
        assert f(x, weight).shape == cotangent.shape
    if engine == "onednn":  # and not a silent fall-back
        assert kernels.onednn.conv2d(x, weight, stride, padding, dilation) is not None
    if dilation == 1 and engine == "products":  # the same GEMM as MLX's convolution, on the same rows
        assert mx.array_equal(ours(x, weight), reference(x, weight)).item()
    np.testing.assert_allclose(np.array(ours(x, weight)), np.array(reference(x, weight)), rtol=1e-6, atol=1e-5)
    got = mx.grad(lambda a, w: (ours(a, w) * cotangent).sum(), argnums=(0, 1))(x, weight)
    want = mx.grad(lambda a, w: (reference(a, w) * cotangent).sum(), argnums=(0, 1))(x, weight)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-5)
