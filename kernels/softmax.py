"""`softmax` over the last axis: `mx.softmax(x, axis=-1, precise=True)`, the same numbers.

On the CPU, for float32, it is the C++ operation of `kernels._native`: MLX's CPU arithmetic bit for
bit (its exp polynomial, the sum in order, the reciprocal), on every core and in vector instructions.
MLX's Linux build evaluates that polynomial one element at a time through libm's fma (about 16 ns an
element: an R50 encoder layer's attention weights at 800 x 1066 took 34 ms, 4.8 ms here). bfloat16 is
read into float32 and each result rounded back once, as MLX's precise bfloat16 softmax does. Its VJP is
MLX's, s * g - s * sum(s * g) rounded as MLX's ops round it (bit for bit), in one pass on every core where
those ops made five on one. Elsewhere, and for other dtypes, it is `mx.softmax`.
"""

import mlx.core as mx

from . import native
from .cpu import threads


def softmax(x: mx.array) -> mx.array:
    extension = native.for_float32_or_bfloat16(x)
    if extension is None:
        return mx.softmax(x, axis=-1, precise=True)
    return extension.softmax(x, threads())
