"""H-Deformable-DETR's own code (github.com/HDETR/H-Deformable-DETR), imported from a checkout, on the CPU with
the pure-PyTorch attention core, as the authors' references were made. Only the reference scripts
(tests/make_hdetr_reference.py) use it; the tests read what those wrote.

What their code imports and this environment lacks gets a small stand-in, each documented below:
- torchvision (PyPI's build is a CUDA one whose C ops fail to register beside CPU torch): the ResNet of
  `torchvision.models` (the same modules and parameter names; ImageNet weights are never downloaded:
  the weights come from the recipe) and `IntermediateLayerGetter`, `ops.misc.interpolate`.
- MultiScaleDeformableAttention (their CUDA extension): `MSDeformAttnFunction.apply` becomes their own
  `ms_deform_attn_core_pytorch` (models/ops/functions/ms_deform_attn_func.py), the core their tests
  compare the CUDA kernel with.
- main.py and engine.py import their data pipeline (torchvision's transforms and datasets) and wandb: the two
  functions used here, main.py's `get_args_parser` and engine.py's `train_hybrid`, are read from their
  files alone (`_function`).
- timm, mmcv, mmdet (imported by their Swin backbone for DropPath, to_2tuple, trunc_normal_ and
  checkpoint loading): the three small functions, and loaders that are never called."""

import argparse
import ast
import collections.abc
import copy
import sys
import types
from collections import OrderedDict
from pathlib import Path

import torch.nn.functional as F
from torch import nn

HDETR_COMMIT = "f58ceb1165da4b0cd10e9a5a30c7a77fbd33f492"  # the checkout the references were made with


class Bottleneck(nn.Module):
    """torchvision's ResNet v1.5 bottleneck (the stride on the 3x3), its names."""

    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None, dilation=1, norm_layer=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = norm_layer(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, padding=dilation, dilation=dilation, bias=False)
        self.bn2 = norm_layer(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = norm_layer(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(nn.Module):
    """torchvision.models.ResNet with bottlenecks, its names (conv1, bn1, layer1..4, fc)."""

    def __init__(self, layers, replace_stride_with_dilation=(False, False, False), norm_layer=None):
        super().__init__()
        self.inplanes, self.dilation, self.norm_layer = 64, 1, norm_layer
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = norm_layer(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], 2, replace_stride_with_dilation[0])
        self.layer3 = self._make_layer(256, layers[2], 2, replace_stride_with_dilation[1])
        self.layer4 = self._make_layer(512, layers[3], 2, replace_stride_with_dilation[2])
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, 1000)

    def _make_layer(self, planes, blocks, stride=1, dilate=False):
        previous_dilation = self.dilation
        if dilate:
            self.dilation, stride = self.dilation * stride, 1
        downsample = None
        if stride != 1 or self.inplanes != planes * 4:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * 4, 1, stride, bias=False), self.norm_layer(planes * 4)
            )
        layers = [Bottleneck(self.inplanes, planes, stride, downsample, previous_dilation, self.norm_layer)]
        self.inplanes = planes * 4
        layers += [
            Bottleneck(self.inplanes, planes, dilation=self.dilation, norm_layer=self.norm_layer)
            for _ in range(1, blocks)
        ]
        return nn.Sequential(*layers)


def _resnet(layers):
    def build(replace_stride_with_dilation=(False, False, False), pretrained=False, norm_layer=None):
        return ResNet(layers, replace_stride_with_dilation, norm_layer)  # pretrained ignored: recipe weights

    return build


class IntermediateLayerGetter(nn.ModuleDict):
    """torchvision.models._utils.IntermediateLayerGetter: the children up to the last returned one."""

    def __init__(self, model, return_layers):
        wanted, layers = dict(return_layers), OrderedDict()
        remaining = set(wanted)
        for name, module in model.named_children():
            layers[name] = module
            remaining.discard(name)
            if not remaining:
                break
        super().__init__(layers)
        self.return_layers = wanted

    def forward(self, x):
        out = OrderedDict()
        for name, module in self.items():
            x = module(x)
            if name in self.return_layers:
                out[self.return_layers[name]] = x
        return out


def _module(name, **attributes):
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def _stand_ins():
    models = _module("torchvision.models", resnet50=_resnet([3, 4, 6, 3]), resnet101=_resnet([3, 4, 23, 3]))
    models._utils = _module("torchvision.models._utils", IntermediateLayerGetter=IntermediateLayerGetter)
    ops = _module("torchvision.ops")
    ops.misc = _module("torchvision.ops.misc", interpolate=F.interpolate)
    ops.boxes = _module("torchvision.ops.boxes", box_area=lambda b: (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]))
    _module("torchvision", __version__="0.16.0", models=models, ops=ops)
    _module("MultiScaleDeformableAttention")

    def to_2tuple(x):
        return tuple(x) if isinstance(x, collections.abc.Iterable) else (x, x)

    class DropPath(nn.Module):
        def __init__(self, drop_prob=0.0):
            super().__init__()
            self.drop_prob = drop_prob

        def forward(self, x):
            if self.drop_prob == 0.0 or not self.training:
                return x
            keep = 1 - self.drop_prob
            mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
            return x * mask / keep

    layers = _module("timm.models.layers", DropPath=DropPath, to_2tuple=to_2tuple, trunc_normal_=nn.init.trunc_normal_)
    _module("timm", models=_module("timm.models", layers=layers))

    def never(*args, **kwargs):
        raise RuntimeError("the reference scripts load no pretrained weights")

    _module("mmcv_custom", load_checkpoint=never)
    _module("mmdet", utils=_module("mmdet.utils", get_root_logger=lambda *a, **k: None))


def import_hdetr(checkout: Path):
    """Their `models` package (build) and `util.misc`, from `checkout`, with the stand-ins above."""
    checkout = Path(checkout).resolve()
    if not (checkout / "models" / "deformable_detr.py").is_file():
        raise SystemExit(f"{checkout}: not a checkout of HDETR/H-Deformable-DETR (no models/deformable_detr.py)")
    _stand_ins()
    sys.path.insert(0, str(checkout))
    import models
    from models.ops.functions import ms_deform_attn_func
    from models.ops.modules import ms_deform_attn

    class PyTorchCore:
        @staticmethod
        def apply(value, shapes, level_start_index, locations, weights, im2col_step):
            return ms_deform_attn_func.ms_deform_attn_core_pytorch(value, shapes, locations, weights)

    ms_deform_attn.MSDeformAttnFunction = PyTorchCore
    models.checkout = checkout
    return models


def _function(path: Path, name: str, **namespace):
    """The function `name` defined at the top of the Python file `path`, run in `namespace` (the
    names it uses), without running the rest of the file (its imports)."""
    tree = ast.parse(path.read_text())
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name]
    if not found:
        raise SystemExit(f"{path}: no function {name}")
    exec(compile(ast.Module(found, type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


def train_hybrid(models):
    """Their engine.py's `train_hybrid(outputs, targets, k_one2many, criterion, lambda_one2many)`."""
    return _function(models.checkout / "engine.py", "train_hybrid", copy=copy)


def hdetr_args(models, **changes):
    """Their main.py's argparse defaults (parsed from an empty command line), with `changes`."""
    import numpy as np

    parser = _function(models.checkout / "main.py", "get_args_parser", argparse=argparse, np=np)
    args = parser().parse_args([])
    for key, value in changes.items():
        if not hasattr(args, key):
            raise KeyError(f"H-Deformable-DETR's main.py has no argument {key}")
        setattr(args, key, value)
    return args
