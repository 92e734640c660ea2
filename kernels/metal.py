"""The fused kernels on Apple GPUs: `mx.fast.metal_kernel` with a thin Metal prologue before the
shared arithmetic of `kernels/fused` (one SIMD group of 32 threads per sample point)."""

import mlx.core as mx

from .fused import Backend

PROLOGUE = """\
// Metal prologue of the fused kernels; kernels/fused/sampling.h follows.
#include <metal_stdlib>
using namespace metal;
#define INLINE inline
#define LANES 32
#define ATOMIC_ADD(array, index, value) atomic_fetch_add_explicit(&(array)[index], (value), memory_order_relaxed)
INLINE uint float_bits(float x) { return as_type<uint>(x); }
INLINE float lane_sum(float x) { return simd_sum(x); }
"""

# MLX declares a Metal attribute as a kernel argument when the body names it.
THREAD_ID = "const uint thread_id = thread_position_in_grid.x;\n"


def _make_kernel(*, name, input_names, output_names, source, header, atomic_outputs):
    return mx.fast.metal_kernel(
        name=name,
        input_names=input_names,
        output_names=output_names,
        source=source,
        header=header,
        atomic_outputs=atomic_outputs,
    )


def _missing() -> str | None:
    if not mx.metal.is_available():
        return "this MLX has no Metal back-end (mx.metal.is_available() is False; Metal is macOS on Apple silicon)"
    if mx.default_device().type != mx.gpu:
        return f"the default device is {mx.default_device()}, and Metal kernels run on the GPU"
    return None


METAL = Backend("metal", PROLOGUE, THREAD_ID, _make_kernel, _missing)
