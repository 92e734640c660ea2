"""`kernels.layer_norm` against `mx.fast.layer_norm`: the forward bit for bit (widths of the model
and odd ones, large offsets, non-finite rows); the gradients against MLX's and against float64;
threads; lazy and compiled; other dtypes."""

import sys

import kernels
from kernels import native

import mlx.core as mx
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(native.missing() is not None, reason=f"{native.missing()}")


def inputs(rng, shape, offset=0.0):
    x = mx.array((rng.standard_normal(shape) * 3 + offset).astype(np.float32))
    weight, bias = (mx.array(rng.standard_normal(shape[-1]).astype(np.float32)) for _ in range(2))
    return x, weight, bias


def assert_bits(got, want):
    got, want = np.array(got), np.array(want)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("shape", [(2, 203, 256), (3, 5, 512), (9, 7), (13, 1000), (1, 1)])
@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_layer_norm_forward_is_mlx_bit_for_bit(shape, offset, rng):
    x, weight, bias = inputs(rng, shape, offset)
    assert_bits(kernels.layer_norm(x, weight, bias, 1e-5), mx.fast.layer_norm(x, weight, bias, 1e-5))


def test_layer_norm_of_non_finite_rows_is_mlx():
    x = mx.array(np.array([[np.nan, 1, 2], [np.inf, 1, 2], [-np.inf, 0, 0], [1e30, 0, -1e30], [5, 5, 5]], np.float32))
    weight, bias = mx.array([1.0, 2.0, 3.0]), mx.array([0.5, 0.0, -0.5])
    got, want = np.array(kernels.layer_norm(x, weight, bias, 1e-5)), np.array(mx.fast.layer_norm(x, weight, bias, 1e-5))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert_bits(np.nan_to_num(got), np.nan_to_num(want))


@pytest.mark.parametrize("shape", [(2, 300, 256), (4, 7), (200, 33)])
def test_layer_norm_gradients_match_mlx_and_float64(shape, rng):
    x, weight, bias = inputs(rng, shape, 0.5)
    cotangent = mx.array(rng.standard_normal(shape).astype(np.float32))
    got = mx.vjp(lambda *a: kernels.layer_norm(*a, 1e-5), [x, weight, bias], [cotangent])[1]
    want = mx.vjp(lambda *a: mx.fast.layer_norm(*a, 1e-5), [x, weight, bias], [cotangent])[1]
    with mx.stream(mx.cpu):  # float64: the CPU's only
        wide = [a.astype(mx.float64) for a in (x, weight, bias, cotangent)]
        exact = mx.vjp(lambda *a: mx.fast.layer_norm(*a, 1e-5), wide[:3], wide[3:])[1]
        mx.eval(exact)
    for g, w, e in zip(got, want, exact, strict=True):
        scale = np.abs(np.array(e)).max()
        ours, theirs = (np.abs(np.array(a, np.float64) - np.array(e)).max() / scale for a in (g, w))
        assert ours < 1e-5 and ours <= 4 * theirs + 1e-6, (ours, theirs)


def test_layer_norm_threads_split_rows_not_results(rng, monkeypatch):
    x, weight, bias = inputs(rng, (3, 1111, 64))
    cotangent = mx.array(rng.standard_normal(x.shape).astype(np.float32))
    results = []
    for count in (1, 3):
        monkeypatch.setattr(sys.modules["kernels.layer_norm"], "threads", lambda count=count: count)
        out, grads = mx.vjp(lambda *a: kernels.layer_norm(*a, 1e-5), [x, weight, bias], [cotangent])
        results.append([np.array(a) for a in (*out, *grads)])
    for one, three in zip(*results, strict=True):
        assert_bits(one, three)


def test_layer_norm_is_lazy_and_compiles(rng):
    x, weight, bias = inputs(rng, (64, 32))

    def loss(x, weight, bias):  # an evaluation inside mx.compile would raise
        return (kernels.layer_norm(x, weight, bias, 1e-5) ** 2).sum()

    got = mx.compile(mx.value_and_grad(loss, argnums=(0, 1, 2)))(x, weight, bias)
    want = mx.value_and_grad(lambda *a: (mx.fast.layer_norm(*a, 1e-5) ** 2).sum(), argnums=(0, 1, 2))(x, weight, bias)
    np.testing.assert_allclose(np.array(got[0]), np.array(want[0]), rtol=1e-6)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float64])
def test_layer_norm_of_other_dtypes_is_mlx(dtype, rng):
    x, weight, bias = inputs(rng, (9, 16))
    x = x.astype(dtype)
    with mx.stream(mx.cpu):
        got, want = kernels.layer_norm(x, weight, bias, 1e-5), mx.fast.layer_norm(x, weight, bias, 1e-5)
        assert got.dtype == want.dtype
        assert mx.array_equal(got, want).item()
