"""`layer_norm` over the last axis: `mx.fast.layer_norm(x, weight, bias, eps)`, the same forward; with
`dtype`, its result in that dtype (a bfloat16 model's norm: computed in float32 from bfloat16 x and float32
weight and bias, as MLX promotes them, and rounded back to bfloat16).

On the CPU, for float32 or bfloat16 x with float32 weight and bias, it is the C++ operation of
`kernels._native`. Its forward is MLX's CPU layer norm bit for bit (there a chain of about ten MLX
operations on one thread), bfloat16 read into float32 and the result rounded once; its backward is the
closed form from the input, on every core, where MLX differentiates that chain (the gradients agree
to float32 rounding; the weight's and bias's sums are added in another order), dx in x's dtype. An R50
encoder's (2, 7300, 256) at 512 x 683: forward 11.8 -> 2.6 ms, forward and backward 40-74 -> 7.7 ms. It
keeps only its input for the backward; in bfloat16 it reads and writes bfloat16, where widening x and
narrowing the result made two more passes each way. Elsewhere, and for other dtypes, it is
`mx.fast.layer_norm` (then the result cast to `dtype`).
"""

import mlx.core as mx

from . import native
from .cpu import threads


def layer_norm(x: mx.array, weight: mx.array, bias: mx.array, eps: float, dtype=None) -> mx.array:
    extension = native.for_float32_or_bfloat16(x, weight, bias)
    if extension is None or weight.dtype != mx.float32 or bias.dtype != mx.float32:
        y = mx.fast.layer_norm(x, weight, bias, eps)
        return y if dtype is None or y.dtype == dtype else y.astype(dtype)
    wanted = mx.float32 if dtype is None else dtype  # without dtype, MLX's: float32 weights promote bfloat16 x
    if wanted == x.dtype:
        return extension.layer_norm(x, weight, bias, eps, threads())
    y = extension.layer_norm(x.astype(mx.float32), weight, bias, eps, threads())  # the operation writes x's dtype
    return y if wanted == mx.float32 else y.astype(wanted)
