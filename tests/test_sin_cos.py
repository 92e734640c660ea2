"""`kernels.sin_cos` against `mx.stack([mx.sin(x), mx.cos(x)], -1)`: bit for bit, forward and
gradient, at the argument reduction's edges (multiples of pi / 4), past 2^23 (where MLX takes libm's),
for non-finite and signed-zero arguments; threads; lazy and compiled; other dtypes; and the position
encoding on it against the MLX-ops formula it replaced."""

import math
import sys

import kernels
from deformable_detr.models.position_encoding import PositionEmbeddingSine, sine_embedding
from kernels import native

import mlx.core as mx
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(native.missing() is not None, reason=f"{native.missing()}")


def mlx_sin_cos(x):
    return mx.stack([mx.sin(x), mx.cos(x)], axis=-1)


def assert_bits(got, want):
    got, want = np.array(got), np.array(want)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def arguments(rng) -> np.ndarray:
    """Arguments on either side of every multiple of pi / 4 up to 200 (where the reduction's integer
    part changes), up to and past 2^23, and non-finite, signed-zero and subnormal ones."""
    quarters = (np.arange(-255, 256) * np.pi / 4).astype(np.float32)
    near = np.concatenate([np.nextafter(quarters, -np.inf), quarters, np.nextafter(quarters, np.inf)])
    big = np.float32(2**23)
    edges = [
        0.0,
        -0.0,
        1e-45,
        -1e-45,
        1e-38,
        np.inf,
        -np.inf,
        np.nan,
        -np.nan,
        big,
        np.nextafter(big, 0),
        np.nextafter(big, np.inf),
        -big,
        3.4e38,
        -3.4e38,
    ]
    spread = [rng.uniform(-8, 8, 3000), rng.uniform(-1e4, 1e4, 2000), rng.uniform(-2e7, 2e7, 2000)]
    return np.concatenate([near, np.array(edges, np.float32), *spread]).astype(np.float32)


def test_sin_cos_is_mlx_sin_and_cos_bit_for_bit(rng):
    x = mx.array(arguments(rng))
    got, want = kernels.sin_cos(x), mlx_sin_cos(x)
    assert got.shape == (x.size, 2)
    assert_bits(got, want)  # NaNs included: the same NaN bits
    not_finite = ~np.isfinite(np.array(x))
    assert not_finite.sum() == 4 and np.isnan(np.array(got)[not_finite]).all()


@pytest.mark.parametrize("shape", [(), (0,), (3, 5), (2, 7, 33, 64)])
def test_sin_cos_of_any_shape(shape, rng):
    x = mx.array(rng.uniform(-10, 10, shape).astype(np.float32))
    got = kernels.sin_cos(x)
    assert got.shape == (*shape, 2)
    assert_bits(got, mlx_sin_cos(x))


def test_sin_cos_threads_split_elements_not_results(rng, monkeypatch):
    x = mx.array(rng.uniform(-100, 100, (70001,)).astype(np.float32))
    results = []
    for count in (1, 3):
        monkeypatch.setattr(sys.modules["kernels.sin_cos"], "threads", lambda count=count: count)
        results.append(np.array(kernels.sin_cos(x)))
    assert_bits(results[0], results[1])
    assert_bits(results[0], mlx_sin_cos(x))


def test_sin_cos_gradient_is_mlx_sin_and_cos_gradient(rng):
    x = mx.array(rng.uniform(-10, 10, (40, 64)).astype(np.float32))
    cotangent = mx.array(rng.standard_normal((40, 64, 2)).astype(np.float32))
    _, got = mx.vjp(kernels.sin_cos, [x], [cotangent])
    _, want = mx.vjp(mlx_sin_cos, [x], [cotangent])
    assert_bits(got[0], want[0])
    # and it is the derivative: a central difference in float64 of <cotangent, [sin, cos]>
    x64, g64 = np.array(x, np.float64), np.array(cotangent, np.float64)
    h = 1e-6
    numeric = (
        g64[..., 0] * (np.sin(x64 + h) - np.sin(x64 - h)) + g64[..., 1] * (np.cos(x64 + h) - np.cos(x64 - h))
    ) / (2 * h)
    np.testing.assert_allclose(np.array(got[0]), numeric, rtol=1e-4, atol=1e-5)


def test_sin_cos_is_lazy_and_compiles(rng):
    x = mx.array(rng.uniform(-4, 4, (64, 16)).astype(np.float32))

    def loss(a):  # an evaluation inside mx.compile would raise
        return (kernels.sin_cos(a) * a[..., None]).sum()

    got = mx.compile(mx.value_and_grad(loss))(x)
    want = mx.value_and_grad(lambda a: (mlx_sin_cos(a) * a[..., None]).sum())(x)
    assert_bits(got[0], want[0])
    np.testing.assert_allclose(np.array(got[1]), np.array(want[1]), rtol=1e-6, atol=1e-6)  # compile fuses its own way


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_sin_cos_of_other_dtypes_is_mlx_ops(dtype, rng):
    x = mx.array(rng.uniform(-4, 4, (9, 16)).astype(np.float32)).astype(dtype)
    got = kernels.sin_cos(x)
    assert got.dtype == dtype
    assert mx.array_equal(got, mlx_sin_cos(x)).item()


def test_sin_cos_in_export_mode_is_mlx_ops_that_export(rng, tmp_path):
    x = mx.array(rng.uniform(-4, 4, (9, 16)).astype(np.float32))
    with kernels.export_mode():
        mx.export_function(str(tmp_path / "sin_cos.mlxfn"), kernels.sin_cos, x)  # a C++ primitive would be refused
    (got,) = mx.import_function(str(tmp_path / "sin_cos.mlxfn"))(x)
    assert_bits(got, mlx_sin_cos(x))


def sine_embedding_in_mlx_ops(positions, num_feats, temperature):
    """The formula position_encoding used before kernels.sin_cos: every angle p / t_i, sin of the even
    ones, cos of the odd ones."""
    dim_t = mx.arange(num_feats, dtype=mx.float32)
    dim_t = temperature ** (2 * (dim_t // 2) / num_feats)
    angles = positions[..., None] / dim_t
    interleaved = mx.stack([mx.sin(angles[..., 0::2]), mx.cos(angles[..., 1::2])], axis=-1)
    return interleaved.reshape(*positions.shape, num_feats)


def test_position_encoding_is_the_mlx_ops_formula_bit_for_bit(rng):
    padded = np.zeros((2, 50, 67), bool)
    padded[1, 40:, :] = True
    padded[1, :, 60:] = True
    masks = [mx.zeros((1, 25, 34), dtype=mx.bool_), mx.array(padded)]
    encoding = PositionEmbeddingSine(128)
    for mask in masks:
        not_mask = (~mask).astype(mx.float32)
        y = mx.cumsum(not_mask, axis=1)
        x = mx.cumsum(not_mask, axis=2)
        y = (y - 0.5) / (y[:, -1:, :] + 1e-6) * (2 * math.pi)
        x = (x - 0.5) / (x[:, :, -1:] + 1e-6) * (2 * math.pi)
        want = mx.concatenate([sine_embedding_in_mlx_ops(y, 128, 10000), sine_embedding_in_mlx_ops(x, 128, 10000)], -1)
        assert_bits(encoding(mask), want)
    proposals = mx.array(rng.uniform(0, 2 * math.pi, (2, 300, 4)).astype(np.float32))  # two-stage's query positions
    assert_bits(sine_embedding(proposals, 128, 10000), sine_embedding_in_mlx_ops(proposals, 128, 10000))
