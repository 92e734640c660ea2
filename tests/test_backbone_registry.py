"""The backbones' registry (models/backbones.py): every family builds each of its names as a `BackboneBase`
whose maps are where its strides and channels say, and every name is told back from its parameters by
weights/backbones.py's readers (so a family without a reader fails here)."""

import math

from deformable_detr.config import ModelConfig
from deformable_detr.models.backbone_base import BackboneBase
from deformable_detr.models.backbones import BACKBONES, backbone_family, backbone_names, build_backbone
from deformable_detr.models.convolution import Conv2d
from deformable_detr.models.swin import SWIN_ARCHITECTURES, bias_table_rows, window_of
from deformable_detr.weights.backbones import READERS, backbone_family_in, backbone_in

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten


@pytest.mark.parametrize("family", list(BACKBONES))
@pytest.mark.parametrize("levels", [4, 1])
def test_each_family_builds_a_backbone_whose_maps_are_at_its_strides(family, levels):
    name = BACKBONES[family].names[0]
    backbone = build_backbone(ModelConfig(backbone=name, num_feature_levels=levels))
    assert isinstance(backbone, BACKBONES[family].backbone) and isinstance(backbone, BackboneBase)
    expected_strides = list(BackboneBase.STRIDES) if levels > 1 else [BackboneBase.STRIDES[-1]]
    assert backbone.strides == expected_strides and len(backbone.num_channels) == len(expected_strides)
    backbone.eval()
    height, width = 70, 45
    mask = mx.zeros((2, height, width), dtype=mx.bool_)
    mask[1, :, 30:] = True  # the second image 30 px wide, padded
    outputs = backbone(mx.random.normal((2, height, width, 3)), mask)
    assert len(outputs) == len(expected_strides)
    for (features, level_mask), stride, channels in zip(outputs, backbone.strides, backbone.num_channels, strict=True):
        assert features.shape == (2, math.ceil(height / stride), math.ceil(width / stride), channels)
        rows, cols = (
            np.floor(np.arange(n) * (size / n)).astype(int)
            for n, size in zip(features.shape[1:3], mask.shape[1:], strict=True)
        )
        np.testing.assert_array_equal(np.array(level_mask), np.array(mask)[:, rows][:, :, cols])  # nearest, as torch


def test_dc5_moves_the_last_stride_and_only_resnets_take_it():
    dc5 = build_backbone(ModelConfig(backbone="resnet18", dilation=True))
    assert dc5.strides == [8, 16, 16]
    assert [family for family, entry in BACKBONES.items() if entry.dilation] == ["resnet"]


def test_every_name_has_one_family_and_is_told_back_from_its_parameters():
    names = backbone_names()
    assert len(names) == len(set(names)) and set(SWIN_ARCHITECTURES) <= set(names) and "resnet50" in names
    assert READERS.keys() == BACKBONES.keys()  # a family needs a reader of its checkpoints
    for name in names:
        family = backbone_family(name)
        assert name in BACKBONES[family].names
        # shapes only: MLX builds the weights lazily, nothing is computed
        body = build_backbone(ModelConfig(backbone=name)).body
        state = {f"backbone.0.body.{k}": v for k, v in tree_flatten(body.parameters())}
        state["input_proj.0.0.weight"] = mx.zeros((1,))  # not the backbone's
        assert backbone_in(state) == name
        assert backbone_family_in({k.removeprefix("backbone.0.body."): v for k, v in state.items()}) == family
    assert backbone_family("resnet51") is None and backbone_in({"class_embed.0.bias": np.zeros(3)}) == "unknown"


def test_every_convolution_is_the_one_conv2d():
    for name in ("resnet18", "swin_tiny"):
        body = build_backbone(ModelConfig(backbone=name)).body
        convolutions = [m for _, m in body.named_modules() if "Conv2d" in type(m).__name__]
        assert convolutions and all(type(m) is Conv2d for m in convolutions)


def test_the_window_is_read_back_from_its_bias_table():
    for window in range(1, 13):
        assert window_of(np.zeros((bias_table_rows(window), 3))) == window
