"""The C++ CPU kernel of `ms_deform_attn` (backend "cpu", built by the install), against the MLX-ops
path: forward and every gradient, every layout and flag, on the edge points of the kernels tests;
threads; dispatch."""

import itertools
import os
import subprocess
import sys

import kernels
from kernels import backends, cpu

import mlx.core as mx
import numpy as np
import pytest
from edge_cases import assert_same, ms_deform_attn_both_ways, ms_inputs, pixel_coordinates, shapes_for

pytestmark = pytest.mark.skipif(cpu.CPU.missing() is not None, reason=f"{cpu.CPU.missing()}")
F32 = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "value_layout,locations_layout", list(itertools.product(["BLNC", "BNLC"], ["BQHLP2", "B2QHLP"]))
)
@pytest.mark.parametrize("padding,align_corners", list(itertools.product(["zeros", "border"], [False, True])))
def test_cpu_kernel_matches_mlx_path(padding, align_corners, value_layout, locations_layout, rng):
    shapes = shapes_for(align_corners)
    # with NaN and infinite locations; 3 levels x 4 points: one vector of 16 (AVX-512) or 8 and a padded one
    value, locations, weights = ms_inputs(rng, shapes, align_corners, points=4)
    if value_layout == "BNLC":
        value = value.transpose(0, 2, 1, 3)
    if locations_layout == "B2QHLP":
        locations = locations.transpose(0, 5, 1, 2, 3, 4)
    flags = dict(padding_mode=padding, align_corners=align_corners, value_layout=value_layout)
    got, want = ms_deform_attn_both_ways(
        shapes, (value, locations, weights), "cpu", sampling_locations_layout=locations_layout, **flags
    )
    assert_same(got, want, F32)
    assert np.abs(np.array(got[2])).max() > 0


@pytest.mark.parametrize("channels", [1, 32, 71])
def test_cpu_kernel_channel_counts(channels, rng):
    """32 takes the compiled-in channel count, the others the general loop."""
    shapes = ((7, 4), (1, 1))
    args = ms_inputs(rng, shapes, False, batch=2, queries=13, heads=2, channels=channels, points=3)
    assert_same(*ms_deform_attn_both_ways(shapes, args, "cpu"), F32)


def test_cpu_kernel_vector_rows_compute_as_the_general_loop(rng):
    """At 32 channels the kernel holds a row in vector registers and reduces four taps' dot products
    together; the general loop, run here on the same problem with 8 zero channels more, must give the
    same output and gradients bit for bit (its extra lanes add zeros), on edge and non-finite points."""
    shapes = shapes_for(False)
    heads, channels, extra = 3, 32, 8
    value, locations, weights = ms_inputs(rng, shapes, False, batch=2, queries=29, heads=heads, channels=channels)
    cotangent = mx.array(rng.standard_normal((2, 29, heads, channels)).astype(np.float32))

    def results(pad):
        padded_value = mx.pad(value, [(0, 0), (0, 0), (0, 0), (0, pad)])
        padded_cotangent = mx.pad(cotangent, [(0, 0), (0, 0), (0, 0), (0, pad)]).reshape(2, 29, -1)

        def attend(v, locs, w):
            return kernels.ms_deform_attn(v, shapes, None, locs, w, backend="cpu")

        (out,), grads = mx.vjp(attend, [padded_value, locations, weights], [padded_cotangent])
        out = out.reshape(2, 29, heads, channels + pad)[..., :channels]
        return [np.array(a) for a in (out, grads[0][..., :channels], grads[1], grads[2])]

    vector_rows, general_loop = results(0), results(extra)
    for name, got, want in zip(["output", "value", "locations", "weights"], vector_rows, general_loop, strict=True):
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert np.abs(vector_rows[2]).max() > 0


