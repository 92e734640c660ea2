"""`Conv2d`: `nn.Conv2d`, the same parameters, on the CPU's fast paths (oneDNN, or patches times the
weight): every convolution of the backbones and the input projections; `with_batch_norm`: a convolution and
the frozen batch norm after it (with a ResNet block's residual and ReLU) as one oneDNN convolution."""

from dataclasses import dataclass
from functools import cache

import kernels

import mlx.core as mx
import mlx.nn as nn

from .precision import to


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

    def _cpu_geometry(self) -> tuple[int, int, int] | None:
        """(stride, padding, dilation) where this convolution runs on the CPU's fast paths, else None (another
        device, an export, a geometry they do not take)."""
        (stride, stride_w), (padding, padding_w) = self.stride, self.padding
        dilation = self.dilation if isinstance(self.dilation, int) else self.dilation[0]
        on_cpu = mx.default_device().type == mx.cpu and not kernels.exporting()
        if not on_cpu or (stride, padding) != (stride_w, padding_w) or self.groups != 1:
            return None
        return stride, padding, dilation

    def __call__(self, x, dtype=None):
        """The convolution, in `dtype` where given (else x's)."""
        geometry = self._cpu_geometry()
        if geometry is None:
            return to(super().__call__(x), dtype or x.dtype)
        stride, padding, dilation = geometry
        y = kernels.onednn.conv2d(x, self.weight, stride, padding, dilation, bias=self.get("bias"), dtype=dtype)
        if y is not None:
            return y  # the bias added as the convolution's post-op, the result in `dtype` as it is written
        if self.weight.shape[1:3] == (1, 1) and padding == 0:
            y = x[:, ::stride, ::stride] @ self.weight.reshape(self.weight.shape[0], -1).T
        else:
            y = _patches_conv(stride, padding, dilation)(x, self.weight)
        return to(y + self.bias if "bias" in self else y, dtype or x.dtype)

    def with_batch_norm(self, x, norm, residual=None, relu: bool = False):
        """`norm(self(x), residual, relu)` for a frozen batch norm `norm` (models/precision.FrozenBatchNorm2d),
        computed as OpenVINO and TensorRT compute it: the norm folded into this convolution (its weight scaled
        per output channel, its shift the bias) and the bias, the residual and the ReLU as oneDNN post-ops, one
        pass over memory where the unfolded way made a convolution and a channel_affine pass. The result stays
        bfloat16 where the products run in bfloat16 (the next convolution's input as it wants it; the detector's
        input projections take the last as it is: Conv2d(x, dtype=)). Where oneDNN does not run it (another
        device, an export, no fast kernel), the unfolded way: the parameters are the unfolded ones, for
        training, checkpoints and exports alike.
        The folded weights are computed once per model at inference (kept while its weights are the same
        arrays), at every call in training (the gradient reaches the unfolded weight through them)."""
        geometry = self._cpu_geometry()
        if geometry is not None and "bias" not in self:
            weight, bias = self._folded(norm)
            y = kernels.onednn.conv2d(x, weight, *geometry, bias=bias, residual=residual, relu=relu, keep_bfloat16=True)
            if y is not None:
                return y
        return norm(self(x), residual=residual, relu=relu)

    def _folded(self, norm) -> tuple[mx.array, mx.array]:
        """(this convolution's weight scaled by `norm`'s per-channel scale, in the weight's dtype; `norm`'s shift,
        float32): kept in evaluation while the five arrays are the same (a Detector's weights), else made."""
        sources = (self.weight, norm.weight, norm.bias, norm.running_mean, norm.running_var)
        kept = getattr(self, "_folded_weights", None)
        if not self.training and kept is not None and all(a is b for a, b in zip(kept.sources, sources, strict=True)):
            return kept.weight, kept.bias
        scale, shift = norm.scale_and_shift()
        weight = (self.weight * scale[:, None, None, None]).astype(self.weight.dtype)
        if not self.training:
            object.__setattr__(self, "_folded_weights", _FoldedWeights(sources, weight, shift))  # not a parameter
        return weight, shift


@dataclass(frozen=True)
class _FoldedWeights:
    sources: tuple  # the arrays they were computed from, held: compared by identity
    weight: mx.array
    bias: mx.array


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
