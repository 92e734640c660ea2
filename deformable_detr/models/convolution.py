"""`Conv2d`: `nn.Conv2d`, the same parameters, on the CPU's fast paths (oneDNN, or patches times the
weight): every convolution of the backbones and the input projections."""

from functools import cache

import kernels

import mlx.core as mx
import mlx.nn as nn


class Conv2d(nn.Conv2d):
    """`nn.Conv2d` computed as matrix products on the CPU, same parameters: 1 x 1 as a product of the
    (strided) input, the others as `kernels.patches` (im2col on every core) times the weight. MLX's CPU
    convolution builds the same patches in general copies on one thread before the same GEMM, takes
    its generic loop at dilation > 1 (about 70x slower, kernels/patches.py), and its gradient w.r.t. a
    strided convolution's input runs about 50x slower than the convolution. Outputs are MLX's bit for
    bit at dilation 1, gradients to float32 rounding (bench/conv.py). On x86-64 Linux oneDNN computes it
    (kernels.onednn) where it has fast kernels for the shape, the patches where it has not (remembered per
    shape; a backward pass oneDNN has no fast kernel for is the patches' too). In `kernels.export_mode()` it is
    `nn.Conv2d` (`mx.conv2d`): an exported file runs on any device, and the custom VJP below would not
    serialize."""

    def __call__(self, x):
        (stride, stride_w), (padding, padding_w) = self.stride, self.padding
        dilation = self.dilation if isinstance(self.dilation, int) else self.dilation[0]
        on_cpu = mx.default_device().type == mx.cpu and not kernels.exporting()
        if not on_cpu or (stride, padding) != (stride_w, padding_w) or self.groups != 1:
            return super().__call__(x)
        y = kernels.onednn.conv2d(x, self.weight, stride, padding, dilation)
        if y is not None:
            return y + self.bias if "bias" in self else y
        if self.weight.shape[1:3] == (1, 1) and padding == 0:
            y = x[:, ::stride, ::stride] @ self.weight.reshape(self.weight.shape[0], -1).T
        else:
            y = _patches_conv(stride, padding, dilation)(x, self.weight)
        return y + self.bias if "bias" in self else y


@cache
def _patches_conv(stride: int, padding: int, dilation: int):
    """x's patches times the weight. The backward makes the patches again rather than keep them (k * k
    times the input): the weight's gradient is the cotangent times them, the input's the transpose of
    patches (col2im) of the cotangent times the weight."""

    def forward(x, weight):
        return kernels.patches(x, weight.shape[1], stride, padding, dilation) @ weight.reshape(weight.shape[0], -1).T

    convolution = mx.custom_function(forward)

    @convolution.vjp
    def convolution_vjp(primals, cotangent, output):
        x, weight = primals
        out_channels, k = weight.shape[:2]
        matrix = weight.reshape(out_channels, -1)

        def extract(inputs):
            return kernels.patches(inputs, k, stride, padding, dilation)

        columns = extract(x)
        grad_weight = cotangent.reshape(-1, out_channels).T @ columns.reshape(-1, columns.shape[-1])
        _, (grad_x,) = mx.vjp(extract, [x], [cotangent @ matrix])  # col2im, not the patches again
        return grad_x, grad_weight.reshape(weight.shape)

    return convolution
