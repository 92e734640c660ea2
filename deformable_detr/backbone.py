"""ResNet backbone with frozen batch norm, returning feature maps and their padding masks.

Channels-last throughout: images (B, H, W, 3), features (B, h, w, C). Parameter paths follow
torchvision's ResNet under `backbone.0.body` (the authors' `Joiner`), so their checkpoints map key
for key.
"""

from functools import cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np

import kernels

from .precision import to
from .recompute import ReLU, checkpointed

# name -> (block, blocks per stage)
ARCHITECTURES = {
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet34": ("basic", (3, 4, 6, 3)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
    "resnet101": ("bottleneck", (3, 4, 23, 3)),
}


class FrozenBatchNorm2d(nn.Module):
    """Batch norm with fixed statistics and affine parameters (never trained)."""

    def __init__(self, channels: int, eps: float = 1e-5):
        super().__init__()
        self.weight = mx.ones((channels,))
        self.bias = mx.zeros((channels,))
        self.running_mean = mx.zeros((channels,))
        self.running_var = mx.ones((channels,))
        self.eps = eps
        self.freeze()

    def __call__(self, x):
        scale = self.weight * mx.rsqrt(self.running_var + self.eps)  # in float32 (precision.py)
        return x * to(scale, x.dtype) + to(self.bias - self.running_mean * scale, x.dtype)


class Conv2d(nn.Conv2d):
    """`nn.Conv2d` with three forms of its own on the CPU, same parameters; outputs MLX's bit for bit
    but the dilated form's (summed in another order), gradients to float32 rounding:
    - 1 x 1: a matrix product. MLX's CPU convolution copies its whole input twice on one thread
      (padding, then im2col) before the same GEMM; the product computes the identical output in
      about 60% of the time, and its gradients are matrix products too (bench/conv.py).
    - strided: the input gradient from a stride-1 convolution. MLX's CPU gradient of a strided
      convolution w.r.t. its input (a transposed, input-dilated convolution) runs about 50x slower
      than the convolution itself, and it was most of an R50 training step.
    - dilated (DC5's layer4): products of `kernels.patches`, forward and gradients. MLX's CPU
      convolution at dilation > 1 runs its generic loop, about 70x slower (kernels/patches.py)."""

    def __call__(self, x):
        (stride, stride_w), (padding, padding_w) = self.stride, self.padding
        dilation = self.dilation if isinstance(self.dilation, int) else self.dilation[0]
        pointwise = self.weight.shape[1:3] == (1, 1) and padding == 0 and self.groups == 1
        if mx.default_device().type != mx.cpu or (stride, padding) != (stride_w, padding_w):
            return super().__call__(x)
        if pointwise:
            y = x[:, ::stride, ::stride] @ self.weight.reshape(self.weight.shape[0], -1).T
        elif stride > 1:
            y = _strided_conv(stride, padding, dilation)(x, self.weight)
        elif dilation > 1 and padding <= dilation * (self.weight.shape[1] - 1):
            y = _dilated_conv(padding, dilation)(x, self.weight)
        else:
            return super().__call__(x)
        return y + self.bias if "bias" in self else y


@cache
def _strided_conv(stride: int, padding: int, dilation: int):
    def forward(x, weight):
        return mx.conv2d(x, weight, stride=stride, padding=padding, dilation=dilation)

    def dense(x, weight):
        return mx.conv2d(x, weight, stride=1, padding=padding, dilation=dilation)

    strided = mx.custom_function(forward)

    @strided.vjp
    def strided_vjp(primals, cotangent, output):
        x, weight = primals
        _, (grad_weight,) = mx.vjp(lambda w: forward(x, w), [weight], [cotangent])
        # the output gradient on the stride-1 grid: zeros between the strided samples
        n, h, w, c = cotangent.shape
        spread = mx.pad(
            cotangent[:, :, None, :, None, :], [(0, 0), (0, 0), (0, stride - 1), (0, 0), (0, stride - 1), (0, 0)]
        )
        kernel_h, kernel_w = weight.shape[1:3]
        full_h = x.shape[1] + 2 * padding - dilation * (kernel_h - 1)
        full_w = x.shape[2] + 2 * padding - dilation * (kernel_w - 1)
        spread = spread.reshape(n, h * stride, w * stride, c)[:, :full_h, :full_w]
        _, (grad_x,) = mx.vjp(lambda inputs: dense(inputs, weight), [x], [spread])
        return grad_x, grad_weight

    return strided


@cache
def _dilated_conv(padding: int, dilation: int):
    """Stride 1: x's patches times the weight; the weight's gradient the cotangent times x's patches,
    the input's the cotangent's patches times the flipped weight (a stride-1 convolution's)."""

    def forward(x, weight):
        return kernels.patches(x, weight.shape[1], 1, padding, dilation) @ weight.reshape(weight.shape[0], -1).T

    dilated = mx.custom_function(forward)

    @dilated.vjp
    def dilated_vjp(primals, cotangent, output):
        x, weight = primals
        out_channels, k, _, in_channels = weight.shape
        columns = kernels.patches(x, k, 1, padding, dilation).reshape(-1, k * k * in_channels)
        grad_weight = (cotangent.reshape(-1, out_channels).T @ columns).reshape(weight.shape)
        flipped = weight[:, ::-1, ::-1, :].transpose(3, 1, 2, 0).reshape(in_channels, -1)
        grad_x = kernels.patches(cotangent, k, 1, dilation * (k - 1) - padding, dilation) @ flipped.T
        return grad_x, grad_weight

    return dilated


