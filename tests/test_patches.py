"""`kernels.patches` (im2col): the C++ operation against the MLX-ops path bit for bit, its product with
a weight against `mx.conv2d` (bit for bit undilated: the same matrix and GEMM as MLX's convolution),
its gradient (col2im) against float64, threads, bad input."""

import sys

import kernels
from kernels import native
from kernels.patches import _by_slices

import mlx.core as mx
import numpy as np
import pytest

needs_native = pytest.mark.skipif(native.missing() is not None, reason=f"{native.missing()}")
GEOMETRIES = [(3, 1, 1, 1), (3, 2, 1, 1), (3, 1, 2, 2), (7, 2, 3, 1), (1, 1, 0, 1), (3, 3, 0, 1), (3, 1, 0, 2)]


@needs_native
@pytest.mark.parametrize("kernel,stride,padding,dilation", GEOMETRIES)
def test_patches_are_the_mlx_ops_patches_and_give_mlx_convolution(kernel, stride, padding, dilation, rng):
    x = mx.array(rng.standard_normal((2, 9, 12, 5)).astype(np.float32))
    weight = mx.array(rng.standard_normal((4, kernel, kernel, 5)).astype(np.float32))
    got = kernels.patches(x, kernel, stride, padding, dilation)
    assert mx.array_equal(got, _by_slices(x, kernel, stride, padding, dilation)).item()
    conv = got @ weight.reshape(4, -1).T
    want = mx.conv2d(x, weight, stride=stride, padding=padding, dilation=dilation)
    if dilation == 1:
        assert mx.array_equal(conv, want).item()
    np.testing.assert_allclose(np.array(conv), np.array(want), rtol=1e-5, atol=1e-5)


def col2im(cotangent, shape, k, stride, padding, dilation):
    """The gradient of patches, in float64: each column entry added back to the pixel it was copied from."""
    n, h, w, c = shape
    grad = np.zeros((n, h + 2 * padding, w + 2 * padding, c))
    columns = cotangent.astype(np.float64).reshape(*cotangent.shape[:3], k, k, c)
    for oy in range(columns.shape[1]):
        for ox in range(columns.shape[2]):
            for ky in range(k):
                for kx in range(k):
                    grad[:, oy * stride + ky * dilation, ox * stride + kx * dilation] += columns[:, oy, ox, ky, kx]
    return grad[:, padding : padding + h, padding : padding + w]


@needs_native
@pytest.mark.parametrize("kernel,stride,padding,dilation", GEOMETRIES)
def test_patches_gradient_is_col2im(kernel, stride, padding, dilation, rng):
    x = mx.array(rng.standard_normal((2, 9, 12, 5)).astype(np.float32))
    cotangent = rng.standard_normal(kernels.patches(x, kernel, stride, padding, dilation).shape).astype(np.float32)
    got = mx.vjp(lambda a: kernels.patches(a, kernel, stride, padding, dilation), [x], [mx.array(cotangent)])[1][0]
    want = col2im(cotangent, x.shape, kernel, stride, padding, dilation)
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(np.array(got), want, rtol=1e-6, atol=1e-5)
    ops = mx.vjp(lambda a: _by_slices(a, kernel, stride, padding, dilation), [x], [mx.array(cotangent)])[1][0]
    np.testing.assert_allclose(np.array(ops), want, rtol=1e-6, atol=1e-5)


@needs_native
def test_patches_threads_split_rows_not_results(rng, monkeypatch):
    x = mx.array(rng.standard_normal((3, 41, 37, 16)).astype(np.float32))
    results = []
    for count in (1, 3):
        monkeypatch.setattr(sys.modules["kernels.patches"], "threads", lambda count=count: count)
        kernels.patches.__globals__["_native"].cache_clear()
        columns = kernels.patches(x, 3, 2, 2, 2)
        results.append(
            [np.array(columns), np.array(mx.vjp(lambda a: kernels.patches(a, 3, 2, 2, 2), [x], [columns])[1][0])]
        )
    for one, three in zip(*results, strict=True):
        np.testing.assert_array_equal(one, three)


def test_patches_refuse_bad_input():
    with pytest.raises(ValueError, match=r"expected \(N, H, W, C\)"):
        kernels.patches(mx.zeros((9, 12, 5)), 3)
    with pytest.raises(ValueError, match="must be positive"):
        kernels.patches(mx.zeros((1, 9, 12, 5)), 3, stride=0)
    with pytest.raises(ValueError, match="does not fit"):
        kernels.patches(mx.zeros((1, 2, 2, 5)), 5, dilation=2)
