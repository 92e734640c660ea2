"""DINO's backbones: 4 maps (model.backbone_maps 4, DINO's 5-scale) from a ResNet and a Swin, against the 3 maps
of the same weights and against DINO's own Swin (fixtures/dino_backbone, made by make_dino_backbone_reference.py
with their code); DINO's backbone names and state keys read both ways (weights/backbones.py)."""

import json
import math
from functools import cache
from pathlib import Path

from deformable_detr.config import ModelConfig
from deformable_detr.errors import ConversionError
from deformable_detr.models.backbone import Backbone
from deformable_detr.models.backbones import build_backbone
from deformable_detr.models.swin import SWIN_ARCHITECTURES, SwinBackbone, is_buffer
from deformable_detr.weights.backbones import (
    BODY,
    DINO_BACKBONES,
    backbone_from_dino,
    backbone_in_dino,
    backbone_to_dino,
    key_from_dino,
    key_to_dino,
)
from deformable_detr.weights.swin import swin_buffers

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from reference_weights import recipe_value
from safetensors.numpy import load_file

FIXTURE = Path(__file__).parent / "fixtures" / "dino_backbone"
OUTPUT_TOLERANCE = dict(rtol=1e-4, atol=1e-4)  # float32 on a CPU, as test_swin.py
GRADIENT_TOLERANCE = 1e-3  # of the largest magnitude of each gradient, as test_swin.py


@cache
def manifest() -> dict:
    return json.loads((FIXTURE / "manifest.json").read_text())


@cache
def reference() -> dict:
    return load_file(str(FIXTURE / "reference.safetensors"))


def images_and_mask(height=70, width=45):
    mask = mx.zeros((2, height, width), dtype=mx.bool_)
    mask[1, :, 30:] = True  # the second image 30 px wide, padded
    return mx.random.normal((2, height, width, 3), key=mx.random.key(1)), mask


@pytest.mark.parametrize(
    "name, dilation, strides, channels",
    [
        ("resnet50", False, [4, 8, 16, 32], [256, 512, 1024, 2048]),
        ("resnet50", True, [4, 8, 16, 16], [256, 512, 1024, 2048]),  # DC5: the last stage dilated
        ("swin_tiny", False, [4, 8, 16, 32], [96, 192, 384, 768]),
    ],
)
def test_four_maps_add_the_stride_4_map_to_the_three_bit_for_bit(name, dilation, strides, channels):
    four = build_backbone(ModelConfig(backbone=name, dilation=dilation, backbone_maps=4, num_feature_levels=5))
    three = build_backbone(ModelConfig(backbone=name, dilation=dilation, num_feature_levels=4))
    assert (four.strides, four.num_channels) == (strides, channels)
    assert (three.strides, three.num_channels) == (strides[1:], channels[1:])
    theirs = dict(tree_flatten(three.parameters()))
    ours = dict(tree_flatten(four.parameters()))
    # the same parameters (Swin's stage 0 adds its norm0, as DINO's out_indices (0, 1, 2, 3) build it)
    assert set(ours) - set(theirs) == ({"body.norm0.weight", "body.norm0.bias"} if name == "swin_tiny" else set())
    four.load_weights([(k, theirs.get(k, v)) for k, v in ours.items()], strict=True)
    four.eval()
    three.eval()
    images, mask = images_and_mask()
    maps, shared = four(images, mask), three(images, mask)
    for (features, level_mask), stride, width in zip(maps, strides, channels, strict=True):
        assert features.shape == (2, math.ceil(70 / stride), math.ceil(45 / stride), width)
        rows, cols = (
            np.floor(np.arange(n) * (size / n)).astype(int)
            for n, size in zip(features.shape[1:3], (70, 45), strict=True)
        )
        np.testing.assert_array_equal(np.array(level_mask), np.array(mask)[:, rows][:, :, cols])  # nearest, as torch
    for (got, got_mask), (want, want_mask) in zip(maps[1:], shared, strict=True):
        assert np.array_equal(np.array(got), np.array(want)) and np.array_equal(np.array(got_mask), np.array(want_mask))
    one = build_backbone(ModelConfig(backbone=name, dilation=dilation, num_feature_levels=1))
    assert (one.strides, one.num_channels) == (strides[-1:], channels[-1:])


