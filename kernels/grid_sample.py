"""`grid_sample` with PyTorch's semantics on channels-last arrays, differentiable w.r.t. input and grid.

Forward gathers the taps of `kernels.sampling`; the hand-written VJP scatter-adds the input gradient
and reduces the grid gradient from the same taps. (A gather written with plain MLX ops cannot be
differentiated w.r.t. its indices, so without this VJP the grid would get no gradient at all.)
"""

from functools import cache

import mlx.core as mx
import numpy as np

from . import backends, fused, selfcheck
from .checks import check_choice, check_float, check_rank, compute_dtype, fail
from .export import custom_function
from .sampling import bicubic_taps, bilinear_taps, nearest_taps, pad_coordinates

MODES = ("bilinear", "nearest", "bicubic")
PADDING_MODES = ("zeros", "border", "reflection")


def grid_sample(
    input: mx.array,
    grid: mx.array,
    mode: str = "bilinear",
    padding_mode: str = "zeros",
    align_corners: bool = False,
    backend: str | None = None,
) -> mx.array:
    """Sample `input` (N, H, W, C) at `grid` (N, Ho, Wo, 2), x then y in [-1, 1] -> (N, Ho, Wo, C).

    Same numbers as `torch.nn.functional.grid_sample` on the NCHW-permuted input. float16 and
    bfloat16 are computed in float32 and returned in the input's dtype. `backend` as in
    `ms_deform_attn`; the fused kernels are bilinear only.
    """
    check_choice("grid_sample", "mode", mode, MODES)
    check_choice("grid_sample", "padding_mode", padding_mode, PADDING_MODES)
    check_choice("grid_sample", "backend", backend, (None, *backends.NAMES))
    check_float("grid_sample", input=input, grid=grid)
    check_rank("grid_sample", "input", input, 4, "(N, H, W, C)")
    check_rank("grid_sample", "grid", grid, 4, "(N, Ho, Wo, 2)")
    n, h, w, c = input.shape
    if grid.shape[0] != n or grid.shape[3] != 2:
        fail("grid_sample", "grid", grid.shape, f"(N, Ho, Wo, 2) = ({n}, Ho, Wo, 2)")
    result_dtype = mx.result_type(input, grid)
    unsupported = None if mode == "bilinear" else f"is bilinear only, not {mode!r}"
    backend = backend or backends.from_environment()
    kernel = backends.select("grid_sample", backend, result_dtype, unsupported)
    if kernel is not None and backend is None and not _trusted(kernel, result_dtype, padding_mode, bool(align_corners)):
        kernel = None  # it failed its self-check: the MLX-ops path
    if kernel is not None:
        sample = fused.grid_sample_core(kernel, padding_mode, bool(align_corners))
        return sample(input.astype(result_dtype), grid.astype(result_dtype))
    dtype = compute_dtype(input, grid)
    sample = _sampler(mode, padding_mode, bool(align_corners))
    out = sample(input.astype(dtype), grid.astype(dtype))
    return out.astype(result_dtype)


def _trusted(kernel, dtype, padding_mode: str, align_corners: bool) -> bool:
    """The fused kernel instance against the MLX-ops path on a small problem, once a process."""

    def fused_sample(input, grid):  # built inside the check, where a compiler's error is caught
        return fused.grid_sample_core(kernel, padding_mode, align_corners)(input, grid)

    def reference(input, grid):
        return grid_sample(input, grid, "bilinear", padding_mode, align_corners, backend="mlx")

    def problem():
        rng = np.random.default_rng(0)
        grid = rng.uniform(-1.1, 1.1, (1, 3, 3, 2))
        grid[0, 0, :, 0] = [-0.5, 0.0, 0.5] if align_corners else [-0.6, -0.2, 0.2]  # taps exactly on pixels
        return [mx.array(rng.standard_normal((1, 4, 5, 3)).astype(np.float32)), mx.array(grid.astype(np.float32))]

    options = {"padding": padding_mode, "align_corners": align_corners}
    return selfcheck.trusted(kernel, "grid_sample", dtype, options, fused_sample, reference, problem)


def _plan(grid: mx.array, height: int, width: int, mode: str, padding_mode: str, align_corners: bool):
    """Taps of every output point with flat indices into the (N * H * W, C) rows of the input, and
    weight derivatives taken w.r.t. the grid's normalised coordinates."""
    gx, gy = grid[..., 0], grid[..., 1]
    if align_corners:  # [-1, 1] -> [0, size - 1], written as PyTorch's CPU kernel does
        x, y = (gx + 1) * ((width - 1) / 2), (gy + 1) * ((height - 1) / 2)
        scale_x, scale_y = (width - 1) / 2, (height - 1) / 2
    else:  # [-1, 1] -> [-0.5, size - 0.5]
        x, y = (gx + 1) * (width / 2) - 0.5, (gy + 1) * (height / 2) - 0.5
        scale_x, scale_y = width / 2, height / 2

    if mode == "bicubic":
        taps = bicubic_taps(x, y, width, height, padding_mode, align_corners)
        grad_x, grad_y = scale_x, scale_y
    else:
        x, grad_x = pad_coordinates(x, width, padding_mode, align_corners)
        y, grad_y = pad_coordinates(y, height, padding_mode, align_corners)
        taps = (bilinear_taps if mode == "bilinear" else nearest_taps)(x, y, width, height)
        grad_x, grad_y = grad_x[..., None] * scale_x, grad_y[..., None] * scale_y

    batch = mx.arange(grid.shape[0], dtype=mx.int32).reshape(-1, 1, 1, 1) * (height * width)
    return taps._replace(
        index=taps.index + batch,
        dweight_dx=taps.dweight_dx * grad_x,
        dweight_dy=taps.dweight_dy * grad_y,
    )


@cache
def _sampler(mode: str, padding_mode: str, align_corners: bool):
    """A `custom_function` (plain ops in `export_mode()`) for one (mode, padding, align_corners), built once."""

    def gather(input, grid):
        n, h, w, c = input.shape
        taps = _plan(grid, h, w, mode, padding_mode, align_corners)
        values = input.reshape(n * h * w, c)[taps.index]  # (N, Ho, Wo, K, C)
        return taps, values

    @custom_function
    def sample(input, grid):
        taps, values = gather(input, grid)
        return (taps.weight[..., None, :] @ values).squeeze(-2)

    @sample.vjp
    def sample_vjp(primals, cotangent, output):
        input, grid = primals
        n, h, w, c = input.shape
        taps, values = gather(input, grid)
        contributions = taps.weight[..., None] * cotangent[..., None, :]  # (N, Ho, Wo, K, C)
        grad_input = mx.zeros((n * h * w, c), dtype=input.dtype)
        grad_input = grad_input.at[taps.index.reshape(-1)].add(contributions.reshape(-1, c))
        if mode == "nearest":  # piecewise constant: PyTorch's grid gradient is zero too
            grad_grid = mx.zeros_like(grid)
        else:
            slopes = (values @ cotangent[..., None]).squeeze(-1)  # (N, Ho, Wo, K)
            grad_grid = mx.stack([(taps.dweight_dx * slopes).sum(-1), (taps.dweight_dy * slopes).sum(-1)], axis=-1)
        return grad_input.reshape(n, h, w, c), grad_grid

    return sample
