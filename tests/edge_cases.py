"""Inputs on the edge cases of the kernels tests (exact pixels, edges, clip limits, outside,
non-finite), and the comparison of a kernel back-end with the MLX-ops path on them."""

import kernels

import mlx.core as mx
import numpy as np


def pixel_coordinates(size, align_corners, pixels):
    return pixels / (size - 1) if (align_corners and size > 1) else (pixels + 0.5) / size


def ms_inputs(
    rng, shapes, align_corners, dtype=mx.float32, batch=2, queries=14, heads=3, channels=5, points=2, non_finite=True
):
    """Random points, and in batch 0 points exactly on pixel centres, edges, border-clip limits and
    outside; with `non_finite`, NaN and infinite locations in batch 1. Sizes keep pixel coordinates
    exact in float32."""
    levels = len(shapes)
    length = sum(h * w for h, w in shapes)
    value = rng.standard_normal((batch, length, heads, channels))
    locations = rng.uniform(-0.2, 1.2, (batch, queries, heads, levels, points, 2))
    weights = rng.uniform(0, 1, (batch, queries, heads, levels, points))
    pixels = np.array([-1.5, -1.0, -0.5, 0.0, 1.0, 1.5, 2.0, 3.0, 7.0, 7.5, 8.0, 9.25])
    for level, (h, w) in enumerate(shapes):
        locations[0, :12, 0, level, 0, 0] = pixel_coordinates(w, align_corners, np.clip(pixels, -2, w + 1))
        locations[0, :12, 0, level, 0, 1] = pixel_coordinates(h, align_corners, np.clip(pixels[::-1], -2, h + 1))
    if non_finite:
        locations[1, 0, 1] = np.nan
        locations[1, 1, 0, 0, 0, 0] = np.inf
        locations[1, 2, -1, -1, 1, 1] = -np.inf
    return [mx.array(a.astype(np.float32)).astype(dtype) for a in (value, locations, weights)]


def shapes_for(align_corners):
    return ((5, 9), (3, 3), (1, 1)) if align_corners else ((4, 8), (2, 2), (1, 1))


def outputs_and_gradients(function, args, rng):
    out = function(*args)
    cotangent = mx.array(rng.standard_normal(out.shape).astype(np.float32)).astype(out.dtype)
    grads = mx.grad(lambda *a: (function(*a) * cotangent).astype(mx.float32).sum(), argnums=tuple(range(len(args))))(
        *args
    )
    return [out, *grads]


def assert_same(got, want, tolerance):
    names = ["output", *(f"gradient {i}" for i in range(len(got) - 1))]
    for name, g, w in zip(names, got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        g, w = (np.array(a.astype(mx.float32)) for a in (g, w))
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, w, **tolerance, err_msg=name)


def ms_deform_attn_both_ways(shapes, args, backend, **flags):
    """[output, grad_value, grad_locations, grad_weights] on `backend`, then on the MLX-ops path."""
    results = []
    for name in (backend, "mlx"):

        def attend(v, locs, w, name=name):
            return kernels.ms_deform_attn(v, shapes, None, locs, w, backend=name, **flags)

        results.append(outputs_and_gradients(attend, args, np.random.default_rng(1)))
    return results
