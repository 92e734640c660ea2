"""`sin_cos(x)`: `mx.stack([mx.sin(x), mx.cos(x)], axis=-1)`, the same numbers.

On the CPU, for float32, it is the C++ operation of `kernels._native`: MLX's CPU sine and cosine bit
for bit (simd/math.h's polynomial, libm beyond |x| > 2^23), both from one argument reduction, in
vector instructions on every core. MLX's Linux build evaluates that polynomial one element at a
time, each fma a libm call (about 29 ns an element: R50's position encoding at 800 x 1066 took
about 0.12 s). Its VJP is in MLX ops. Elsewhere, for other dtypes and in `export_mode()`, it is
those MLX ops."""

import mlx.core as mx

from . import native
from .cpu import threads


def sin_cos(x: mx.array) -> mx.array:
    """x (...) -> (..., 2): [sin(x), cos(x)]."""
    extension = native.for_float32(x)
    if extension is None:
        return with_mlx_ops(x)
    return extension.sin_cos(x, threads())


def with_mlx_ops(x: mx.array) -> mx.array:
    """The same in MLX's ops: the numbers the C++ operation gives."""
    return mx.stack([mx.sin(x), mx.cos(x)], axis=-1)