def test_a_resnet_keeps_its_stem_and_layer1_frozen_when_layer1_is_a_map():
    """DINO's BackboneBase trains only the parameters of layer2..layer4, whatever maps it returns."""
    four, three = Backbone("resnet18", maps=4), Backbone("resnet18", maps=3)
    for backbone in (four, three):
        backbone.set_trainable(True)
    trained = [k for k, _ in tree_flatten(four.trainable_parameters())]
    assert trained == [k for k, _ in tree_flatten(three.trainable_parameters())]
    assert trained and all(k.split(".")[1] in ("layer2", "layer3", "layer4") for k in trained)
    assert not any(k.endswith(("running_mean", "running_var")) for k in trained)  # batch norm's statistics
    images, mask = images_and_mask(32, 32)

    def loss(model):
        return sum((features * features).sum() for features, _ in model(images, mask))

    gradients = dict(tree_flatten(nn.value_and_grad(four, loss)(four)[1]))
    assert set(gradients) == set(trained)  # layer1's map feeds the loss; layer1 gets no gradient
    swin = SwinBackbone("swin_tiny", maps=4)
    swin.set_trainable(True)
    assert len(tree_flatten(swin.trainable_parameters())) == len(tree_flatten(swin.parameters()))  # DINO: all


def dino_swin() -> SwinBackbone:
    """Our swin_tiny of 4 maps with the fixture's weights, read from DINO's keys (key_from_dino)."""
    model = SwinBackbone(backbone_from_dino("swin_T_224_1k"), maps=4)
    weights = []
    for key, shape in manifest()["cases"]["swin_tiny_5scale"]["state_dict"].items():
        if is_buffer(key):
            continue
        value = recipe_value(key, tuple(shape), manifest()["seed"])
        value = value.transpose(0, 2, 3, 1) if value.ndim == 4 else value  # OIHW -> OHWI
        weights.append((key_from_dino(key, "swin_tiny").removeprefix("backbone.0."), mx.array(value)))
    model.load_weights(weights, strict=True)
    return model


def test_swin_of_four_maps_matches_dinos():
    """Their SwinTransformer of return_interm_indices [0, 1, 2, 3]: the four maps, their masks and gradients."""
    model = dino_swin()
    model.eval()
    case = manifest()["cases"]["swin_tiny_5scale"]
    assert case["num_channels"] == model.num_channels and case["return_interm_indices"] == [0, 1, 2, 3]
    images = mx.array(reference()["images"].transpose(0, 2, 3, 1))
    mask = mx.array(reference()["mask"].astype(bool))
    cotangents = [
        mx.array(recipe_value(f"cotangent.{i}", reference()[f"out{i}"].shape, manifest()["seed"]).transpose(0, 2, 3, 1))
        for i in range(4)
    ]

    def objective(model):
        out = model(images, mask)
        return sum((features * c).sum() for (features, _), c in zip(out, cotangents, strict=True)), out

    (total, out), grads = nn.value_and_grad(model, objective)(model)
    for i, (features, level_mask) in enumerate(out):
        expected = reference()[f"out{i}"].transpose(0, 2, 3, 1)
        np.testing.assert_allclose(np.array(features), expected, **OUTPUT_TOLERANCE, err_msg=f"out{i}")
        np.testing.assert_array_equal(np.array(level_mask), reference()[f"mask{i}"].astype(bool))
    assert float(total) == pytest.approx(case["objective"], rel=1e-5)
    grads = dict(tree_flatten(grads))
    for key in case["gradients"]:  # their Joiner's keys: 0.<SwinTransformer's>
        ours = np.array(grads[key_from_dino("backbone." + key, "swin_tiny").removeprefix("backbone.0.")])
        ours = ours.transpose(0, 3, 1, 2) if ours.ndim == 4 else ours
        expected = reference()[f"grad.{key}"]
        atol = GRADIENT_TOLERANCE * np.abs(expected).max()
        np.testing.assert_allclose(ours, expected, rtol=GRADIENT_TOLERANCE, atol=atol, err_msg=key)


