"""`random_split`: `mx.random.split(key, num)`, bit for bit, as vector code on the CPU.

MLX's CPU back-end computes random bits a threefry hash per pair of words, a function call each;
for the many words of a large dropout mask that is a large part of the op (an R50 encoder layer's
three masks at 512 x 683: about 60 ms of its 0.5 s forward). With `kernels._native` built and the
CPU as the default device, the same hash runs as vector code (`native/random_split.cpp`); elsewhere
this is `mx.random.split`. Either way the words are the same, so a seeded run draws the
same masks with or without the extension.
"""

import mlx.core as mx

from . import native


def random_split(key: mx.array, num: int) -> mx.array:
    """key: a random key (a (2,) uint32 array, as `mx.random.key` makes) -> (num, 2) uint32, equal to
    `mx.random.split(key, num)`."""
    if key.dtype != mx.uint32 or key.shape != (2,):
        raise ValueError(
            f"random_split: key has dtype {str(key.dtype).removeprefix('mlx.core.')} and shape {tuple(key.shape)}; "
            "expected a (2,) uint32 key"
        )
    if not 0 <= num < 2**31:
        raise ValueError(f"random_split: num is {num}; expected 0 <= num < 2**31")
    extension = native.module()
    if extension is None or mx.default_device().type != mx.cpu:
        return mx.random.split(key, num)
    return extension.random_split(key, num)
