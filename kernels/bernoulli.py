"""`bernoulli16(key, threshold, shape)`: a bool array, each element true with probability
threshold / 65536, drawn from `key` (an MLX key, two uint32): the same key gives the same array.

Each 64-bit random word gives four elements, 16 bits each (half the random bits of
`mx.random.bernoulli`'s floats). On the CPU it is the C++ operation of `kernels._native`: splitmix64
of the key and a counter, on every core: a (14620, 1024) mask in 3.8 ms against 33 ms from MLX's
threefry words there (one thread, 20 rounds a word), which made dropout a quarter of a transformer
layer's forward. Elsewhere
the words are MLX's (`mx.random.split(key, n / 4)`): the same probabilities, other draws.
"""

import math

import mlx.core as mx

from . import native
from .cpu import threads


def bernoulli16(key: mx.array, threshold: int, shape) -> mx.array:
    if not 0 <= threshold <= 65536:
        raise ValueError(f"bernoulli16: threshold {threshold} must be in [0, 65536]")
    if key.dtype != mx.uint32 or key.size != 2:
        raise ValueError(f"bernoulli16: key must be two uint32, got {key.dtype} of shape {tuple(key.shape)}")
    shape = tuple(shape)
    extension = native.for_float32()
    if extension is not None:
        return extension.bernoulli16(key, list(shape), threshold, threads())
    size = math.prod(shape)
    words = mx.random.split(key, (size + 3) // 4)  # (n / 4, 2) uint32
    bits = words.view(mx.uint16).reshape(-1)[:size].astype(mx.uint32)
    return (bits < threshold).reshape(shape)
