"""`ms_deform_attn` on the CPU in C++ (kernels/native/ms_deform_attn_kernel.h: the arithmetic of
`fused/sampling.h` lane by lane in vectors, threads over samples in the forward and (batch, head)
pairs in the backward), as an MLX operation of `kernels._native`.

MLX's own CPU gather and scatter run on one thread and pass through memory several times per
sample point; this kernel reads each tap's row once per pass on every core. It is a lazy MLX
operation on the CPU stream (forward and backward `Primitive`s), so it runs inside `mx.compile`,
`mx.checkpoint` and a differentiated function without synchronising. float32 inside; float16 and
bfloat16 are converted at the boundary.
"""

import os
from dataclasses import dataclass
from functools import cache

import mlx.core as mx

from . import native

PADDINGS = ("zeros", "border")


@dataclass(frozen=True)
class CpuBackend:
    name: str = "cpu"

    @staticmethod
    def missing() -> str | None:
        why = native.missing()
        if why is not None:
            return why
        if mx.default_device().type != mx.cpu:
            return f"the default device is {mx.default_device()}, and this kernel runs on the CPU"
        return None

    @staticmethod
    def ms_deform_attn_core(shapes, align_corners, padding_mode, value_layout, locations_layout):
        return ms_deform_attn_core(shapes, align_corners, padding_mode, value_layout, locations_layout)


CPU = CpuBackend()


def threads() -> int:
    """All the cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@cache
def ms_deform_attn_core(shapes: tuple, align_corners: bool, padding_mode: str, value_layout: str, locations_layout):
    """A function of (value, sampling_locations, attention_weights) in the given layouts."""
    flat_shapes = [size for shape in shapes for size in shape]
    flags = dict(
        shapes=flat_shapes,
        value_bnlc=value_layout == "BNLC",
        locations_b2qhlp=locations_layout == "B2QHLP",
        align_corners=align_corners,
        padding=PADDINGS.index(padding_mode),
        threads=threads(),
    )

    def attend(value, locations, weights):
        return native.module().ms_deform_attn(value, locations, weights, **flags).astype(value.dtype)

    return attend
