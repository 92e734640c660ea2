import itertools

import kernels

import mlx.core as mx
import numpy as np
import pytest
from conftest import DTYPES, TOLERANCE, directional_check, to_mx, to_np

torch_reference = pytest.importorskip("torch_reference", reason="PyTorch (the dev extra) is the reference")

SETTINGS = list(itertools.product(["zeros", "border"], [False, True]))


def make_inputs(rng, shapes, batch=2, queries=7, heads=3, channels=5, points=3, low=-0.2, high=1.2):
    length = sum(h * w for h, w in shapes)
    value = rng.standard_normal((batch, length, heads, channels))
    locations = rng.uniform(low, high, (batch, queries, heads, len(shapes), points, 2))
    weights = rng.uniform(0, 1, (batch, queries, heads, len(shapes), points))
    return value, locations, weights


def compare(shapes, value, locations, weights, padding, align_corners, dtype_name, rng, output_tolerance=None):
    mx_dtype, np_dtype = DTYPES[dtype_name]
    arrays = [a.astype(np_dtype) for a in (value, locations, weights)]
    cotangent = rng.standard_normal((value.shape[0], locations.shape[1], value.shape[2] * value.shape[3]))
    cotangent = cotangent.astype(np_dtype)
    expected = torch_reference.ms_deform_attn(
        arrays[0], shapes, arrays[1], arrays[2], cotangent, padding, align_corners
    )

    def attend(v, locs, w):
        return kernels.ms_deform_attn(v, shapes, None, locs, w, padding_mode=padding, align_corners=align_corners)

    def loss(*args):
        return (attend(*args) * to_mx(cotangent, mx_dtype)).sum()

    args = [to_mx(a, mx_dtype) for a in arrays]
    got = [attend(*args), *mx.grad(loss, argnums=(0, 1, 2))(*args)]
    names = ["output", "grad_value", "grad_locations", "grad_weights"]
    tolerances = [output_tolerance or TOLERANCE[dtype_name]] + 3 * [TOLERANCE[dtype_name]]
    for name, g, want, tolerance in zip(names, got, expected, tolerances, strict=True):
        np.testing.assert_allclose(to_np(g), want, **tolerance, err_msg=name)


def test_defaults_equal_the_authors_core_to_1e5(rng):
    shapes = ((6, 9), (3, 5), (2, 3), (1, 1))
    value, locations, weights = make_inputs(rng, shapes)
    compare(shapes, value, locations, weights, "zeros", False, "float32", rng, output_tolerance=dict(rtol=0, atol=1e-5))


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("padding,align_corners", SETTINGS)
def test_matches_torch_random_shapes(padding, align_corners, dtype_name, rng):
    shapes = ((6, 9), (3, 5), (1, 1), (2, 3))
    compare(shapes, *make_inputs(rng, shapes), padding, align_corners, dtype_name, rng)


@pytest.mark.float64
@pytest.mark.parametrize("padding,align_corners", SETTINGS)
def test_matches_torch_one_level_and_odd_channels(padding, align_corners, rng):
    shapes = ((7, 4),)
    compare(shapes, *make_inputs(rng, shapes, heads=2, channels=71, points=2), padding, align_corners, "float64", rng)


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("padding,align_corners", SETTINGS)
def test_matches_torch_on_pixels_and_borders(padding, align_corners, dtype_name, rng):
    """Locations exactly on pixel centres, image edges, border-clip limits and outside. Sizes keep
    the pixel coordinates exact in float32 through both routes (u * W - 0.5 and grid_sample's)."""
    shapes = ((5, 9), (3, 3), (1, 1)) if align_corners else ((4, 8), (2, 2), (1, 1))
    pixels = np.array([-1.5, -1.0, -0.5, 0.0, 1.0, 1.5, 2.0, 3.0, 7.0, 7.5, 8.0, 9.25])
    u = []
    for h, w in shapes:
        px = np.clip(pixels, -2, w + 1)
        ux = px / (w - 1) if (align_corners and w > 1) else (px + 0.5) / w
        py = np.clip(pixels[::-1], -2, h + 1)
        uy = py / (h - 1) if (align_corners and h > 1) else (py + 0.5) / h
        u.append(np.stack([ux, uy], -1))
    # (Q=12, N_l, 2) -> (B=1, Q, N_h=1, N_l, N_p=1, 2)
    locations = np.stack(u, 1)[None, :, None, :, None, :]
    value, _, weights = make_inputs(rng, shapes, batch=1, queries=12, heads=1, channels=4, points=1)
    compare(shapes, value, locations, weights, padding, align_corners, dtype_name, rng)


