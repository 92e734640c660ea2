"""`kernels.softmax` against `mx.softmax(x, axis=-1, precise=True)`: bit for bit, forward and
gradient (MLX's VJP in its ops), in float32 and bfloat16, on rows of the model's lengths, arguments at
the exp polynomial's edges and non-finite rows; threads; lazy and compiled; other dtypes."""

import sys

import kernels
from kernels import native

import mlx.core as mx
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(native.missing() is not None, reason=f"{native.missing()}")


FLOATS = [mx.float32, mx.bfloat16]


def assert_bits(got, want):
    got, want = (a if isinstance(a, mx.array) else mx.array(a) for a in (got, want))
    assert got.shape == want.shape and got.dtype == want.dtype
    unsigned = mx.uint16 if got.dtype == mx.bfloat16 else mx.uint32
    np.testing.assert_array_equal(np.array(got.view(unsigned)), np.array(want.view(unsigned)))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(3, 1), (257, 16), (2, 4, 300), (5, 33), (7,)])
@pytest.mark.parametrize("scale", [1e-3, 3.0, 60.0])
def test_softmax_is_mlx_softmax_bit_for_bit(shape, scale, dtype, rng):
    x = mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)
    cotangent = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    want, want_grad = mx.vjp(lambda a: mx.softmax(a, axis=-1, precise=True), [x], [cotangent])
    got, got_grad = mx.vjp(kernels.softmax, [x], [cotangent])
    assert_bits(got[0], want[0])
    assert_bits(got_grad[0], want_grad[0])


@pytest.mark.parametrize("dtype", FLOATS)
def test_softmax_gradient_of_a_cotangent_in_its_input_buffer(dtype, rng):
    # the gradient may be written into the cotangent's buffer (g * 1 is nobody else's): the same numbers
    x = mx.array(rng.standard_normal((301, 16)).astype(np.float32)).astype(dtype)
    cotangent = mx.array(rng.standard_normal((301, 16)).astype(np.float32)).astype(dtype)
    want = mx.vjp(lambda a: mx.softmax(a, axis=-1, precise=True), [x], [cotangent])[1][0]
    assert_bits(mx.vjp(kernels.softmax, [x], [cotangent * 1])[1][0], want)


@pytest.mark.parametrize("dtype", FLOATS)
def test_softmax_at_the_exp_polynomials_edges(dtype, rng):
    # after the row's maximum is taken off, the exponentials' arguments span [-100, 0]: the -88
    # cut-off, and arguments on either side of those whose x / ln 2 is a half-integer, where the
    # polynomial's integer part changes
    halves = (np.arange(-140, 1) + 0.5) * np.float32(np.log(2))
    near = np.concatenate([np.nextafter(halves, -np.inf), halves, np.nextafter(halves, np.inf)]).astype(np.float32)
    edges = np.array([-88.0, np.nextafter(-88.0, 0), np.nextafter(-88.0, -100), -87.5, -89.0, -100.0], np.float32)
    values = np.concatenate([near[near > -100], edges, rng.uniform(-100, 0, 4000).astype(np.float32)])
    rows = np.concatenate([values.reshape(-1, 1), np.zeros((values.size, 1), np.float32)], axis=1)
    x = mx.array(rows).astype(dtype)
    assert_bits(kernels.softmax(x), mx.softmax(x, axis=-1, precise=True))
    assert np.array(kernels.softmax(x).astype(mx.float32))[:, 0].min() == 0  # below -88: exactly zero, as MLX


@pytest.mark.parametrize("dtype", FLOATS)
def test_softmax_of_non_finite_rows_is_mlx_softmax(dtype):
    rows = [[np.nan, 1, 2], [np.inf, 1, 2], [-np.inf, 1, 2], [-np.inf] * 3, [1e30, 0, -1e30], [3.4e38, 3.4e38, 0]]
    x = mx.array(np.array(rows, np.float32)).astype(dtype)
    got, want = (np.array(a.astype(mx.float32)) for a in (kernels.softmax(x), mx.softmax(x, axis=-1, precise=True)))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert_bits(np.nan_to_num(got), np.nan_to_num(want))


@pytest.mark.parametrize("dtype", FLOATS)
def test_softmax_threads_split_rows_not_results(dtype, rng, monkeypatch):
    x = mx.array(rng.standard_normal((4099, 16)).astype(np.float32)).astype(dtype)
    cotangent = mx.array(rng.standard_normal((4099, 16)).astype(np.float32)).astype(dtype)
    results = []
    for count in (1, 3):
        monkeypatch.setattr(sys.modules["kernels.softmax"], "threads", lambda count=count: count)
        results.append(mx.vjp(kernels.softmax, [x], [cotangent]))
    for one, three in zip(*results, strict=True):
        assert_bits(one[0], three[0])
    assert_bits(results[0][0][0], mx.softmax(x, axis=-1, precise=True))


def test_softmax_is_lazy_and_compiles(rng):
    x = mx.array(rng.standard_normal((64, 16)).astype(np.float32))

    def loss(a):  # an evaluation inside mx.compile would raise
        weights = kernels.softmax(a)
        return (weights * weights).sum()

    got = mx.compile(mx.value_and_grad(loss))(x)
    want = mx.value_and_grad(lambda a: (mx.softmax(a, axis=-1, precise=True) ** 2).sum())(x)
    assert_bits(got[0], want[0])
    np.testing.assert_allclose(np.array(got[1]), np.array(want[1]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [mx.float16])
def test_softmax_of_other_dtypes_is_mlx_softmax(dtype, rng):
    x = mx.array(rng.standard_normal((9, 16)).astype(np.float32)).astype(dtype)
    got, want = kernels.softmax(x), mx.softmax(x, axis=-1, precise=True)
    assert got.dtype == dtype
    assert mx.array_equal(got, want).item()
