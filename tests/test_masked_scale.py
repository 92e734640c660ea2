"""`kernels.masked_scale` and `kernels.scale_where_positive` against the MLX ops they stand for
(dropout's where, after a ReLU or not, and the gradient from the output): bit for bit, forward and
gradient (MLX's autodiff of the where included: a dropped element's gradient is g * 0), with
non-finite values and signed zeros, in float32 and bfloat16 (MLX's bfloat16 ops: each product rounded
once, the scale rounded to bfloat16 first); threads; lazy and compiled; other dtypes."""

import sys

import kernels
from kernels import native

import mlx.core as mx
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(native.missing() is not None, reason=f"{native.missing()}")

SCALE = 65536 / 58982  # dropout 0.1's, as recompute.Dropout computes it


FLOATS = [mx.float32, mx.bfloat16]


def assert_bits(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    unsigned = mx.uint16 if got.dtype == mx.bfloat16 else mx.uint32
    np.testing.assert_array_equal(np.array(got.view(unsigned)), np.array(want.view(unsigned)))


def dropout_in_mlx_ops(x, keep, scale, relu=False):
    return mx.where(keep, (mx.maximum(x, 0) if relu else x) * scale, mx.array(0, x.dtype))


def inputs(rng, shape=(300, 77), dtype=mx.float32):
    """x with NaN, infinities, signed zeros and the smallest subnormals (float32's, bfloat16's) in both kept
    and dropped places; a 90% mask; a cotangent with the same specials; x and the cotangent of `dtype`."""
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 9.2e-41, -9.2e-41], np.float32)
    x = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    placed = min(2 * specials.size, x.size)  # all of them, kept then dropped, where there is room
    x.reshape(-1)[:placed] = np.tile(specials, 2)[:placed]
    g.reshape(-1)[:placed] = np.tile(specials, 2)[:placed]
    keep = rng.random(shape) < 0.9
    keep.reshape(-1)[:placed] = np.repeat([True, False], specials.size)[:placed]
    return mx.array(x).astype(dtype), mx.array(keep), mx.array(g).astype(dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("scale", [SCALE, 1.0, 2.0, 1.0039])  # 1.0039: 1 in bfloat16
def test_masked_scale_is_the_where_bit_for_bit(relu, scale, dtype, rng):
    x, keep, _ = inputs(rng, dtype=dtype)
    assert_bits(kernels.masked_scale(x, keep, scale, relu=relu), dropout_in_mlx_ops(x, keep, scale, relu))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("scale", [SCALE, 1.0])
def test_scale_where_positive_is_the_where_bit_for_bit(scale, dtype, rng):
    x, keep, g = inputs(rng, dtype=dtype)
    output = dropout_in_mlx_ops(x, keep, SCALE, relu=True)
    want = mx.where(output > 0, g if scale == 1 else g * scale, mx.array(0, g.dtype))
    assert_bits(kernels.scale_where_positive(g, output, scale), want)


@pytest.mark.parametrize("dtype", FLOATS)
def test_masked_scale_gradient_is_mlx_autodiff_of_the_where(dtype, rng):
    x, keep, g = inputs(rng, dtype=dtype)
    _, got = mx.vjp(lambda a: kernels.masked_scale(a, keep, SCALE), [x], [g])
    _, want = mx.vjp(lambda a: dropout_in_mlx_ops(a, keep, SCALE), [x], [g])
    assert got[0].dtype == dtype
    assert_bits(got[0], want[0])
    dropped = ~np.array(keep)
    got_32, g_32 = np.array(got[0].astype(mx.float32)), np.array(g.astype(mx.float32))
    assert np.signbit(got_32[dropped & (g_32 < 0) & np.isfinite(g_32)]).all()  # g * 0, as MLX: -0 under a negative g


@pytest.mark.parametrize("dtype", FLOATS)
def test_masked_scale_after_a_relu_takes_its_gradient_from_the_output(dtype, rng):
    x, keep, g = inputs(rng, dtype=dtype)
    _, got = mx.vjp(lambda a: kernels.masked_scale(a, keep, SCALE, relu=True), [x], [g])
    output = dropout_in_mlx_ops(x, keep, SCALE, relu=True)
    assert_bits(got[0], mx.where(output > 0, g * SCALE, mx.array(0, g.dtype)))
    # and where x is finite and away from 0 that is the derivative: SCALE (as `dtype` rounds it) where kept and x > 0
    xs, gs, ks = np.array(x.astype(mx.float32)), np.array(g.astype(mx.float32)), np.array(keep)
    plain = np.isfinite(xs) & np.isfinite(gs) & (np.abs(xs) > 1e-3)
    scale = np.float32(mx.array(SCALE, dtype).astype(mx.float32).item())
    expected = mx.array(np.where(ks & (xs > 0), gs * scale, 0).astype(np.float32)).astype(dtype)
    got_32, expected_32 = (np.array(a.astype(mx.float32)) for a in (got[0], expected))
    np.testing.assert_array_equal(got_32[plain], expected_32[plain])


@pytest.mark.parametrize("dtype", FLOATS)
def test_masked_scale_threads_split_elements_not_results(dtype, rng, monkeypatch):
    x, keep, _ = inputs(rng, (70001,), dtype)
    results = []
    for count in (1, 3):
        monkeypatch.setattr(sys.modules["kernels.masked_scale"], "threads", lambda count=count: count)
        results.append(kernels.masked_scale(x, keep, SCALE, relu=True))
    assert_bits(results[0], results[1])
    assert_bits(results[0], dropout_in_mlx_ops(x, keep, SCALE, relu=True))


def test_masked_scale_is_lazy_and_compiles(rng):
    x, keep, _ = inputs(rng, (64, 16))
    x = mx.where(mx.isnan(x) | mx.isinf(x), 1.0, x)

    def loss(a):  # an evaluation inside mx.compile would raise
        return (kernels.masked_scale(a, keep, SCALE) * a).sum()

    got = mx.compile(mx.value_and_grad(loss))(x)
    want = mx.value_and_grad(lambda a: (dropout_in_mlx_ops(a, keep, SCALE) * a).sum())(x)
    np.testing.assert_allclose(np.array(got[0]), np.array(want[0]), rtol=1e-6)
    np.testing.assert_allclose(np.array(got[1]), np.array(want[1]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [mx.float16])
def test_masked_scale_of_other_dtypes_is_mlx_ops(dtype, rng):
    x, keep, g = inputs(rng, (9, 16))
    x, g = x.astype(dtype), g.astype(dtype)
    got = kernels.masked_scale(x, keep, SCALE, relu=True)
    assert got.dtype == dtype
    assert mx.array_equal(got, dropout_in_mlx_ops(x, keep, SCALE, relu=True), equal_nan=True).item()
    assert kernels.scale_where_positive(g, got, SCALE).dtype == dtype


@pytest.mark.parametrize("dtype", FLOATS)
def test_relu_is_mlx_maximum_bit_for_bit_and_its_gradient_reads_the_output(dtype, rng):
    x, _, g = inputs(rng, dtype=dtype)
    assert_bits(kernels.relu(x), mx.maximum(x, 0))  # NaN kept, -0 to +0, as MLX's maximum
    _, got = mx.vjp(kernels.relu, [x], [g])
    output = mx.maximum(x, 0)
    assert_bits(got[0], mx.where(output > 0, g, mx.array(0, g.dtype)))
    xs, gs, grad = (np.array(a.astype(mx.float32)) for a in (x, g, got[0]))
    plain = np.isfinite(xs) & (np.abs(xs) > 1e-3)
    np.testing.assert_array_equal(grad[plain], np.where(xs > 0, gs, 0).astype(np.float32)[plain])


def test_relu_takes_over_a_buffer_nothing_else_holds(rng):
    x = mx.array(rng.standard_normal((2048, 1024)).astype(np.float32))
    mx.eval(x)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(kernels.relu(x * 2))  # x * 2's buffer is nobody else's: the ReLU writes there
    assert mx.get_peak_memory() - base < 1.5 * x.nbytes


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("mode", ["dropout", "dropout after a ReLU", "its gradient", "a ReLU", "dropout's gradient"])
@pytest.mark.parametrize("count", [1, 7, 9, 31, 70001])
def test_every_mode_in_its_input_buffer_and_beside_it_is_the_where_bit_for_bit(mode, count, dtype, rng):
    # The loops are vector selects (8 floats or 4, then a tail): lengths that end inside a vector, and
    # the output written into the input's own buffer (a * 1 is nobody else's) as well as into a new one;
    # the inputs are views 16 elements into their buffers, with the specials first.
    x, keep, g = (mx.concatenate([a[:16], a])[16:] for a in inputs(rng, (count + 16,), dtype))
    output = dropout_in_mlx_ops(x, keep, SCALE, relu=True)
    operation, want = {
        "dropout": (lambda a: kernels.masked_scale(a, keep, SCALE), dropout_in_mlx_ops(x, keep, SCALE)),
        "dropout after a ReLU": (
            lambda a: kernels.masked_scale(a, keep, SCALE, relu=True),
            dropout_in_mlx_ops(x, keep, SCALE, relu=True),
        ),
        "its gradient": (
            lambda a: kernels.scale_where_positive(a, output, SCALE),
            mx.where(output > 0, x * SCALE, mx.array(0, x.dtype)),
        ),
        "a ReLU": (kernels.relu, mx.maximum(x, 0)),
        "dropout's gradient": (
            lambda a: mx.vjp(lambda b: kernels.masked_scale(b, keep, SCALE), [g], [a])[1][0],
            mx.vjp(lambda b: dropout_in_mlx_ops(b, keep, SCALE), [g], [x])[1][0],
        ),
    }[mode]
    assert_bits(operation(x), want)
    assert_bits(operation(x * 1), want)  # x * 1 has x's bits (-0, NaN): the same input
