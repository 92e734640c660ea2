"""Fused GPU kernels with hand-written backward kernels: `ms_deform_attn` and bilinear `grid_sample`.

One source of the arithmetic serves every back-end: `sampling.h` (coordinates, padding, bilinear
taps) and one `.body` per kernel, written in the subset of C++ that Metal, CUDA and a plain C++
compiler all accept. A back-end (`kernels.metal`, `kernels.cuda`) adds only a prologue (how to
add atomically, how to sum across a SIMD group / warp) and the line that names the thread's index.

Each sample point is handled by one group of LANES threads (a Metal SIMD group, a CUDA warp); lane
i takes channels i, i + LANES, ... The forward sums taps per channel; the backward scatters the
value gradient with atomic adds and reduces the location and weight gradients across the group.
Inputs may be float32, float16 or bfloat16; the kernels accumulate in float32.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import mlx.core as mx

from ..checks import level_starts

SOURCES = Path(__file__).parent
LANES = 32
THREADGROUP = 256
PADDINGS = ("zeros", "border", "reflection")  # the kernels' PADDING template argument is the index
INT32_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class Backend:
    """What differs between GPU back-ends."""

    name: str
    prologue: str  # placed before sampling.h: INLINE, LANES, float_bits, lane_sum, ATOMIC_ADD
    thread_id: str  # the body's first line: `thread_id` from the back-end's built-ins
    make_kernel: Callable  # MLX's kernel constructor, called with keyword arguments
    missing: Callable[[], str | None]  # why this back-end cannot run here, or None

    def ms_deform_attn_core(self, shapes, align_corners, padding_mode, value_layout, locations_layout):
        return ms_deform_attn_core(self, shapes, align_corners, padding_mode, value_layout, locations_layout)

    def kernel(self, name: str, input_names, output_names, atomic_outputs: bool = False):
        return self.make_kernel(
            name=name,
            input_names=list(input_names),
            output_names=list(output_names),
            source=self.thread_id + (SOURCES / f"{name}.body").read_text(),
            header=self.prologue + (SOURCES / "sampling.h").read_text(),
            atomic_outputs=atomic_outputs,
        )


def _launch(kernel, inputs, samples: int, template, output_shapes, output_dtypes, init_value=None):
    threads = samples * LANES
    if threads > INT32_LIMIT or any(a.size > INT32_LIMIT for a in inputs):
        raise ValueError("fused kernels index with int32: more than 2**31 - 1 threads or elements; split the batch")
    return kernel(
        inputs=inputs,
        template=template,
        grid=(max(threads, LANES), 1, 1),
        threadgroup=(THREADGROUP, 1, 1),
        output_shapes=output_shapes,
        output_dtypes=output_dtypes,
        init_value=init_value,
    )


@cache
def ms_deform_attn_core(
    backend: Backend,
    shapes: tuple,
    align_corners: bool,
    padding_mode: str,
    value_layout: str,
    locations_layout: str,
):
    """`ms_deform_attn` on fused kernels for one set of level shapes and flags, as a
    `custom_function` of (value, sampling_locations, attention_weights) in the given layouts."""
    names = ["value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights"]
    forward = backend.kernel("ms_deform_attn_forward", names, ["output"])
    backward = backend.kernel(
        "ms_deform_attn_backward",
        [*names, "grad_output"],
        ["grad_value", "grad_sampling_locations", "grad_attention_weights"],
        atomic_outputs=True,
    )
    spatial_shapes = mx.array(shapes, dtype=mx.int32)
    level_start_index = mx.array(level_starts(shapes), dtype=mx.int32)
    flags = [
        ("ALIGN_CORNERS", align_corners),
        ("PADDING", PADDINGS.index(padding_mode)),
        ("VALUE_BNLC", value_layout == "BNLC"),
        ("LOCATIONS_B2QHLP", locations_layout == "B2QHLP"),
    ]

    def inputs(value, locations, weights):
        return [value, spatial_shapes, level_start_index, locations, weights]

    @mx.custom_function
    def attend(value, locations, weights):
        b, q, heads = weights.shape[:3]
        channels = value.shape[-1]
        (out,) = _launch(
            forward,
            inputs(value, locations, weights),
            b * q * heads,
            [("T", value.dtype), *flags],
            [(b, q, heads * channels)],
            [value.dtype],
        )
        return out

    @attend.vjp
    def attend_vjp(primals, cotangent, output):
        value, locations, weights = primals
        b, q, heads = weights.shape[:3]
        grads = _launch(
            backward,
            [*inputs(value, locations, weights), cotangent.astype(value.dtype)],
            b * q * heads,
            [("T", value.dtype), *flags],
            [value.shape, locations.shape, weights.shape],
            3 * [mx.float32],
            init_value=0,
        )
        return tuple(g.astype(p.dtype) for g, p in zip(grads, primals, strict=True))

    return attend


@cache
def grid_sample_core(backend: Backend, padding_mode: str, align_corners: bool):
    """Bilinear `grid_sample` on fused kernels, as a `custom_function` of (input, grid)."""
    forward = backend.kernel("grid_sample_forward", ["input", "grid"], ["output"])
    backward = backend.kernel(
        "grid_sample_backward", ["input", "grid", "grad_output"], ["grad_input", "grad_grid"], atomic_outputs=True
    )
    flags = [("ALIGN_CORNERS", align_corners), ("PADDING", PADDINGS.index(padding_mode))]

    @mx.custom_function
    def sample(input, grid):
        n, ho, wo = grid.shape[:3]
        (out,) = _launch(
            forward,
            [input, grid],
            n * ho * wo,
            [("T", input.dtype), *flags],
            [(n, ho, wo, input.shape[-1])],
            [input.dtype],
        )
        return out

    @sample.vjp
    def sample_vjp(primals, cotangent, output):
        input, grid = primals
        n, ho, wo = grid.shape[:3]
        grads = _launch(
            backward,
            [input, grid, cotangent.astype(input.dtype)],
            n * ho * wo,
            [("T", input.dtype), *flags],
            [input.shape, grid.shape],
            2 * [mx.float32],
            init_value=0,
        )
        return tuple(g.astype(p.dtype) for g, p in zip(grads, primals, strict=True))

    return sample
