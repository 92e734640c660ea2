"""Multi-scale deformable attention core with the signature and layouts of the Trainium kernel
library's `ms_deformable_attention`, differentiable w.r.t. value, sampling locations and attention
weights through a hand-written VJP."""

from functools import cache

import mlx.core as mx
import numpy as np

from . import backends, selfcheck
from .checks import check_choice, check_float, check_rank, compute_dtype, fail, level_starts
from .elementwise import astype
from .export import custom_function
from .sampling import bilinear_taps, pad_coordinates

VALUE_LAYOUTS = ("BLNC", "BNLC")
LOCATION_LAYOUTS = ("BQHLP2", "B2QHLP")
PADDING_MODES = ("zeros", "border")
BACKENDS = backends.NAMES

OP = "ms_deform_attn"


def ms_deform_attn(
    value: mx.array,
    spatial_shapes,
    level_start_index,
    sampling_locations: mx.array,
    attention_weights: mx.array,
    *,
    value_layout: str = "BLNC",
    sampling_locations_layout: str = "BQHLP2",
    align_corners: bool = False,
    padding_mode: str = "zeros",
    backend: str | None = None,
) -> mx.array:
    """Deformable attention over N_l feature levels flattened into one sequence of length L.

    value: (B, L, N_h, C_h) for "BLNC" or (B, N_h, L, C_h) for "BNLC".
    spatial_shapes: (H, W) of each level, a tuple of int pairs or an int array (N_l, 2).
    level_start_index: offset of each level in L, or None to derive it from spatial_shapes.
    sampling_locations: (B, Q, N_h, N_l, N_p, 2) for "BQHLP2" or (B, 2, Q, N_h, N_l, N_p) for
        "B2QHLP"; normalised to [0, 1], x first. align_corners=False maps u to u * W - 0.5,
        True to u * (W - 1).
    attention_weights: (B, Q, N_h, N_l, N_p).
    backend: None picks a fused GPU kernel ("metal", "cuda") or the C++ CPU kernel ("cpu") where one
        can run, else "mlx", the MLX-ops path; naming one forces it (an error if it cannot run here).
    Returns (B, Q, N_h * C_h) in the inputs' dtype (float16 / bfloat16 computed in float32).
    """
    check_choice(OP, "backend", backend, (None, *BACKENDS))
    check_choice(OP, "value_layout", value_layout, VALUE_LAYOUTS)
    check_choice(OP, "sampling_locations_layout", sampling_locations_layout, LOCATION_LAYOUTS)
    check_choice(OP, "padding_mode", padding_mode, PADDING_MODES)
    check_float(OP, value=value, sampling_locations=sampling_locations, attention_weights=attention_weights)
    shapes = _spatial_shapes(spatial_shapes)
    _check_level_start_index(level_start_index, shapes)
    canonical_value, locations = _canonical(value, sampling_locations, value_layout, sampling_locations_layout)
    _check_shapes(canonical_value, shapes, locations, attention_weights, value_layout, sampling_locations_layout)

    result_dtype = mx.result_type(value, sampling_locations, attention_weights)
    backend = backend or backends.from_environment()
    kernel = backends.select(OP, backend, result_dtype, cpu_kernel=True)
    flags = (bool(align_corners), padding_mode, value_layout, sampling_locations_layout)
    if (
        kernel is not None
        and backend is None
        and kernel.name in backends.FUSED
        and not _trusted(kernel, result_dtype, *flags)
    ):
        kernel = None  # it failed its self-check: the MLX-ops path
    if kernel is not None:  # the kernels read both layouts as they are
        attend = kernel.ms_deform_attn_core(
            shapes, bool(align_corners), padding_mode, value_layout, sampling_locations_layout
        )
        return attend(*(astype(a, result_dtype) for a in (value, sampling_locations, attention_weights)))

    value = canonical_value
    dtype = compute_dtype(value, locations, attention_weights)
    attend = _mlx_core(shapes, bool(align_corners), padding_mode)
    out = attend(value.astype(dtype), locations.astype(dtype), attention_weights.astype(dtype))
    return out.astype(result_dtype)