@pytest.mark.float64
@pytest.mark.parametrize("padding,align_corners", SETTINGS)
def test_gradients_match_finite_differences(padding, align_corners, rng):
    shapes = ((5, 6), (3, 2), (1, 1))
    value, locations, weights = (to_mx(a) for a in make_inputs(rng, shapes, channels=3))
    cotangent = to_mx(rng.standard_normal((2, 7, 9)))

    def loss(v, locs, w):
        out = kernels.ms_deform_attn(v, shapes, None, locs, w, padding_mode=padding, align_corners=align_corners)
        return (out * cotangent).sum()

    for argnum in range(3):
        grad = directional_check(loss, (value, locations, weights), argnum, rng)
        assert np.abs(np.array(grad)).max() > 0


@pytest.mark.float64
def test_location_gradient_at_integer_pixels_is_the_right_slope(rng):
    """At an integer pixel coordinate the location gradient is the one-sided slope towards the
    next pixel (the forward difference), never zero."""
    shapes = ((4, 8),)
    value = to_mx(rng.standard_normal((1, 32, 1, 2)))
    ix, iy = np.meshgrid(np.arange(1, 6), np.arange(1, 3))  # interior pixels
    locations = np.stack([(ix + 0.5) / 8, (iy + 0.5) / 4], -1).reshape(1, -1, 1, 1, 1, 2)
    weights = to_mx(np.ones((1, locations.shape[1], 1, 1, 1)))

    def loss(locs):
        return kernels.ms_deform_attn(value, shapes, None, locs, weights).sum()

    grad = np.array(mx.grad(loss)(to_mx(locations)))
    assert np.all(np.abs(grad) > 1e-3)
    eps = 1e-7
    for axis in range(2):
        step = np.zeros_like(locations)
        step[..., axis] = eps
        per_point = [
            kernels.ms_deform_attn(value, shapes, None, to_mx(locs), weights).sum(-1)
            for locs in (locations, locations + step)
        ]
        forward_difference = (np.array(per_point[1]) - np.array(per_point[0])) / eps
        np.testing.assert_allclose(grad[..., axis].reshape(-1), forward_difference.reshape(-1), rtol=1e-5)


