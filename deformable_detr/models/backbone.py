"""ResNet backbone with frozen batch norm, returning feature maps and their padding masks.

Channels-last throughout: images (B, H, W, 3), features (B, h, w, C). Parameter paths follow
torchvision's ResNet under `backbone.0.body` (the authors' `Joiner`), so their checkpoints map key
for key.
"""

import kernels

import mlx.nn as nn

from .backbone_base import STAGE_STRIDES, BackboneBase, stages_returned
from .convolution import Conv2d
from .precision import FrozenBatchNorm2d
from .recompute import checkpointed

# name -> (block, blocks per stage)
ARCHITECTURES = {
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet34": ("basic", (3, 4, 6, 3)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
    "resnet101": ("bottleneck", (3, 4, 23, 3)),
}


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
        if downsample is not None:
            self.downsample = downsample

    def __call__(self, x):
        out = self.conv1.with_batch_norm(x, self.bn1, relu=True)
        identity = _downsampled(self, x)
        return self.conv2.with_batch_norm(out, self.bn2, residual=identity, relu=True)


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
        if downsample is not None:
            self.downsample = downsample

    def __call__(self, x):
        out = self.conv1.with_batch_norm(x, self.bn1, relu=True)
        out = self.conv2.with_batch_norm(out, self.bn2, relu=True)
        identity = _downsampled(self, x)
        return self.conv3.with_batch_norm(out, self.bn3, residual=identity, relu=True)


def _downsampled(block, x):
    """A block's identity: x, or its downsample (a 1 x 1 convolution and its frozen batch norm) of x."""
    if "downsample" not in block:
        return x
    convolution, norm = block.downsample
    return convolution.with_batch_norm(x, norm)


def _sequential(layers, x):
    for layer in layers:
        x = layer(x)
    return x


class ResNet(nn.Module):
    """torchvision's ResNet without the classifier; returns the outputs of the layers of `stages` (0: layer1, ...,
    3: layer4; layer2..layer4 by default), finest first."""

    def __init__(self, name: str, dilation: bool = False, width: int = 64, stages: tuple[int, ...] = (1, 2, 3)):
        super().__init__()
        if name not in ARCHITECTURES:
            raise ValueError(f"unknown backbone {name!r}; expected one of {', '.join(ARCHITECTURES)}")
        kind, depths = ARCHITECTURES[name]
        block = Bottleneck if kind == "bottleneck" else BasicBlock
        widths = (width, 2 * width, 4 * width, 8 * width)  # torchvision: width 64
        self.conv1 = Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = FrozenBatchNorm2d(width)
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
        self.stages = tuple(stages)
        self.num_channels = [widths[i] * block.expansion for i in self.stages]
        self.activation_checkpointing = False  # recompute layer2..layer4 in the backward (recompute.py)

    def __call__(self, images):
        """The maps of `stages`, each convolution handing the next its result as it wants it: bfloat16 where their
        products run in bfloat16 (Conv2d.with_batch_norm), and so the maps (the detector's input projections take
        them as they are and give the images' dtype back)."""
        x = self.conv1.with_batch_norm(images, self.bn1, relu=True)
        pooled = kernels.onednn.max_pool2d(x, 3, 2, 1)  # self.maxpool's, on every core where oneDNN runs
        x = self.maxpool(x) if pooled is None else pooled
        outputs = []
        for stage in range(1, 5):
            blocks = getattr(self, f"layer{stage}")
            x = checkpointed(
                blocks,
                lambda x, blocks=blocks: _sequential(blocks, x),
                x,
                enabled=self.activation_checkpointing and stage > 1,
            )
            if stage - 1 in self.stages:
                outputs.append(x)
        return outputs


class Backbone(BackboneBase):
    """ResNet body; returns [(features (B, h, w, C), mask (B, h, w))] of its last `maps`: layer4's (1), layer2..4's
    at strides 8/16/32 (3; DC5: 8/16/16), or layer1..4's at 4/8/16/32 (4: DINO's 5-scale)."""

    def __init__(self, name: str, maps: int = 3, dilation: bool = False, width: int = 64):
        stages = stages_returned(maps)
        strides = [STAGE_STRIDES[i] for i in stages]
        if dilation:  # DC5: the last stage dilated, not strided
            strides[-1] = strides[-2]
        super().__init__(ResNet(name, dilation, width, stages), maps, tuple(strides))

    def set_trainable(self, train: bool, freeze_stem_and_layer1: bool = True):
        """Which layers train: none (`train` False); all but the stem and layer1 (the authors'
        choice for an ImageNet-pretrained backbone, and DINO's, even where layer1's map is a level); or all.
        Batch norm never trains."""
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
