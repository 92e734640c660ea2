"""`patches` (im2col) of channels-last images: the matrix whose product with a (O, k, k, C) weight
reshaped to (O, -1) is `mx.conv2d(x, weight, stride, padding, dilation)`.

On the CPU, for float32, it is the C++ operation of `kernels._native`, on every core; elsewhere MLX
ops (a padded copy and k * k strided slices). MLX's CPU convolution builds the same matrix for an
undilated kernel, but a dilated one takes its generic loop: a (2, 32, 43, 512) 3 x 3 convolution at
dilation 2 took 6.6 s forward and 20.6 s with its gradients there, 0.09 s and 0.29 s as patches and
matrix products. Differentiable either way: the C++ operation's gradient is its transpose (col2im), also
C++ on every core, equal to the MLX-ops path's up to the order of its sums.
"""

from functools import cache

import mlx.core as mx

from . import native
from .cpu import threads


def patches(x: mx.array, kernel_size: int, stride: int = 1, padding: int = 0, dilation: int = 1) -> mx.array:
    """x (N, H, W, C) -> (N, Ho, Wo, kernel_size * kernel_size * C): each output pixel's taps in
    (ky, kx, c) order, zeros outside `x`; Ho = (H + 2 padding - dilation (k - 1) - 1) // stride + 1."""
    if x.ndim != 4:
        raise ValueError(f"patches: x has shape {tuple(x.shape)}; expected (N, H, W, C)")
    if min(kernel_size, stride, dilation) < 1 or padding < 0:
        raise ValueError(
            f"patches: kernel_size {kernel_size}, stride {stride}, dilation {dilation} must be positive and "
            f"padding {padding} not negative"
        )
    _output_size(x, kernel_size, stride, padding, dilation)  # refuses a kernel that does not fit
    if native.for_float32(x) is None:
        return _by_slices(x, kernel_size, stride, padding, dilation)
    return _native(kernel_size, stride, padding, dilation)(x)


def _output_size(x, k, stride, padding, dilation) -> tuple[int, int]:
    _, h, w, _ = x.shape
    out_h = (h + 2 * padding - dilation * (k - 1) - 1) // stride + 1
    out_w = (w + 2 * padding - dilation * (k - 1) - 1) // stride + 1
    if out_h < 1 or out_w < 1:
        raise ValueError(
            f"patches: a {k} x {k} kernel at dilation {dilation} does not fit {h} x {w} padded by {padding}"
        )
    return out_h, out_w


def _by_slices(x, k, stride, padding, dilation):
    out_h, out_w = _output_size(x, k, stride, padding, dilation)
    padded = mx.pad(x, [(0, 0), (padding, padding), (padding, padding), (0, 0)])
    taps = [
        padded[
            :,
            ky * dilation : ky * dilation + (out_h - 1) * stride + 1 : stride,
            kx * dilation : kx * dilation + (out_w - 1) * stride + 1 : stride,
        ]
        for ky in range(k)
        for kx in range(k)
    ]
    return mx.concatenate(taps, axis=-1)


@cache
def _native(k, stride, padding, dilation):
    extract = mx.custom_function(lambda x: native.module().patches(x, k, k, stride, padding, dilation, threads()))

    @extract.vjp
    def extract_vjp(x, cotangent, output):  # one input: MLX hands it over as it is
        _, h, w, _ = x.shape
        return native.module().unpatches(cotangent, h, w, k, k, stride, padding, dilation, threads())

    return extract