def conv(in_channels, out_channels, kernel_size, stride=1, dilation=1):
    padding = dilation * (kernel_size // 2)
    return Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_channels, channels, stride=1, dilation=1, downsample=None):
        super().__init__()
        self.conv1 = conv(in_channels, channels, 3, stride, dilation)
        self.bn1 = FrozenBatchNorm2d(channels)
        self.conv2 = conv(channels, channels, 3, 1, dilation)
        self.bn2 = FrozenBatchNorm2d(channels)
        self.relu = ReLU()
        if downsample is not None:
            self.downsample = downsample

    def __call__(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if "downsample" not in self else _sequential(self.downsample, x)
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_channels, channels, stride=1, dilation=1, downsample=None):
        super().__init__()
        self.conv1 = conv(in_channels, channels, 1)
        self.bn1 = FrozenBatchNorm2d(channels)
        self.conv2 = conv(channels, channels, 3, stride, dilation)  # torchvision v1.5: stride on the 3x3
        self.bn2 = FrozenBatchNorm2d(channels)
        self.conv3 = conv(channels, channels * 4, 1)
        self.bn3 = FrozenBatchNorm2d(channels * 4)
        self.relu = ReLU()
        if downsample is not None:
            self.downsample = downsample

    def __call__(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if "downsample" not in self else _sequential(self.downsample, x)
        return self.relu(out + identity)


def _sequential(layers, x):
    for layer in layers:
        x = layer(x)
    return x


class ResNet(nn.Module):
    """torchvision's ResNet without the classifier; returns the outputs of layer2..layer4."""

    def __init__(self, name: str, dilation: bool = False, width: int = 64):
        super().__init__()
        if name not in ARCHITECTURES:
            raise ValueError(f"unknown backbone {name!r}; expected one of {', '.join(ARCHITECTURES)}")
        kind, depths = ARCHITECTURES[name]
        block = Bottleneck if kind == "bottleneck" else BasicBlock
        widths = (width, 2 * width, 4 * width, 8 * width)  # torchvision: width 64
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = FrozenBatchNorm2d(width)
        self.relu = ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        in_channels, current_dilation = width, 1
        for stage, (channels, depth) in enumerate(zip(widths, depths, strict=True)):
            stride = 1 if stage == 0 else 2
            previous_dilation = current_dilation
            if dilation and stage == 3:  # DC5: the last stage keeps stride 16 and dilates instead
                current_dilation, stride = current_dilation * stride, 1
            blocks = []
            for i in range(depth):
                downsample = None
                if i == 0 and (stride != 1 or in_channels != channels * block.expansion):
                    downsample = [
                        conv(in_channels, channels * block.expansion, 1, stride),
                        FrozenBatchNorm2d(channels * block.expansion),
                    ]
                # as torchvision: a stage's first block keeps the dilation of the stage before
                first = i == 0
                blocks.append(
                    block(
                        in_channels,
                        channels,
                        stride if first else 1,
                        previous_dilation if first else current_dilation,
                        downsample,
                    )
                )
                in_channels = channels * block.expansion
            setattr(self, f"layer{stage + 1}", blocks)
        self.num_channels = [c * block.expansion for c in widths[1:]]
        self.activation_checkpointing = False  # recompute layer2..layer4 in the backward (recompute.py)

    def __call__(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        outputs = []
        for stage in range(1, 5):
            blocks = getattr(self, f"layer{stage}")
            x = checkpointed(
                blocks,
                lambda x, blocks=blocks: _sequential(blocks, x),
                x,
                enabled=self.activation_checkpointing and stage > 1,
            )
            if stage >= 2:
                outputs.append(x)
        return outputs


def resize_mask(mask: mx.array, height: int, width: int) -> mx.array:
    """Nearest resize of a (B, H, W) bool mask, as `F.interpolate(mode="nearest")`."""
    rows = _nearest_indices(mask.shape[1], height)
    cols = _nearest_indices(mask.shape[2], width)
    return mask[:, rows][:, :, cols]


def _nearest_indices(size_in: int, size_out: int) -> mx.array:
    scale = np.float32(size_in) / np.float32(size_out)
    index = np.floor(np.arange(size_out, dtype=np.float32) * scale).astype(np.int32)
    return mx.array(np.minimum(index, size_in - 1))


class Backbone(nn.Module):
    """ResNet body; returns [(features (B, h, w, C), mask (B, h, w))] at strides 8/16/32, or the
    last only (`return_interm_layers=False`)."""

    def __init__(self, name: str, return_interm_layers: bool = True, dilation: bool = False, width: int = 64):
        super().__init__()
        self.body = ResNet(name, dilation, width)
        self.return_interm_layers = return_interm_layers
        strides = [8, 16, 16 if dilation else 32]
        self.strides = strides if return_interm_layers else strides[-1:]
        self.num_channels = self.body.num_channels if return_interm_layers else self.body.num_channels[-1:]

    def set_trainable(self, train: bool, freeze_stem_and_layer1: bool = True):
        """Which layers train: none (`train` False); all but the stem and layer1 (the authors'
        choice for an ImageNet-pretrained backbone); or all. Batch norm never trains."""
        self.body.unfreeze()
        for module in self.body.modules():
            if isinstance(module, FrozenBatchNorm2d):
                module.freeze()
        if not train:
            self.body.freeze()
        elif freeze_stem_and_layer1:
            self.body.conv1.freeze()
            for block in self.body.layer1:
                block.freeze()

    def __call__(self, images: mx.array, mask: mx.array):
        features = self.body(images)
        if not self.return_interm_layers:
            features = features[-1:]
        return [(x, resize_mask(mask, x.shape[1], x.shape[2])) for x in features]
