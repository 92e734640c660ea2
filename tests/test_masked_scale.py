"""`kernels.masked_scale` and `kernels.scale_where_positive` against the MLX ops they stand for
(dropout's where, after a ReLU or not, and the gradient from the output): bit for bit, forward and
gradient (MLX's autodiff of the where included: a dropped element's gradient is g * 0), with
non-finite values and signed zeros; threads; lazy and compiled; other dtypes."""

import sys

import kernels
from kernels import native

import mlx.core as mx
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(native.missing() is not None, reason=f"{native.missing()}")

SCALE = 65536 / 58982  # dropout 0.1's, as recompute.Dropout computes it


def assert_bits(got, want):
    got, want = np.array(got), np.array(want)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def dropout_in_mlx_ops(x, keep, scale, relu=False):
    return mx.where(keep, (mx.maximum(x, 0) if relu else x) * scale, mx.array(0, x.dtype))


def inputs(rng, shape=(300, 77)):
    """x with NaN, infinities and signed zeros in both kept and dropped places; a 90% mask; a cotangent
    with the same specials."""
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45], np.float32)
    x = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    x.reshape(-1)[: 2 * specials.size] = np.tile(specials, 2)
    g.reshape(-1)[: 2 * specials.size] = np.tile(specials, 2)
    keep = rng.random(shape) < 0.9
    keep.reshape(-1)[: 2 * specials.size] = np.repeat([True, False], specials.size)
    return mx.array(x), mx.array(keep), mx.array(g)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("scale", [SCALE, 1.0, 2.0])
def test_masked_scale_is_the_where_bit_for_bit(relu, scale, rng):
    x, keep, _ = inputs(rng)
    assert_bits(kernels.masked_scale(x, keep, scale, relu=relu), dropout_in_mlx_ops(x, keep, scale, relu))


@pytest.mark.parametrize("scale", [SCALE, 1.0])
def test_scale_where_positive_is_the_where_bit_for_bit(scale, rng):
    x, keep, g = inputs(rng)
    output = dropout_in_mlx_ops(x, keep, SCALE, relu=True)
    want = mx.where(output > 0, g if scale == 1 else g * scale, mx.array(0, g.dtype))
    assert_bits(kernels.scale_where_positive(g, output, scale), want)


def test_masked_scale_gradient_is_mlx_autodiff_of_the_where(rng):
    x, keep, g = inputs(rng)
    _, got = mx.vjp(lambda a: kernels.masked_scale(a, keep, SCALE), [x], [g])
    _, want = mx.vjp(lambda a: dropout_in_mlx_ops(a, keep, SCALE), [x], [g])
    assert_bits(got[0], want[0])
    dropped = ~np.array(keep)
    assert np.signbit(np.array(got[0])[dropped & (np.array(g) < 0)]).all()  # g * 0, as MLX: -0 under a negative g


def test_masked_scale_after_a_relu_takes_its_gradient_from_the_output(rng):
    x, keep, g = inputs(rng)
    _, got = mx.vjp(lambda a: kernels.masked_scale(a, keep, SCALE, relu=True), [x], [g])
    output = dropout_in_mlx_ops(x, keep, SCALE, relu=True)
    assert_bits(got[0], mx.where(output > 0, g * SCALE, mx.array(0, g.dtype)))
    # and where x is finite and away from 0 that is the derivative: SCALE where kept and x > 0
    xs, gs, ks = np.array(x), np.array(g), np.array(keep)
    plain = np.isfinite(xs) & np.isfinite(gs) & (np.abs(xs) > 1e-3)
    expected = np.where(ks & (xs > 0), gs * np.float32(SCALE), 0).astype(np.float32)
    np.testing.assert_array_equal(np.array(got[0])[plain], expected[plain])


def test_masked_scale_threads_split_elements_not_results(rng, monkeypatch):
    x, keep, _ = inputs(rng, (70001,))
    results = []
    for count in (1, 3):
        monkeypatch.setattr(sys.modules["kernels.masked_scale"], "threads", lambda count=count: count)
        results.append(np.array(kernels.masked_scale(x, keep, SCALE, relu=True)))
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


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_masked_scale_of_other_dtypes_is_mlx_ops(dtype, rng):
    x, keep, g = inputs(rng, (9, 16))
    x, g = x.astype(dtype), g.astype(dtype)
    got = kernels.masked_scale(x, keep, SCALE, relu=True)
    assert got.dtype == dtype
    assert mx.array_equal(got, dropout_in_mlx_ops(x, keep, SCALE, relu=True), equal_nan=True).item()
    assert kernels.scale_where_positive(g, got, SCALE).dtype == dtype


def test_relu_is_mlx_maximum_bit_for_bit_and_its_gradient_reads_the_output(rng):
    x, _, g = inputs(rng)
    assert_bits(kernels.relu(x), mx.maximum(x, 0))  # NaN kept, -0 to +0, as MLX's maximum
    _, got = mx.vjp(kernels.relu, [x], [g])
    output = mx.maximum(x, 0)
    assert_bits(got[0], mx.where(output > 0, g, mx.array(0, g.dtype)))
    xs, gs = np.array(x), np.array(g)
    plain = np.isfinite(xs) & (np.abs(xs) > 1e-3)
    np.testing.assert_array_equal(np.array(got[0])[plain], np.where(xs > 0, gs, 0).astype(np.float32)[plain])


def test_relu_takes_over_a_buffer_nothing_else_holds(rng):
    x = mx.array(rng.standard_normal((2048, 1024)).astype(np.float32))
    mx.eval(x)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(kernels.relu(x * 2))  # x * 2's buffer is nobody else's: the ReLU writes there
    assert mx.get_peak_memory() - base < 1.5 * x.nbytes


@pytest.mark.parametrize("mode", ["dropout", "dropout after a ReLU", "its gradient", "a ReLU", "dropout's gradient"])
@pytest.mark.parametrize("count", [1, 7, 9, 31, 70001])
def test_every_mode_in_its_input_buffer_and_beside_it_is_the_where_bit_for_bit(mode, count, rng):
    # The loops are vector selects (8 floats or 4, then a tail): lengths that end inside a vector, and
    # the output written into the input's own buffer (a * 1 is nobody else's) as well as into a new one;
    # the inputs are views 16 elements into their buffers, with the specials first.
    x, keep, g = (mx.concatenate([a[:16], a])[16:] for a in inputs(rng, (count + 16,)))
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