@pytest.mark.parametrize("padding,align_corners", list(itertools.product(["zeros", "border"], [False, True])))
def test_cpu_kernel_locates_a_vector_of_points_as_one_by_one(padding, align_corners, rng):
    """A sample's points are located a vector at a time (16 or 8 lanes), the last vector padded: the
    same points, taken as 3 levels x 4 points (lanes of several levels) and as 3 levels x 1 point (one
    padded vector of three), give the same location and weight gradients bit for bit
    (each depends on its own point's taps only), and, with one point weighted, the same output; on
    pixel centres, edges, clip limits, outside, -0, NaN and infinite points."""
    shapes = shapes_for(align_corners)
    heads, channels, points, groups = 1, 32, 4, 12
    f32 = np.float32
    pixels = np.array([-1.5, -1.0, -0.5, 0.0, 1.0, 1.5, 2.0, 3.0, 7.0, 7.5, 8.0, 9.25])
    candidates = rng.uniform(-0.2, 1.2, (len(shapes), groups * points, 2))
    for level, (h, w) in enumerate(shapes):
        candidates[level, : len(pixels), 0] = pixel_coordinates(w, align_corners, np.clip(pixels, -2, w + 1))
        candidates[level, : len(pixels), 1] = pixel_coordinates(h, align_corners, np.clip(pixels[::-1], -2, h + 1))
    candidates[:, 12:20] = [[0.0, np.nan], [np.nan, 0.5], [np.inf, 0.5], [0.5, -np.inf], [-0.0, -0.0], [-0.0, 0.5],
                            [1.0, 1.0], [-np.inf, np.inf]]  # fmt: skip
    candidates = candidates.astype(f32)  # (levels, groups * points, 2)
    value = mx.array(rng.standard_normal((1, sum(h * w for h, w in shapes), heads, channels)).astype(f32))
    g = rng.standard_normal(channels).astype(f32)  # every query's output cotangent

    def results(weights, at_once):
        queries, per_query = (groups, points) if at_once else (groups * points, 1)
        locations = candidates.reshape(len(shapes), queries, per_query, 2).transpose(1, 0, 2, 3)[None, :, None]
        w = weights.reshape(len(shapes), queries, per_query).transpose(1, 0, 2)[None, :, None]
        cotangent = mx.array(np.broadcast_to(g, (1, queries, heads * channels)).copy())

        def attend(locs, w):
            flags = dict(padding_mode=padding, align_corners=align_corners, backend="cpu")
            return kernels.ms_deform_attn(value, shapes, None, locs, w, **flags)

        (out,), grads = mx.vjp(attend, [mx.array(locations), mx.array(w)], [cotangent])
        to_points = lambda a: np.array(a).reshape(queries, len(shapes), per_query, -1).transpose(1, 0, 2, 3)  # noqa: E731
        return np.array(out).reshape(queries, channels), to_points(grads[0]), to_points(grads[1])

    weights = rng.uniform(0, 1, (len(shapes), groups * points)).astype(f32)
    at_once, one_by_one = results(weights, True), results(weights, False)
    for name, got, want in zip(["locations", "weights"], at_once[1:], one_by_one[1:], strict=True):
        np.testing.assert_array_equal(got.reshape(want.shape), want, err_msg=name)
    assert np.abs(at_once[1]).max() > 0
    # One point weighted per query of 3 x 4 points (at each level in turn), the same point in the
    # one-point problem: the outputs are that point's taps alone.
    for level in range(len(shapes)):
        for point in range(points):
            one = np.zeros_like(weights)
            one[level, point::points] = weights[level, point::points]
            out = results(one, True)[0]
            alone = results(one, False)[0][point::points]
            np.testing.assert_array_equal(out, alone, err_msg=f"output, level {level} point {point}")


def test_cpu_kernel_rounds_locations_as_pytorch_on_pixel_centres(rng):
    """The encoder's first locations: pixel centres (i + 0.5) / W plus whole-pixel offsets k / W, in
    float32. PyTorch and the MLX path round u * W, then - 0.5, and such a point lands on a pixel; a
    fused multiply-add rounds once, can miss it by an ulp and take the other one-sided gradient."""
    shapes = ((10, 19), (11, 20))
    heads, points, queries = 2, 3, 60
    f32 = np.float32
    locations = np.empty((1, queries, heads, len(shapes), points, 2), f32)
    for level, (h, w) in enumerate(shapes):
        for axis, size in ((0, w), (1, h)):
            cells = rng.integers(0, size, (queries, heads, points)).astype(f32)
            steps = rng.integers(-3, 4, (queries, heads, points)).astype(f32)
            locations[0, :, :, level, :, axis] = (cells + f32(0.5)) / f32(size) + steps / f32(size)
    u, sizes = locations[0, ..., 0], np.array([w for _, w in shapes], f32)[None, None, :, None]
    rounded_twice = np.floor((u * sizes).astype(f32) - f32(0.5))
    rounded_once = np.floor((u.astype(np.float64) * sizes - 0.5).astype(f32))
    assert (rounded_twice != rounded_once).sum() > 10  # the points where the two differ are there
    value = rng.standard_normal((1, sum(h * w for h, w in shapes), heads, 32)).astype(f32)
    weights = rng.uniform(0, 1, (1, queries, heads, len(shapes), points)).astype(f32)
    args = [mx.array(a) for a in (value, locations, weights)]
    assert_same(*ms_deform_attn_both_ways(shapes, args, "cpu"), dict(rtol=1e-4, atol=1e-4))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_cpu_kernel_half_precision(dtype, rng):
    shapes = shapes_for(False)
    args = ms_inputs(rng, shapes, False, dtype=dtype)
    tolerance = dict(rtol=2e-3, atol=2e-3) if dtype == mx.float16 else dict(rtol=1.6e-2, atol=1.6e-2)
    assert_same(*ms_deform_attn_both_ways(shapes, args, "cpu"), tolerance)


