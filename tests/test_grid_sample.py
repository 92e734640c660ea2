import itertools

import kernels

import mlx.core as mx
import numpy as np
import pytest
from conftest import DTYPES, TOLERANCE, directional_check, to_mx, to_np

torch_reference = pytest.importorskip("torch_reference", reason="PyTorch (the dev extra) is the reference")

MODES = ["bilinear", "nearest", "bicubic"]
PADDINGS = ["zeros", "border", "reflection"]
ALL = list(itertools.product(MODES, PADDINGS, [False, True]))


def edge_grid(height, width, align_corners):
    """Grid points exactly on pixels, on the image edges, on the border-clip limits and outside.
    Sizes are chosen so that the unnormalised coordinates are exact in float32."""

    def normalise(p, size):
        return p / ((size - 1) / 2) - 1 if align_corners else (p + 0.5) / (size / 2) - 1

    xs = [-1.5, -1.0, -0.5, 0.0, 0.25, 1.0, width - 2.0, width - 1.5, width - 1.0, width - 0.5, width + 0.25]
    ys = [-1.0, -0.5, 0.0, 1.0, 1.5, height - 1.0, height - 0.5, height + 1.0]
    gx, gy = np.meshgrid([normalise(x, width) for x in xs], [normalise(y, height) for y in ys])
    return np.stack([gx, gy], -1)[None].repeat(2, 0)


def compare(inp, grid, mode, padding, align_corners, dtype_name, rng):
    mx_dtype, np_dtype = DTYPES[dtype_name]
    inp, grid = inp.astype(np_dtype), grid.astype(np_dtype)
    cotangent = rng.standard_normal((*grid.shape[:3], inp.shape[-1])).astype(np_dtype)
    expected = torch_reference.grid_sample(inp, grid, cotangent, mode, padding, align_corners)

    def loss(i, g):
        return (kernels.grid_sample(i, g, mode, padding, align_corners) * to_mx(cotangent, mx_dtype)).sum()

    args = to_mx(inp, mx_dtype), to_mx(grid, mx_dtype)
    out = kernels.grid_sample(*args, mode, padding, align_corners)
    assert out.dtype == mx_dtype
    grads = mx.grad(loss, argnums=(0, 1))(*args)
    for name, got, want in zip(["output", "grad_input", "grad_grid"], [out, *grads], expected, strict=True):
        np.testing.assert_allclose(to_np(got), want, **TOLERANCE[dtype_name], err_msg=name)


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("mode,padding,align_corners", ALL)
def test_matches_torch_random_points(mode, padding, align_corners, dtype_name, rng):
    inp = rng.standard_normal((2, 5, 7, 3))
    grid = rng.uniform(-1.3, 1.3, (2, 4, 6, 2))
    compare(inp, grid, mode, padding, align_corners, dtype_name, rng)


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("mode,padding,align_corners", ALL)
def test_matches_torch_on_pixels_and_edges(mode, padding, align_corners, dtype_name, rng):
    height, width = (5, 9) if align_corners else (4, 8)
    inp = rng.standard_normal((2, height, width, 5))
    compare(inp, edge_grid(height, width, align_corners), mode, padding, align_corners, dtype_name, rng)


@pytest.mark.float64
@pytest.mark.parametrize("mode,padding,align_corners", ALL)
def test_one_pixel_input(mode, padding, align_corners, rng):
    compare(
        rng.standard_normal((1, 1, 1, 2)),
        rng.uniform(-1.5, 1.5, (1, 3, 3, 2)),
        mode,
        padding,
        align_corners,
        "float64",
        rng,
    )


@pytest.mark.float64
@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("padding", PADDINGS)
def test_gradients_match_finite_differences(mode, padding, rng):
    inp = to_mx(rng.standard_normal((2, 6, 5, 3)))
    grid = to_mx(rng.uniform(-1.2, 1.2, (2, 3, 4, 2)))
    weights = to_mx(rng.standard_normal((2, 3, 4, 3)))

    def loss(i, g):
        return (kernels.grid_sample(i, g, mode, padding, False) * weights).sum()

    directional_check(loss, (inp, grid), 0, rng)
    directional_check(loss, (inp, grid), 1, rng)


@pytest.mark.float64
def test_grid_gradient_at_integer_coordinates_is_the_slope():
    """On a linear ramp every interior pixel has the same slope, so sampling exactly on pixels
    must give exactly that slope, not the zero a `ceil`-based sampler gives there."""
    height, width = 4, 8
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float64)
    inp = to_mx((3 * xs + 2 * ys)[None, :, :, None])
    grid = edge_grid(height, width, False)[:1, 2:5, 3:6]  # pixels (0..1, 0..1) and in between
    grad = mx.grad(lambda g: kernels.grid_sample(inp, g).sum())(to_mx(grid))
    np.testing.assert_allclose(np.array(grad[..., 0]), 3 * width / 2)
    np.testing.assert_allclose(np.array(grad[..., 1]), 2 * height / 2)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_is_computed_in_float32(dtype, rng):
    inp = to_mx(rng.standard_normal((1, 5, 6, 4)), dtype)
    grid = to_mx(rng.uniform(-1, 1, (1, 3, 3, 2)), dtype)
    out = kernels.grid_sample(inp, grid, "bicubic")
    assert out.dtype == dtype
    reference = kernels.grid_sample(inp.astype(mx.float32), grid.astype(mx.float32), "bicubic")
    np.testing.assert_array_equal(
        np.array(out.astype(mx.float32)), np.array(reference.astype(dtype).astype(mx.float32))
    )
    grad = mx.grad(lambda g: kernels.grid_sample(inp, g).astype(mx.float32).sum())(grid)
    assert grad.dtype == dtype


@pytest.mark.parametrize(
    "inp_shape,grid_shape,kwargs,message",
    [
        ((5, 6, 3), (1, 2, 2, 2), {}, r"input has shape \(5, 6, 3\); expected 4 dimensions \(N, H, W, C\)"),
        (
            (1, 5, 6, 3),
            (1, 2, 2, 3),
            {},
            r"grid has shape \(1, 2, 2, 3\); expected \(N, Ho, Wo, 2\) = \(1, Ho, Wo, 2\)",
        ),
        (
            (2, 5, 6, 3),
            (1, 2, 2, 2),
            {},
            r"grid has shape \(1, 2, 2, 2\); expected \(N, Ho, Wo, 2\) = \(2, Ho, Wo, 2\)",
        ),
        ((1, 5, 6, 3), (1, 2, 2, 2), {"mode": "area"}, r"unknown mode 'area'"),
        ((1, 5, 6, 3), (1, 2, 2, 2), {"padding_mode": "wrap"}, r"unknown padding_mode 'wrap'"),
    ],
)
def test_bad_input_is_named(inp_shape, grid_shape, kwargs, message):
    with pytest.raises(ValueError, match=message):
        kernels.grid_sample(mx.zeros(inp_shape), mx.zeros(grid_shape), **kwargs)


def test_integer_input_is_refused():
    with pytest.raises(ValueError, match=r"grid_sample: input has dtype .*int32; expected a floating-point dtype"):
        kernels.grid_sample(mx.zeros((1, 2, 2, 1), dtype=mx.int32), mx.zeros((1, 1, 1, 2)))