@pytest.mark.parametrize("case, name", [("swin_tiny_5scale", "swin_tiny"), ("resnet50_5scale", "resnet50")])
def test_dinos_state_keys_are_ours_and_back(case, name):
    """Every key of DINO's backbone (their Joiner's state, buffers too) -> ours, our 4-map backbone's exactly
    and of its shapes (convolutions OHWI here); ours -> DINO's, with the Swin's buffers rebuilt, theirs exactly."""
    theirs = manifest()["cases"][case]["state_dict"]
    assert backbone_from_dino(manifest()["cases"][case]["dino_backbone"]) == name
    ours = {
        BODY + k: v.shape
        for k, v in tree_flatten(
            build_backbone(ModelConfig(backbone=name, backbone_maps=4, num_feature_levels=5)).body.parameters()
        )
    }
    mapped = {key_from_dino(k, name): tuple(s) for k, s in theirs.items() if not is_buffer(k)}
    assert mapped.keys() == ours.keys()
    for key, shape in ours.items():
        assert mapped[key] == ((shape[0], shape[3], *shape[1:3]) if len(shape) == 4 else shape), key
    back = {key_to_dino(k, name): np.zeros(s, np.float32) for k, s in mapped.items()}
    back.update(swin_buffers(back))
    assert {k: list(v.shape) for k, v in back.items()} == theirs
    assert (
        backbone_in_dino(back) == name and backbone_in_dino({"class_embed.0.bias": back[next(iter(back))]}) == "unknown"
    )
    assert key_from_dino("transformer.level_embed", name) == "transformer.level_embed"  # not the backbone's


def test_swin_buffers_are_dinos():
    swin = SwinBackbone("swin_tiny", maps=4)
    state = {key_to_dino(BODY + k, "swin_tiny"): np.array(v) for k, v in tree_flatten(swin.body.parameters())}
    buffers = swin_buffers(state)
    assert len(buffers) == 12 and all(v.dtype == np.int64 for v in buffers.values())
    index = buffers["backbone.0.layers.2.blocks.5.attn.relative_position_index"]
    assert (
        index.shape == (49, 49) and index[0, 0] == 84 and index[0, 48] == 0 and index[48, 0] == 168
    )  # (7 - 1) * 13 + 6


def test_dinos_backbone_names_are_our_architectures_both_ways():
    """Each of DINO's Swin names is the architecture of ours it maps to (their build_swin_transformer's embed_dim,
    depths, num_heads, window_size and the pretrain_img_size of the name); every name reads back both ways."""
    for dino, built in manifest()["architectures"].items():
        ours = SWIN_ARCHITECTURES[backbone_from_dino(dino)]
        assert (ours.embed_dim, list(ours.depths), list(ours.num_heads), ours.window_size) == (
            built["embed_dim"],
            built["depths"],
            built["num_heads"],
            built["window_size"],
        ), dino
        assert ours.pretrain_img_size == built["pretrain_img_size"], dino
    assert {k for k in DINO_BACKBONES if k.startswith("swin")} == set(manifest()["architectures"])
    for dino, ours in DINO_BACKBONES.items():
        assert backbone_to_dino(backbone_from_dino(dino)) == dino and backbone_from_dino(backbone_to_dino(ours)) == ours
    with pytest.raises(ConversionError, match="DINO's backbone convnext_xlarge_22k is not built here"):
        backbone_from_dino("convnext_xlarge_22k")
    with pytest.raises(ConversionError, match="model.backbone swin_small: DINO's code builds no such backbone"):
        backbone_to_dino("swin_small")
