"""`channel_affine(x, scale, shift, residual=None, relu=False)`: x * scale + shift over the last axis,
+ residual, then max(., 0): a frozen batch norm and what follows it in a ResNet block.

On the CPU, for float32, it is the C++ operation of `kernels._native`: MLX's multiply, adds and
maximum bit for bit, in one pass on every core, where MLX makes a pass, a buffer and one thread of
each (R50's backbone at 800 x 1066 spent about a fifth of its time in them, bench/README.md). Its
VJP is in MLX ops. Elsewhere, for other dtypes and in `export_mode()`, it is those MLX ops."""

import mlx.core as mx

from . import native
from .cpu import threads


def channel_affine(x: mx.array, scale: mx.array, shift: mx.array, residual=None, relu: bool = False) -> mx.array:
    extension = native.for_float32(x, scale, shift, *([] if residual is None else [residual]))
    if extension is None or scale.ndim != 1 or (residual is not None and residual.shape != x.shape):
        return with_mlx_ops(x, scale, shift, residual, relu)
    return extension.channel_affine(x, scale, shift, residual, relu, threads())


def with_mlx_ops(x: mx.array, scale: mx.array, shift: mx.array, residual=None, relu: bool = False) -> mx.array:
    """The same in MLX's ops, one pass each: the numbers the C++ operation gives."""
    y = x * scale + shift
    y = y if residual is None else y + residual
    return mx.maximum(y, 0) if relu else y
