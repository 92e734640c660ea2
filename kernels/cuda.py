"""The fused kernels on NVIDIA GPUs: `mx.fast.cuda_kernel` (MLX's CUDA back-end) with a thin CUDA
prologue before the shared arithmetic of `kernels/fused` (one warp per sample point)."""

import mlx.core as mx

from .fused import Backend

PROLOGUE = """\
// CUDA prologue of the fused kernels; kernels/fused/sampling.h follows.
#define INLINE __device__ __forceinline__
#define LANES 32
#define ATOMIC_ADD(array, index, value) atomicAdd(&(array)[index], (value))
INLINE unsigned int float_bits(float x) { return __float_as_uint(x); }
INLINE float lane_sum(float x) {
  for (int offset = LANES / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}
"""

THREAD_ID = "const unsigned int thread_id = blockIdx.x * blockDim.x + threadIdx.x;\n"


def _make_kernel(*, name, input_names, output_names, source, header, atomic_outputs):
    del atomic_outputs  # CUDA outputs are plain pointers, which atomicAdd takes as they are
    return mx.fast.cuda_kernel(
        name=name, input_names=input_names, output_names=output_names, source=source, header=header
    )


def _missing() -> str | None:
    if not mx.cuda.is_available():
        return (
            "this MLX has no CUDA back-end (mx.cuda.is_available() is False; "
            "it needs Linux, an NVIDIA GPU and `pip install mlx[cuda]`)"
        )
    if mx.default_device().type != mx.gpu:
        return f"the default device is {mx.default_device()}, and CUDA kernels run on the GPU"
    return None


CUDA = Backend("cuda", PROLOGUE, THREAD_ID, _make_kernel, _missing)
