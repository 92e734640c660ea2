"""`linear(x, weight, bias)`: x @ weight.T + bias as `nn.Linear` computes it (`mx.addmm`), the same
numbers.

On the CPU, for float32, the bias's rows that addmm starts from are `broadcast_rows` of
`kernels._native`, written on every core, where MLX copies the broadcast bias one element at a time on
one thread (about a fifth of an R50 encoder projection's time: 7.6 of 25 ms for (17821, 256),
bench/README.md); addmm then takes that buffer as its output. Elsewhere, for other dtypes and in
`export_mode()`, it is `mx.addmm(bias, x, weight.T)`. Where oneDNN is used (`onednn.linear`, x86-64
Linux) it computes the whole product, bias included, before either of these."""

import mlx.core as mx

from . import native, onednn
from .cpu import threads


def linear(x: mx.array, weight: mx.array, bias=None) -> mx.array:
    y = onednn.linear(x, weight, bias)
    if y is not None:
        return y
    if bias is None:
        return x @ weight.T
    extension = native.for_float32(x, weight, bias)
    if extension is None or x.ndim == 0 or bias.ndim != 1:
        return mx.addmm(bias, x, weight.T)
    # as one (rows, in) product: given (B, L, in), addmm copied its (B, L, out) start once more
    flat = x.reshape(-1, x.shape[-1])
    rows = extension.broadcast_rows(bias, [flat.shape[0], weight.shape[0]], threads())
    return mx.addmm(rows, flat, weight.T).reshape(*x.shape[:-1], weight.shape[0])