@pytest.mark.parametrize("channels", [5, 32])
def test_cpu_kernel_threads_split_work_not_results(channels, rng, monkeypatch):
    """One thread or three: the same output and gradients bit for bit. The forward's samples are
    independent: with 3 threads its 6 (batch, head) pairs are cut into 12 runs of 14 and 15 queries
    (an odd run's last query summed alone); in the backward each pair is one thread's, its queries in
    order. Whichever thread takes a run (parallel.h's shared counter), the bits are the same."""
    shapes = shapes_for(False)
    args = ms_inputs(rng, shapes, False, batch=2, queries=29, channels=channels)
    results = []
    for count in (1, 3):
        monkeypatch.setattr(cpu, "threads", lambda count=count: count)
        cpu.ms_deform_attn_core.cache_clear()  # the thread count is fixed when a core is made
        results.append(ms_deform_attn_both_ways(shapes, args, "cpu")[0])
    cpu.ms_deform_attn_core.cache_clear()
    for one, three in zip(*results, strict=True):
        np.testing.assert_array_equal(np.array(one), np.array(three))


BUILD_RESULTS = """
import sys
import numpy as np
import kernels, mlx.core as mx
data = np.load(sys.argv[1])
shapes = ((9, 7), (4, 3), (2, 5))
args = [mx.array(data[name]) for name in ("value", "locations", "weights")]
(out,), grads = mx.vjp(lambda v, l, w: kernels.ms_deform_attn(v, shapes, None, l, w, backend="cpu"), args,
                       [mx.array(data["cotangent"])])
np.savez(sys.argv[2], *[np.array(a) for a in (out, *grads)])
print(kernels.native.module().attention_isa())  # the build that ran
"""


@pytest.mark.parametrize("channels", [32, 71])
def test_cpu_kernel_builds_give_the_same_bits(channels, rng, tmp_path):
    """The kernel is built for AVX-512, AVX2 and the baseline and runs the widest this CPU has
    (KERNELS_ATTENTION_ISA=2|1|0 caps it, given to the extension as it loads): each build this CPU can run gives
    the same output and gradients bit for bit, with edge, NaN and infinite points, 3 levels x 4 points."""
    shapes = ((9, 7), (4, 3), (2, 5))
    value, locations, weights = (np.array(a) for a in ms_inputs(rng, shapes, False, channels=channels, points=4))
    cotangent = rng.standard_normal((value.shape[0], locations.shape[1], value.shape[2] * channels)).astype(np.float32)
    np.savez(tmp_path / "inputs.npz", value=value, locations=locations, weights=weights, cotangent=cotangent)
    results, ran = {}, {}
    for isa in ("2", "1", "0"):
        env = {**os.environ, "KERNELS_ATTENTION_ISA": isa}
        out = tmp_path / f"isa{isa}.npz"
        command = [sys.executable, "-c", BUILD_RESULTS, str(tmp_path / "inputs.npz"), str(out)]
        ran[isa] = int(subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout)
        with np.load(out) as saved:
            results[isa] = [saved[f"arr_{i}"] for i in range(4)]
    assert np.abs(results["0"][2]).max() > 0
    assert ran == {"2": ran["2"], "1": min(1, ran["2"]), "0": 0}, ran  # the cap reached the C++
    for isa in ("2", "1"):
        names = ("output", "value", "locations", "weights")
        for name, got, want in zip(names, results[isa], results["0"], strict=True):
            np.testing.assert_array_equal(got, want, err_msg=f"KERNELS_ATTENTION_ISA={isa}: {name}")


def test_default_backend_on_the_cpu_device_is_the_cpu_kernel_except_float64():
    if {"metal", "cuda"} & set(kernels.available_backends()):
        pytest.skip(f"describes a machine without a GPU back-end; this one has {kernels.available_backends()}")
    assert backends.select("ms_deform_attn", None, mx.float32, cpu_kernel=True).name == "cpu"
    assert backends.select("ms_deform_attn", None, mx.float64, cpu_kernel=True) is None
    with pytest.raises(ValueError, match="backend 'cpu' has no float64"):
        backends.select("ms_deform_attn", "cpu", mx.float64, cpu_kernel=True)
    with pytest.raises(ValueError, match="grid_sample: backend 'cpu' has no grid_sample; backend='mlx' has it"):
        kernels.grid_sample(mx.zeros((1, 4, 4, 1)), mx.zeros((1, 2, 2, 2)), backend="cpu")