@pytest.mark.float64
def test_layouts_give_the_same_numbers(rng):
    shapes = ((6, 9), (3, 5))
    value, locations, weights = (to_mx(a) for a in make_inputs(rng, shapes))
    cotangent = to_mx(rng.standard_normal((2, 7, 15)))

    def run(value_layout, locations_layout):
        v = value.transpose(0, 2, 1, 3) if value_layout == "BNLC" else value
        locs = locations.transpose(0, 5, 1, 2, 3, 4) if locations_layout == "B2QHLP" else locations

        def loss(v, locs, w):
            out = kernels.ms_deform_attn(
                v, shapes, None, locs, w, value_layout=value_layout, sampling_locations_layout=locations_layout
            )
            return (out * cotangent).sum(), out

        (_, out), grads = mx.value_and_grad(loss, argnums=(0, 1, 2))(v, locs, weights)
        grad_v = grads[0].transpose(0, 2, 1, 3) if value_layout == "BNLC" else grads[0]
        grad_l = grads[1].transpose(0, 2, 3, 4, 5, 1) if locations_layout == "B2QHLP" else grads[1]
        return [np.array(a) for a in (out, grad_v, grad_l, grads[2])]

    reference = run("BLNC", "BQHLP2")
    for layouts in [("BNLC", "BQHLP2"), ("BLNC", "B2QHLP"), ("BNLC", "B2QHLP")]:
        for got, want in zip(run(*layouts), reference, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.float64
def test_spatial_shapes_and_level_start_index_forms(rng):
    shapes = ((6, 9), (3, 5))
    value, locations, weights = (to_mx(a) for a in make_inputs(rng, shapes))
    reference = kernels.ms_deform_attn(value, shapes, None, locations, weights)
    as_arrays = kernels.ms_deform_attn(value, mx.array(shapes), mx.array([0, 54]), locations, weights)
    np.testing.assert_array_equal(np.array(as_arrays), np.array(reference))


@pytest.mark.float64
def test_nan_locations_sample_zeros(rng):
    shapes = ((6, 9), (3, 5))
    value, locations, weights = make_inputs(rng, shapes)
    locations[0, 0] = np.nan  # every point of query 0 in batch 0
    locations[1, 2, 0, 1, 1, 0] = np.inf
    value, locations, weights = to_mx(value), to_mx(locations), to_mx(weights)
    out = kernels.ms_deform_attn(value, shapes, None, locations, weights)
    assert np.isfinite(np.array(out)).all()
    np.testing.assert_array_equal(np.array(out[0, 0]), 0)
    grads = mx.grad(lambda v, locs, w: kernels.ms_deform_attn(v, shapes, None, locs, w).sum(), argnums=(0, 1, 2))(
        value, locations, weights
    )
    for grad in grads:
        assert np.isfinite(np.array(grad)).all()
    np.testing.assert_array_equal(np.array(grads[1][0, 0]), 0)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_is_computed_in_float32(dtype, rng):
    shapes = ((6, 9), (3, 5))
    value, locations, weights = (to_mx(a, dtype) for a in make_inputs(rng, shapes))
    out = kernels.ms_deform_attn(value, shapes, None, locations, weights)
    assert out.dtype == dtype
    value, locations, weights = (a.astype(mx.float32) for a in (value, locations, weights))
    reference = kernels.ms_deform_attn(value, shapes, None, locations, weights)
    np.testing.assert_array_equal(to_np(out), to_np(reference.astype(dtype)))


SHAPES = ((6, 9), (3, 5))


def bad_call(**changes):
    rng = np.random.default_rng(0)
    value, locations, weights = (to_mx(a, mx.float32) for a in make_inputs(rng, SHAPES))
    args = dict(
        value=value,
        spatial_shapes=SHAPES,
        level_start_index=None,
        sampling_locations=locations,
        attention_weights=weights,
    )
    args.update(changes)
    kernels.ms_deform_attn(**args)


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(value=mx.zeros((2, 69, 15))), r"value has shape \(2, 69, 15\); expected 4 dimensions"),
        (dict(value=mx.zeros((2, 70, 3, 5))), r"value has shape \(2, 70, 3, 5\); expected L = sum\(H \* W\) = 69"),
        (dict(value=mx.zeros((2, 3, 70, 5)), value_layout="BNLC"), r"value has shape \(2, 3, 70, 5\)"),
        (
            dict(value=mx.zeros((2, 69, 4, 5))),
            r"sampling_locations has shape \(2, 7, 3, 2, 3, 2\); expected \(2, 7, 4, 2, 3, 2\)",
        ),
        (
            dict(spatial_shapes=((6, 9), (3, 5), (1, 1)), value=mx.zeros((2, 70, 3, 5))),
            r"sampling_locations has shape \(2, 7, 3, 2, 3, 2\); expected \(2, 7, 3, 3, 3, 2\)",
        ),
        (dict(sampling_locations=mx.zeros((2, 7, 3, 2, 3, 3))), r"sampling_locations has shape \(2, 7, 3, 2, 3, 3\)"),
        (
            dict(sampling_locations=mx.zeros((2, 7, 3, 2, 3))),
            r"sampling_locations has shape \(2, 7, 3, 2, 3\); expected 6",
        ),
        (
            dict(sampling_locations=mx.zeros((2, 3, 7, 3, 2, 3)), sampling_locations_layout="B2QHLP"),
            r"sampling_locations has shape \(2, 3, 7, 3, 2, 3\); expected \(B, 2, Q, N_h, N_l, N_p\)",
        ),
        (
            dict(attention_weights=mx.zeros((2, 7, 3, 2, 4))),
            r"attention_weights has shape \(2, 7, 3, 2, 4\); expected \(B, Q, N_h, N_l, N_p\) = \(2, 7, 3, 2, 3\)",
        ),
        (dict(attention_weights=mx.zeros((2, 7, 3, 6))), r"attention_weights has shape \(2, 7, 3, 6\); expected 5"),
        (dict(level_start_index=[0, 50]), r"level_start_index is \[0, 50\]; expected \[0, 54\]"),
        (dict(spatial_shapes=[[6.0, 9.0], [3.0, 5.0]]), r"spatial_shapes has shape \(2, 2\) and dtype float64"),
        (dict(spatial_shapes=(6, 9)), r"spatial_shapes has shape \(2,\)"),
        (dict(value_layout="LBNC"), r"unknown value_layout 'LBNC'"),
        (dict(sampling_locations_layout="BQ2"), r"unknown sampling_locations_layout 'BQ2'"),
        (dict(padding_mode="reflection"), r"unknown padding_mode 'reflection'; expected one of 'zeros', 'border'"),
        (dict(backend="tpu"), r"unknown backend 'tpu'"),
        (dict(value=mx.zeros((2, 69, 3, 5), dtype=mx.int32)), r"value has dtype .*int32; expected a floating-point"),
        (dict(attention_weights=mx.zeros((2, 7, 3, 2, 3), dtype=mx.int64)), r"attention_weights has dtype .*int64"),
    ],
)
def test_bad_input_is_named(changes, message):
    with pytest.raises(ValueError, match="ms_deform_attn: " + message):
        bad_call(**changes)


@pytest.mark.float64
def test_backend_mlx_is_the_default():
    rng = np.random.default_rng(1)
    value, locations, weights = (to_mx(a) for a in make_inputs(rng, SHAPES))
    default = kernels.ms_deform_attn(value, SHAPES, None, locations, weights)
    forced = kernels.ms_deform_attn(value, SHAPES, None, locations, weights, backend="mlx")
    np.testing.assert_array_equal(np.array(default), np.array(forced))