def _trusted(kernel, dtype, align_corners, padding_mode, value_layout, locations_layout) -> bool:
    """The fused kernel instance against the MLX-ops path on a small problem, once a process."""
    shapes = ((3, 4), (2, 3))
    layouts = dict(value_layout=value_layout, sampling_locations_layout=locations_layout)
    flags = dict(align_corners=align_corners, padding_mode=padding_mode)

    def fused(value, locations, weights):  # built inside the check, where a compiler's error is caught
        return kernel.ms_deform_attn_core(shapes, align_corners, padding_mode, value_layout, locations_layout)(
            value, locations, weights
        )

    def reference(value, locations, weights):
        return ms_deform_attn(value, shapes, None, locations, weights, **layouts, **flags, backend="mlx")

    def problem():
        rng = np.random.default_rng(0)
        b, q, heads, channels, points, length = 1, 5, 2, 3, 2, sum(h * w for h, w in shapes)
        value = rng.standard_normal((b, length, heads, channels))
        locations = rng.uniform(-0.1, 1.1, (b, q, heads, len(shapes), points, 2))
        for level, (_, w) in enumerate(shapes):  # some taps exactly on pixels: a naive sampler's zero gradient
            locations[:, :2, :, level, :, 0] = (np.arange(2)[:, None, None] + (0 if align_corners else 0.5)) / (
                w - 1 if align_corners else w
            )
        weights = rng.uniform(0.1, 1.0, (b, q, heads, len(shapes), points))
        if value_layout == "BNLC":
            value = value.transpose(0, 2, 1, 3)
        if locations_layout == "B2QHLP":
            locations = locations.transpose(0, 5, 1, 2, 3, 4)
        return [mx.array(a.astype(np.float32)) for a in (value, locations, weights)]

    options = {"padding": padding_mode, "align_corners": align_corners, "value": value_layout}
    options["locations"] = locations_layout
    return selfcheck.trusted(kernel, OP, dtype, options, fused, reference, problem)


def _spatial_shapes(spatial_shapes) -> tuple[tuple[int, int], ...]:
    array = np.asarray(spatial_shapes)
    if array.dtype.kind not in "iu" or array.ndim != 2 or array.shape[1] != 2 or array.shape[0] == 0:
        raise ValueError(
            f"{OP}: spatial_shapes has shape {array.shape} and dtype {array.dtype}; "
            "expected integer (H, W) pairs, shape (N_l, 2)"
        )
    if (array <= 0).any():
        raise ValueError(f"{OP}: spatial_shapes {array.tolist()} has a level with no pixels")
    return tuple((int(h), int(w)) for h, w in array)


def _check_level_start_index(level_start_index, shapes):
    if level_start_index is None:
        return
    given = np.asarray(level_start_index).reshape(-1).tolist()
    if given != level_starts(shapes):
        raise ValueError(
            f"{OP}: level_start_index is {given}; expected {level_starts(shapes)} "
            "(the running sum of H * W over spatial_shapes), or None to derive it"
        )


def _canonical(value, locations, value_layout, locations_layout):
    """Bring value to BLNC and locations to BQHLP2 (a no-op for the default layouts)."""
    check_rank(OP, "value", value, 4, f"{value_layout} = ({', '.join(value_layout)})")
    check_rank(OP, "sampling_locations", locations, 6, f"{locations_layout}")
    if value_layout == "BNLC":
        value = value.transpose(0, 2, 1, 3)
    if locations_layout == "B2QHLP":
        if locations.shape[1] != 2:
            fail(OP, "sampling_locations", locations.shape, "(B, 2, Q, N_h, N_l, N_p) for layout B2QHLP")
        locations = locations.transpose(0, 2, 3, 4, 5, 1)
    return value, locations


def _check_shapes(value, shapes, locations, weights, value_layout, locations_layout):
    """Check canonical (BLNC, BQHLP2) shapes; report them in the caller's layouts."""
    b, length, heads, _ = value.shape
    expected_length = sum(h * w for h, w in shapes)
    if length != expected_length:
        fail(
            OP, "value", _in_layout(value.shape, value_layout), f"L = sum(H * W) = {expected_length} in {value_layout}"
        )
    q, points = locations.shape[1], locations.shape[4]
    expected = (b, q, heads, len(shapes), points, 2)
    if locations.shape != expected:
        fail(
            OP,
            "sampling_locations",
            _in_layout(locations.shape, locations_layout),
            f"{_in_layout(expected, locations_layout)} in {locations_layout} "
            "(B and N_h from value, N_l from spatial_shapes)",
        )
    check_rank(OP, "attention_weights", weights, 5, "(B, Q, N_h, N_l, N_p)")
    if weights.shape != expected[:5]:
        fail(OP, "attention_weights", weights.shape, f"(B, Q, N_h, N_l, N_p) = {expected[:5]}")


