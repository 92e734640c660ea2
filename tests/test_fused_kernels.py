"""The fused Metal and CUDA kernels, run on the CPU through `gpu_emulator` (the full source MLX
assembles, compiled as C++ against a shim of the GPU built-ins), compared with the MLX-ops path:
forward and every gradient, every layout and flag, on the edge points of the kernels tests. Then
the dispatch between back-ends."""

import dataclasses
import itertools

import kernels
from kernels import backends

import mlx.core as mx
import numpy as np
import pytest
from edge_cases import (
    assert_same,
    ms_deform_attn_both_ways,
    ms_inputs,
    outputs_and_gradients,
    pixel_coordinates,
    shapes_for,
)
from gpu_emulator import CUDA, METAL

EMULATED = {"metal": METAL, "cuda": CUDA}
F32 = dict(rtol=1e-5, atol=1e-5)
HALF = {mx.float16: dict(rtol=2e-3, atol=2e-3), mx.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


@pytest.fixture
def on(monkeypatch):
    """`on("metal")`: make the emulated back-end the one `backend=None` picks."""

    def use(*names):
        monkeypatch.setattr(backends, "FUSED", {name: EMULATED[name] for name in names})

    return use


def check_ms_deform_attn(backend, padding, align_corners, value_layout, locations_layout, rng):
    shapes = shapes_for(align_corners)
    value, locations, weights = ms_inputs(rng, shapes, align_corners)
    if value_layout == "BNLC":
        value = value.transpose(0, 2, 1, 3)
    if locations_layout == "B2QHLP":
        locations = locations.transpose(0, 5, 1, 2, 3, 4)
    fused, reference = ms_deform_attn_both_ways(
        shapes,
        (value, locations, weights),
        backend,
        padding_mode=padding,
        align_corners=align_corners,
        value_layout=value_layout,
        sampling_locations_layout=locations_layout,
    )
    assert_same(fused, reference, F32)
    nan_query = np.array(fused[0][1, 0]).reshape(3, -1)[1]  # batch 1, query 0, head 1: NaN locations
    np.testing.assert_array_equal(nan_query, 0)
    assert np.abs(np.array(fused[2])).max() > 0  # the locations get a gradient


MS_FLAGS = list(itertools.product(["zeros", "border"], [False, True]))
MS_LAYOUTS = list(itertools.product(["BLNC", "BNLC"], ["BQHLP2", "B2QHLP"]))


@pytest.mark.parametrize("value_layout,locations_layout", MS_LAYOUTS)
@pytest.mark.parametrize("padding,align_corners", MS_FLAGS)
@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_ms_deform_attn_kernel_matches_mlx_path(
    backend, padding, align_corners, value_layout, locations_layout, on, rng
):
    on(backend)
    check_ms_deform_attn(backend, padding, align_corners, value_layout, locations_layout, rng)


@pytest.mark.parametrize("channels", [1, 32, 71])
@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_ms_deform_attn_kernel_channels_beyond_one_lane_each(backend, channels, on, rng):
    """1 channel (31 idle lanes), exactly one per lane, and 71 (three rounds, the last partial);
    one level."""
    on(backend)
    shapes = ((7, 4),)
    args = ms_inputs(rng, shapes, False, batch=2, queries=13, heads=2, channels=channels, points=3)
    fused, reference = ms_deform_attn_both_ways(shapes, args, backend)
    assert_same(fused, reference, F32)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_ms_deform_attn_kernel_half_precision(backend, dtype, on, rng):
    """float16 / bfloat16 in and out, float32 inside: as the MLX-ops path, to the output dtype's
    rounding."""
    on(backend)
    shapes = shapes_for(False)
    args = ms_inputs(rng, shapes, False, dtype=dtype)
    fused, reference = ms_deform_attn_both_ways(shapes, args, backend)
    assert_same(fused, reference, HALF[dtype])


def grid_inputs(rng, align_corners, dtype=mx.float32):
    """Random points and points exactly on pixels, edges, clip limits, far outside, NaN and inf."""
    height, width = (5, 9) if align_corners else (4, 8)
    image = rng.standard_normal((2, height, width, 6))
    grid = rng.uniform(-1.3, 1.3, (2, 5, 7, 2))
    pixels = np.array([-2.0, -1.0, -0.5, 0.0, 1.0, 1.5, 2.0, 3.0, 7.0, 7.5, 8.0, 9.25, 20.0, -30.5])
    for axis, size in ((0, width), (1, height)):
        u = pixel_coordinates(size, align_corners, np.clip(pixels if axis == 0 else pixels[::-1], -40, size + 40))
        grid[0, :2, :, axis] = (2 * u - 1).reshape(2, 7)
    grid[1, 0, 0] = np.nan
    grid[1, 0, 1, 0] = np.inf
    grid[1, 1, 2, 1] = -np.inf
    return [mx.array(a.astype(np.float32)).astype(dtype) for a in (image, grid)]


def check_grid_sample(backend, padding, align_corners, rng):
    args = grid_inputs(rng, align_corners)
    results = [
        outputs_and_gradients(
            lambda x, g, b=b: kernels.grid_sample(x, g, "bilinear", padding, align_corners, backend=b),
            args,
            np.random.default_rng(1),
        )
        for b in (backend, "mlx")
    ]
    assert_same(*results, F32)
    assert np.abs(np.array(results[0][2])).max() > 0


GRID_FLAGS = list(itertools.product(["zeros", "border", "reflection"], [False, True]))


@pytest.mark.parametrize("padding,align_corners", GRID_FLAGS)
@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_grid_sample_kernel_matches_mlx_path(backend, padding, align_corners, on, rng):
    on(backend)
    check_grid_sample(backend, padding, align_corners, rng)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_grid_sample_kernel_half_precision(backend, dtype, on, rng):
    on(backend)
    args = grid_inputs(rng, False, dtype)
    results = [
        outputs_and_gradients(lambda x, g, b=b: kernels.grid_sample(x, g, backend=b), args, np.random.default_rng(1))
        for b in (backend, "mlx")
    ]
    assert_same(*results, HALF[dtype])


@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_kernels_on_this_gpu_match_mlx_path(backend, rng):
    """The same checks on the real back-end, where this machine has it."""
    why = backends.FUSED[backend].missing()
    if why is not None:
        pytest.skip(f"runs the {backend} kernels on the GPU, and {why}")
    for flags, layouts in itertools.product(MS_FLAGS, MS_LAYOUTS):
        check_ms_deform_attn(backend, *flags, *layouts, rng)
    for flags in GRID_FLAGS:
        check_grid_sample(backend, *flags, rng)


# Dispatch


def test_dispatch_picks_the_mlx_path_without_a_gpu_backend():
    if kernels.available_backends() != ("mlx",):
        pytest.skip(f"describes a machine without a GPU back-end; this one has {kernels.available_backends()}")
    assert backends.select("op", None, mx.float32) is None


@pytest.mark.parametrize(
    "available,picked", [(("metal", "cuda"), "metal"), (("metal",), "metal"), (("cuda",), "cuda"), ((), None)]
)
def test_dispatch_prefers_metal_then_cuda(available, picked, on):
    on(*available)
    chosen = backends.select("op", None, mx.float32)
    assert (chosen.name if chosen else None) == picked


def test_dispatch_default_runs_the_fused_kernel_when_one_can_run(rng, monkeypatch):
    launched = []
    make_kernel = CUDA.make_kernel

    def spy(**spec):
        launched.append(spec["name"])
        return make_kernel(**spec)

    monkeypatch.setattr(backends, "FUSED", {"cuda": dataclasses.replace(CUDA, make_kernel=spy)})
    shapes = shapes_for(False)
    value, locations, weights = ms_inputs(rng, shapes, False)
    out = kernels.ms_deform_attn(value, shapes, None, locations, weights)
    # built twice: for the first use's self-check (its own level shapes), then for the call
    assert launched == ["ms_deform_attn_forward", "ms_deform_attn_backward"] * 2
    reference = kernels.ms_deform_attn(value, shapes, None, locations, weights, backend="mlx")
    np.testing.assert_allclose(np.array(out), np.array(reference), **F32)


def test_dispatch_keeps_float64_and_other_modes_on_the_mlx_path(on):
    on("metal", "cuda")
    assert backends.select("op", None, mx.float64) is None
    assert backends.select("grid_sample", None, mx.float32, "is bilinear only, not 'bicubic'") is None
    with pytest.raises(ValueError, match="backend 'cuda' has no float64"):
        backends.select("op", "cuda", mx.float64)
    with pytest.raises(ValueError, match="backend 'metal' is bilinear only, not 'bicubic'; backend='mlx' has it"):
        kernels.grid_sample(mx.zeros((1, 4, 4, 1)), mx.zeros((1, 2, 2, 2)), "bicubic", backend="metal")


@pytest.mark.parametrize("backend,reason", [("metal", "no Metal back-end"), ("cuda", "no CUDA back-end")])
def test_forcing_a_backend_that_cannot_run_says_which_and_why(backend, reason):
    value, locations, weights = ms_inputs(np.random.default_rng(0), ((2, 2),), False)
    with pytest.raises(
        RuntimeError, match=f"ms_deform_attn: backend '{backend}' cannot run here: this MLX has {reason}"
    ):
        kernels.ms_deform_attn(value, ((2, 2),), None, locations, weights, backend=backend)
    with pytest.raises(RuntimeError, match=f"grid_sample: backend '{backend}' cannot run here"):
        kernels.grid_sample(mx.zeros((1, 4, 4, 1)), mx.zeros((1, 2, 2, 2)), backend=backend)


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="unknown backend 'vulkan'; expected one of None, 'mlx', 'metal', 'cuda'"):
        kernels.grid_sample(mx.zeros((1, 4, 4, 1)), mx.zeros((1, 2, 2, 2)), backend="vulkan")
