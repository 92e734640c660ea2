"""The ResNet and the input projections as ONNX (NCHW), mirroring models/backbone.py and models/deformable_detr.py.

Frozen batch norm is folded into the convolution before it: conv(x, W) * s + t with
s = weight / sqrt(running_var + eps) and t = bias - running_mean * s is conv(x, W * s) + t, one Conv
with a bias (float32 rounding differs from the MLX model's, well inside the tests' 1e-4)."""

import numpy as np

from ...models.backbone import ARCHITECTURES
from ...models.backbone_base import stages_returned
from ...models.backbones import maps_taken
from ..check import conv_size
from .builder import Graph

BODY = "backbone.0.body"


def conv(g: Graph, x: str, prefix: str, stride: int = 1, padding: int = 0, dilation: int = 1, bn: str | None = None):
    """A convolution of this port (weight OHWI, bias where it has one), with the frozen batch norm
    `bn` (a prefix) folded in."""
    weight = g.weight(f"{prefix}.weight").transpose(0, 3, 1, 2)  # OHWI -> OIHW
    bias = g.weights.get(f"{prefix}.bias")
    bias = np.zeros(weight.shape[0], np.float32) if bias is None else np.asarray(bias, np.float32)
    if bn is not None:
        scale = g.weight(f"{bn}.weight") / np.sqrt(g.weight(f"{bn}.running_var") + np.float32(1e-5))
        weight = weight * scale[:, None, None, None]
        bias = bias * scale + g.weight(f"{bn}.bias") - g.weight(f"{bn}.running_mean") * scale
    k = weight.shape[2]
    return g.Conv(
        x,
        g.const(weight, f"{prefix}.weight"),
        g.const(bias, f"{prefix}.bias"),
        kernel_shape=[k, k],
        strides=[stride, stride],
        pads=[padding] * 4,
        dilations=[dilation, dilation],
    )


def block(g: Graph, x: str, prefix: str, bottleneck: bool, stride: int, dilation: int) -> str:
    """A BasicBlock or Bottleneck (torchvision v1.5: the stride on the 3x3)."""
    if bottleneck:
        out = g.Relu(conv(g, x, f"{prefix}.conv1", bn=f"{prefix}.bn1"))
        out = g.Relu(conv(g, out, f"{prefix}.conv2", stride, dilation, dilation, bn=f"{prefix}.bn2"))
        out = conv(g, out, f"{prefix}.conv3", bn=f"{prefix}.bn3")
    else:
        out = g.Relu(conv(g, x, f"{prefix}.conv1", stride, dilation, dilation, bn=f"{prefix}.bn1"))
        out = conv(g, out, f"{prefix}.conv2", 1, dilation, dilation, bn=f"{prefix}.bn2")
    if f"{prefix}.downsample.0.weight" in g.weights:
        x = conv(g, x, f"{prefix}.downsample.0", stride, bn=f"{prefix}.downsample.1")
    return g.Relu(g.Add(out, x))


def resnet(g: Graph, images: str, model_cfg, size: tuple) -> list:
    """images (N, 3, H, W) -> [(features (N, C, h, w), (h, w))] of the stages the model returns (layer2..layer4;
    layer1 too with 4 maps), as ResNet."""
    kind, depths = ARCHITECTURES[model_cfg.backbone]
    h, w = (conv_size(s, 7, 2, 3) for s in size)
    x = g.Relu(conv(g, images, f"{BODY}.conv1", 2, 3, bn=f"{BODY}.bn1"))
    x = g.MaxPool(x, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    h, w = conv_size(h, 3, 2, 1), conv_size(w, 3, 2, 1)
    outputs, current_dilation, returned = [], 1, stages_returned(maps_taken(model_cfg))
    for stage, depth in enumerate(depths):
        stride = 1 if stage == 0 else 2
        previous_dilation = current_dilation
        if model_cfg.dilation and stage == 3:  # DC5
            current_dilation, stride = current_dilation * stride, 1
        for i in range(depth):
            first = i == 0
            dilation = previous_dilation if first else current_dilation
            x = block(g, x, f"{BODY}.layer{stage + 1}.{i}", kind == "bottleneck", stride if first else 1, dilation)
        h, w = conv_size(h, 3, stride, 1), conv_size(w, 3, stride, 1)
        if stage in returned:
            outputs.append((x, (h, w)))
    return outputs


def group_norm(g: Graph, x: str, prefix: str, channels: int, hw: tuple, groups: int = 32, eps: float = 1e-5) -> str:
    """GroupNorm (PyTorch's grouping: contiguous channels) of (N, C, h, w), decomposed into
    ReduceMean and elementwise ops: opset 18's GroupNormalization scales per group, not per
    channel (fixed in 21, which few runtimes have)."""
    batch = -1
    grouped = g.reshape(x, (batch, groups, channels // groups * hw[0] * hw[1]))
    centred = g.Sub(grouped, g.ReduceMean(grouped, axes=[2], keepdims=1))
    variance = g.ReduceMean(g.Mul(centred, centred), axes=[2], keepdims=1)
    normalised = g.Div(centred, g.Sqrt(g.Add(variance, g.scalar(eps))))
    normalised = g.reshape(normalised, (batch, channels, hw[0], hw[1]))
    scale = g.const(g.weight(f"{prefix}.weight").reshape(-1, 1, 1), f"{prefix}.weight")
    return g.Add(g.Mul(normalised, scale), g.const(g.weight(f"{prefix}.bias").reshape(-1, 1, 1), f"{prefix}.bias"))


def input_projections(g: Graph, features: list, num_levels: int, hidden_dim: int) -> list:
    """[(features, (h, w))] -> [(src (N, d, h, w), (h, w))] for every level: a 1x1 convolution and
    group norm per backbone level, then 3x3 stride-2 convolutions for the extra levels."""
    srcs = []
    for level, (x, hw) in enumerate(features):
        srcs.append((group_norm(g, conv(g, x, f"input_proj.{level}.0"), f"input_proj.{level}.1", hidden_dim, hw), hw))
    below, hw = features[-1]
    for level in range(len(features), num_levels):
        hw = (conv_size(hw[0], 3, 2, 1), conv_size(hw[1], 3, 2, 1))
        projected = conv(g, below, f"input_proj.{level}.0", 2, 1)
        below = group_norm(g, projected, f"input_proj.{level}.1", hidden_dim, hw)
        srcs.append((below, hw))
    return srcs
