"""`add(a, b)`: a + b; `astype(x, dtype)`: x.astype(dtype); `masked_rows(x, keep)`: x where `keep`, else 0,
for a `keep` broadcast along x's last axis (a padding mask over tokens). The same numbers as MLX's ops (but
`masked_rows`'s dropped entries: x * 0, so -0 for negative x, and NaN for a non-finite x: the rows it drops hold
finite features; and `astype`'s float32 subnormals, below).

On the CPU, where oneDNN is used (kernels.onednn), its binary primitive and reorder: one pass on every core,
where MLX's binaries and AsType make one pass on one thread (bfloat16 training's casts alone were 14% of an R50
step), and the masked_scale `masked_rows` replaces had the broadcast mask copied out first (a bool per element:
an R50 encoder layer's value, (17821, 256)). Elsewhere, in `export_mode()` and for other dtypes, MLX's ops."""

import mlx.core as mx

from . import onednn


def add(a: mx.array, b: mx.array) -> mx.array:
    y = onednn.binary("add", a, b)
    return a + b if y is None else y


def astype(x: mx.array, dtype) -> mx.array:
    """`x.astype(dtype)`; between float32 and bfloat16 on every core where oneDNN is used (oneDNN's reorder: MLX's
    bits, but that it flushes float32's subnormals, below 1.2e-38, to zero on the way to bfloat16)."""
    if x.dtype == dtype:
        return x
    y = onednn.astype(x, dtype)
    return x.astype(dtype) if y is None else y


def masked_rows(x: mx.array, keep: mx.array) -> mx.array:
    """`mx.where(keep, x, 0)` for a bool `keep` of x's shape but its last axis, which is 1."""
    y = onednn.binary("multiply", x, mx.stop_gradient(keep.astype(x.dtype)))
    return mx.where(keep, x, mx.array(0, x.dtype)) if y is None else y