def _in_layout(shape, layout):
    """A canonical (BLNC or BQHLP2) shape as the caller's layout spells it."""
    shape = tuple(shape)
    if layout == "BNLC":
        return (shape[0], shape[2], shape[1], shape[3])
    if layout == "B2QHLP":
        return (shape[0], shape[5], *shape[1:5])
    return shape


@cache
def _mlx_core(shapes, align_corners: bool, padding_mode: str):
    """The MLX-ops path for one set of level shapes, as a `custom_function` (plain ops in
    `export_mode()`), built once."""
    heights = mx.array([h for h, _ in shapes], dtype=mx.int32).reshape(-1, 1)  # (N_l, 1)
    widths = mx.array([w for _, w in shapes], dtype=mx.int32).reshape(-1, 1)
    starts = mx.array(level_starts(shapes), dtype=mx.int32).reshape(-1, 1)
    offset = 0.0 if align_corners else 0.5
    scale_w, scale_h = (widths - 1, heights - 1) if align_corners else (widths, heights)

    def plan(value, locations):
        """Taps of every sample point (B, Q, N_h, N_l, N_p, 4), as rows of value (B * L * N_h, C_h),
        with weight derivatives w.r.t. the normalised locations."""
        b, length, heads, _ = value.shape
        x = locations[..., 0] * scale_w.astype(locations.dtype) - offset
        y = locations[..., 1] * scale_h.astype(locations.dtype) - offset
        x, grad_x = pad_coordinates(x, widths, padding_mode, align_corners)
        y, grad_y = pad_coordinates(y, heights, padding_mode, align_corners)
        taps = bilinear_taps(x, y, widths, heights)
        batch = mx.arange(b, dtype=mx.int32).reshape(b, 1, 1, 1, 1, 1) * length
        head = mx.arange(heads, dtype=mx.int32).reshape(1, 1, heads, 1, 1, 1)
        rows = (batch + starts[..., None] + taps.index) * heads + head
        return taps._replace(
            index=rows,
            dweight_dx=taps.dweight_dx * (grad_x * scale_w)[..., None],
            dweight_dy=taps.dweight_dy * (grad_y * scale_h)[..., None],
        )

    def gather(value, locations):
        b, length, heads, channels = value.shape
        taps = plan(value, locations)
        q = locations.shape[1]
        values = value.reshape(-1, channels)[taps.index].reshape(b, q, heads, -1, channels)
        return taps, values  # values: (B, Q, N_h, N_l * N_p * 4, C_h)

    @custom_function
    def attend(value, locations, weights):
        b, q, heads = weights.shape[:3]
        taps, values = gather(value, locations)
        coefficients = (weights[..., None] * taps.weight).reshape(b, q, heads, 1, -1)
        return (coefficients @ values).reshape(b, q, -1)

    @attend.vjp
    def attend_vjp(primals, cotangent, output):
        value, locations, weights = primals
        b, q, heads = weights.shape[:3]
        channels = value.shape[-1]
        taps, values = gather(value, locations)
        grad_out = cotangent.reshape(b, q, heads, channels, 1)
        slopes = (values @ grad_out).reshape(taps.weight.shape)  # <dL/d out, tap value>
        grad_weights = (taps.weight * slopes).sum(-1)
        grad_locations = weights[..., None] * mx.stack(
            [(taps.dweight_dx * slopes).sum(-1), (taps.dweight_dy * slopes).sum(-1)], axis=-1
        )
        coefficients = (weights[..., None] * taps.weight).reshape(b, q, heads, -1, 1)
        contributions = coefficients * grad_out.reshape(b, q, heads, 1, channels)
        grad_value = mx.zeros((value.size // channels, channels), dtype=value.dtype)
        grad_value = grad_value.at[taps.index.reshape(-1)].add(contributions.reshape(-1, channels))
        return grad_value.reshape(value.shape), grad_locations, grad_weights

    return attend
