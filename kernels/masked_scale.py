"""`masked_scale(x, keep, scale, relu=False)`: `mx.where(keep, x * scale, 0)` (dropout), or with `relu`
`mx.where(keep, mx.maximum(x, 0) * scale, 0)` (dropout after a ReLU); `scale_where_positive(x,
output, scale=1.0)`: `mx.where(output > 0, x * scale, 0)` (their gradient, and a ReLU's, from the
output; no multiply for scale 1); `relu(x)`: `mx.maximum(x, 0)`, its VJP from the output. The same
numbers.

On the CPU, for float32 and bfloat16, they are the C++ operation of `kernels._native`: MLX's ops bit
for bit in one pass on every core, where MLX makes a pass of one thread each (its select alone was
about 8% of an R50 training step's CPU time at 512 x 683, most of it dropout's and the ReLUs'
gradients; in bfloat16 training 15%). bfloat16 is read into float32 and the result rounded back once,
as MLX's bfloat16 multiply does, the scale rounded to bfloat16 first as MLX rounds a Python float
there. The VJP of `masked_scale` is the same operation on the cotangent (with `relu`,
`scale_where_positive` of the output). Elsewhere, for other dtypes and in `export_mode()`, MLX's ops."""

import mlx.core as mx

from . import native
from .cpu import threads


def masked_scale(x: mx.array, keep: mx.array, scale: float, relu: bool = False) -> mx.array:
    extension = native.for_float32_or_bfloat16(x)
    if extension is None or keep.dtype != mx.bool_ or keep.shape != x.shape:
        return masked_scale_with_mlx_ops(x, keep, scale, relu)
    return extension.masked_scale(x, keep, scale, relu, threads())


def scale_where_positive(x: mx.array, output: mx.array, scale: float = 1.0) -> mx.array:
    extension = native.for_float32_or_bfloat16(x, output)
    if extension is None or output.shape != x.shape or output.dtype != x.dtype:
        return scale_where_positive_with_mlx_ops(x, output, scale)
    return extension.scale_where_positive(x, output, scale, threads())


def relu(x: mx.array) -> mx.array:
    extension = native.for_float32_or_bfloat16(x)
    if extension is None:
        return mx.maximum(x, 0)
    return extension.relu(x, threads())


def masked_scale_with_mlx_ops(x: mx.array, keep: mx.array, scale: float, relu: bool = False) -> mx.array:
    """`masked_scale` in MLX's ops: the numbers the C++ operation gives."""
    return mx.where(keep, (mx.maximum(x, 0) if relu else x) * scale, mx.array(0, x.dtype))


def scale_where_positive_with_mlx_ops(x: mx.array, output: mx.array, scale: float = 1.0) -> mx.array:
    """`scale_where_positive` in MLX's ops: the numbers the C++ operation gives."""
    return mx.where(output > 0, x if scale == 1 else x * scale, mx.array(0, x.dtype))
