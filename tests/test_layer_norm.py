"""`kernels.layer_norm` against `mx.fast.layer_norm`: the forward bit for bit (widths of the model
and odd ones, large offsets, non-finite rows); the gradients against MLX's and against float64;
bfloat16 x (`dtype=mx.bfloat16`) against the float32 norm of x widened, the result and dx rounded to
bfloat16: bit for bit, forward and gradients; threads; lazy and compiled; other dtypes."""

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
    got, want = (a if isinstance(a, mx.array) else mx.array(a) for a in (got, want))
    assert got.shape == want.shape and got.dtype == want.dtype
    unsigned = mx.uint16 if got.dtype == mx.bfloat16 else mx.uint32
    np.testing.assert_array_equal(np.array(got.view(unsigned)), np.array(want.view(unsigned)))


def widened_norm(x, weight, bias, eps=1e-5):
    """A bfloat16 model's layer norm as MLX's ops compute it: x widened to float32, the float32 norm (the C++
    operation, itself checked against MLX above), the result rounded to bfloat16; its gradients by MLX's autodiff
    of the casts."""
    return kernels.layer_norm(x.astype(mx.float32), weight, bias, eps).astype(mx.bfloat16)


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


@pytest.mark.parametrize("shape", [(2, 203, 256), (9, 7), (13, 1000), (1, 1)])
@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_bfloat16_layer_norm_is_the_widened_float32_norm_bit_for_bit(shape, offset, rng):
    x, weight, bias = inputs(rng, shape, offset)
    x = x.astype(mx.bfloat16)
    cotangent = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)
    got, got_grads = mx.vjp(lambda *a: kernels.layer_norm(*a, 1e-5, dtype=mx.bfloat16), [x, weight, bias], [cotangent])
    want, want_grads = mx.vjp(widened_norm, [x, weight, bias], [cotangent])
    assert got[0].dtype == mx.bfloat16 and got_grads[0].dtype == mx.bfloat16
    assert_bits(got[0], want[0])
    assert_bits(got[0], mx.fast.layer_norm(x, weight, bias, 1e-5).astype(mx.bfloat16))  # MLX's own, promoted
    for g, w in zip(got_grads, want_grads, strict=True):
        assert_bits(g, w)


def test_bfloat16_layer_norm_of_non_finite_rows_is_the_widened_norm():
    x = mx.array(np.array([[np.nan, 1, 2], [np.inf, 1, 2], [-np.inf, 0, 0], [1e30, 0, -1e30], [5, 5, 5]], np.float32))
    x = x.astype(mx.bfloat16)
    weight, bias = mx.array([1.0, 2.0, 3.0]), mx.array([0.5, 0.0, -0.5])
    assert_bits(kernels.layer_norm(x, weight, bias, 1e-5, dtype=mx.bfloat16), widened_norm(x, weight, bias))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_layer_norm_dtype_is_the_results(dtype, rng):
    # without it MLX's promotion (float32 from bfloat16 x and float32 weights); with it that result cast
    for x_dtype in (mx.float32, mx.bfloat16):
        x, weight, bias = inputs(rng, (5, 16))
        x = x.astype(x_dtype)
        want = mx.fast.layer_norm(x, weight, bias, 1e-5)
        assert_bits(kernels.layer_norm(x, weight, bias, 1e-5), want)
        assert_bits(kernels.layer_norm(x, weight, bias, 1e-5, dtype=dtype), want.astype(dtype))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_layer_norm_threads_split_rows_not_results(dtype, rng, monkeypatch):
    x, weight, bias = inputs(rng, (3, 1111, 64))
    x = x.astype(dtype)
    cotangent = mx.array(rng.standard_normal(x.shape).astype(np.float32)).astype(dtype)

    def norm(*arrays):
        return kernels.layer_norm(*arrays, 1e-5, dtype=dtype)

    results = []
    for count in (1, 3):
        monkeypatch.setattr(sys.modules["kernels.layer_norm"], "threads", lambda count=count: count)
        out, grads = mx.vjp(norm, [x, weight, bias], [cotangent])
        results.append([*out, *grads])
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
