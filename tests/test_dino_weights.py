"""DINO's checkpoints both ways (weights/dino.py): its main.py's state_dict and args to this port's weights and
model options, back to a state_dict and args their code loads strict; detrex's names as a second layout; a one-line
refusal for each thing of theirs not built here.

Their keys come from tests/fixtures/dino/state_keys.json (made by tests/make_dino_keys.py from DINO's own code:
R50 4-scale and 5-scale, Swin-T 4-scale, with a small transformer); the values here are random, a tied copy the
same array as its original, as their model's state_dict holds it. With DINO_CHECKOUT set to a checkout of
IDEA-Research/DINO, their own model is built on the CPU too (tests/dino_code.py) and loads the export strict."""

import argparse
import json
import os
import re
from functools import cache
from pathlib import Path

from deformable_detr.errors import ConversionError
from deformable_detr.weights import dino

import numpy as np
import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "dino" / "state_keys.json"
VARIANTS = ("r50_4scale", "r50_5scale", "swin_t_4scale")
SHARED = re.compile(r"^(transformer\.decoder\.)?(class_embed|bbox_embed)\.(\d+)\.(.*)$")


@cache
def fixture() -> dict:
    return json.loads(FIXTURE.read_text())


def their_state(variant: str, seed: int = 0) -> dict:
    """A state_dict of DINO's model for `variant` (its keys, shapes and dtypes), random values; the shared heads
    one array under every name (dec_pred_*_embed_share), the Swin's index buffers as their model computes them."""
    rng = np.random.default_rng(seed)
    state = {}
    for key, (shape, dtype) in fixture()["variants"][variant]["state"].items():
        shared = SHARED.match(key)
        if shared:
            original = f"{shared[2]}.0.{shared[4]}"
            state[key] = state.setdefault(original, rng.standard_normal(shape).astype(np.float32))
        elif dtype == "int64":  # relative_position_index: their block's, from the window
            window = int(round(np.sqrt(shape[0])))
            coords = np.stack(np.meshgrid(np.arange(window), np.arange(window), indexing="ij")).reshape(2, -1)
            relative = (coords[:, :, None] - coords[:, None, :]).transpose(1, 2, 0) + (window - 1)
            state[key] = (relative[..., 0] * (2 * window - 1) + relative[..., 1]).astype(np.int64)
        else:
            state[key] = rng.standard_normal(shape).astype(np.float32)
    return state


def their_args(variant: str, **changes) -> dict:
    """Their main.py's args (as a dict) for `variant`: DINO_4scale.py's values with the fixture's changes."""
    return {**dino.DINO_ARGS, **fixture()["changes"], **fixture()["variants"][variant]["changes"], **changes}


def parameter_names(state: dict) -> dict:
    """The brief's MLX parameter names of DINO's state: its keys less the tied copies (class_embed.1-5,
    bbox_embed.1-5, the decoder's references) and buffers (a Swin's relative_position_index), the Swin under
    backbone.0.body -> {name: shape}, convolutions OHWI."""
    names = {}
    for key, value in state.items():
        shared = SHARED.match(key)
        if (shared and (shared[1] or shared[3] != "0")) or key.endswith("relative_position_index"):
            continue
        if key.startswith("backbone.0.") and not key.startswith("backbone.0.body."):
            key = "backbone.0.body." + key.removeprefix("backbone.0.")
        shape = value.shape
        names[key] = (shape[0], shape[2], shape[3], shape[1]) if len(shape) == 4 else shape
    return names


@pytest.mark.parametrize("variant", VARIANTS)
def test_their_state_maps_to_the_parameter_names_and_back_bit_for_bit(variant):
    state = their_state(variant)
    expected = parameter_names(state)
    weights = dino.sanitize(state, expected, variant)  # every key and shape checked against `expected`
    assert len(weights) == len(expected) < len(state)
    conv = "backbone.0.body.conv1.weight" if variant.startswith("r50") else "backbone.0.body.patch_embed.proj.weight"
    np.testing.assert_array_equal(
        weights[conv], state[conv.replace("body.", "") if "patch" in conv else conv].transpose(0, 2, 3, 1)
    )
    back = dino.to_dino(weights)
    assert back.keys() == state.keys()
    for key, value in state.items():
        assert back[key].dtype == value.dtype and np.array_equal(back[key], value), key


@pytest.mark.parametrize("variant", VARIANTS)
def test_their_args_give_the_model_options(variant):
    options = dino.model_options(their_state(variant), their_args(variant))
    five = variant == "r50_5scale"
    assert options == {
        "architecture": "dino",
        "two_stage": True,
        "with_box_refine": True,
        "mixed_selection": True,
        "look_forward_twice": True,
        "backbone": "swin_tiny" if variant.startswith("swin") else "resnet50",
        **({} if variant.startswith("swin") else {"backbone_width": 64}),
        "backbone_maps": 4 if five else 3,
        "num_feature_levels": 5 if five else 4,
        "dilation": False,
        "hidden_dim": 64,
        "dim_feedforward": 128,
        "enc_layers": 2,
        "dec_layers": 3,
        "nheads": 8,
        "enc_n_points": 4,
        "dec_n_points": 4,
        "num_queries": 30,
        "num_classes": 5,
        "dropout": 0.0,
        "position_temperature": 20.0,
        "position_offset": 0.0,
        "decoder_heads": "auto",
        "dn_number": 100,
        "dn_label_noise_ratio": 0.5,
        "dn_box_noise_scale": 0.4,
        "dn_labelbook_size": 5,
    }
    assert dino.config_for(options) == ("dino_r50_5scale_12ep.yaml" if five else "dino_r50_4scale_12ep.yaml")
    swin_large = {**options, "backbone": "swin_large_window12"}
    assert dino.config_for(swin_large) == (
        "dino_swin_large_5scale_12ep.yaml" if five else "dino_swin_large_4scale_12ep.yaml"
    )


def test_args_the_state_cannot_show():
    state = their_state("r50_4scale")
    args = their_args("r50_4scale", pe_temperatureH=10000, pe_temperatureW=10000, use_dn=False, nheads=4)
    args.update(enc_n_points=2, dn_box_noise_scale=1.0, dilation=True)
    options = dino.model_options(state, args)
    assert (options["position_temperature"], options["dn_number"], options["nheads"]) == (10000.0, 0, 4)
    assert (options["enc_n_points"], options["dn_box_noise_scale"], options["dilation"]) == (2, 1.0, True)
    bare = dino.model_options(state, {})  # a bare state_dict: DINO's configs' values for what keys cannot show
    assert (bare["position_temperature"], bare["dn_number"], bare["dropout"]) == (20.0, 100, 0.0)
    assert "nheads" not in bare and "enc_n_points" not in bare  # ModelConfig's defaults, 8 and 4, are DINO's
    assert bare["num_queries"] == 30 and bare["dn_labelbook_size"] == 5 and bare["backbone_maps"] == 3


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"masks": True}, r"DINO's segmentation head \(masks\): not built"),
        ({"backbone": "convnext_xlarge_22k"}, r"DINO's backbone convnext_xlarge_22k is not built here"),
        ({"dec_pred_class_embed_share": False}, r"box heads per layer, or the other way .*: not built"),
        ({"dec_pred_bbox_embed_share": False}, r"box heads per layer, or the other way .*: not built"),
        ({"two_stage_type": "no"}, r"a two_stage_type other than standard: not built \(args.two_stage_type = 'no'\)"),
        ({"num_patterns": 3}, r"query patterns"),
        ({"decoder_sa_type": "ca_label"}, r"self-attention other than sa"),
        ({"two_stage_add_query_num": 100}, r"two_stage_add_query_num > 0"),
        ({"dec_layer_number": [900, 300, 300]}, r"dec_layer_number"),
        ({"add_channel_attention": True}, r"channel attention"),
        ({"pe_temperatureW": 10000}, r"temperatures 20 \(y\) and 10000 \(x\): not built"),
        ({"position_embedding": "learned"}, r"learned position embedding: not built"),
        ({"nms_iou_threshold": 0.8}, r"non-maximum suppression"),
        ({"return_interm_indices": [0, 1, 2, 3]}, r"maps \[0, 1, 2, 3\]; its weights project 3"),
        ({"backbone": "resnet101"}, r"args name the backbone resnet101; its weights hold a resnet50"),
    ],
)
def test_what_is_not_built_is_refused_in_one_line(changes, message):
    with pytest.raises(ConversionError, match=r"^ckpt\.pth: .*" + message) as error:
        dino.model_options(their_state("r50_4scale"), their_args("r50_4scale", **changes), "ckpt.pth")
    assert "\n" not in str(error.value)


def test_heads_per_layer_are_read_and_a_differing_copy_refused():
    """Heads per layer (dec_pred_*_embed_share False), without args: their values tell; a tied copy that differs
    from its original is refused."""
    state = their_state("r50_4scale")
    state["class_embed.1.bias"] = state["class_embed.1.bias"] + 1
    state["transformer.decoder.class_embed.1.bias"] = state["class_embed.1.bias"]
    assert dino.model_options(state, {})["decoder_heads"] == "per_layer"
    state = their_state("r50_4scale")
    state["transformer.decoder.bbox_embed.2.layers.0.bias"] = state["bbox_embed.0.layers.0.bias"] + 1
    with pytest.raises(ConversionError, match=r"transformer.decoder.bbox_embed.2.layers.0.bias should be tied to"):
        dino.sanitize(state)


def test_a_file_keeping_one_copy_of_a_tied_tensor():
    state = their_state("r50_4scale")
    kept = {k: v for k, v in state.items() if not re.match(r"^(class_embed|bbox_embed)\.", k)}  # the decoder's only
    weights = dino.sanitize(kept)
    np.testing.assert_array_equal(weights["class_embed.0.weight"], state["class_embed.0.weight"])
    assert not any(k.startswith(("class_embed.1", "transformer.decoder.class_embed")) for k in weights)


DETREX_NAMES = {  # a few of detrex's keys (projects/dino, detectron2's ResNet and ChannelMapper) and their DINO twins
    "backbone.stem.conv1.weight": "backbone.0.body.conv1.weight",
    "backbone.stem.conv1.norm.running_var": "backbone.0.body.bn1.running_var",
    "backbone.res2.0.shortcut.norm.bias": "backbone.0.body.layer1.0.downsample.1.bias",
    "backbone.res5.2.conv3.norm.weight": "backbone.0.body.layer4.2.bn3.weight",
    "neck.convs.2.conv.weight": "input_proj.2.0.weight",
    "neck.extra_convs.0.norm.bias": "input_proj.3.1.bias",
    "transformer.level_embeds": "transformer.level_embed",
    "transformer.encoder.layers.1.attentions.0.sampling_offsets.weight": (
        "transformer.encoder.layers.1.self_attn.sampling_offsets.weight"
    ),
    "transformer.encoder.layers.0.ffns.0.layers.0.0.weight": "transformer.encoder.layers.0.linear1.weight",
    "transformer.decoder.layers.2.attentions.0.attn.in_proj_weight": (
        "transformer.decoder.layers.2.self_attn.in_proj_weight"
    ),
    "transformer.decoder.layers.0.attentions.1.value_proj.bias": (
        "transformer.decoder.layers.0.cross_attn.value_proj.bias"
    ),
    "transformer.decoder.layers.1.norms.0.weight": "transformer.decoder.layers.1.norm2.weight",
    "transformer.decoder.layers.1.norms.1.weight": "transformer.decoder.layers.1.norm1.weight",
    "transformer.decoder.layers.0.ffns.0.layers.1.bias": "transformer.decoder.layers.0.linear2.bias",
    "class_embed.3.weight": "transformer.enc_out_class_embed.weight",  # the last of detrex's 3 + 1 heads
    "transformer.decoder.bbox_embed.3.layers.2.bias": "transformer.enc_out_bbox_embed.layers.2.bias",
    "class_embed.1.bias": "class_embed.1.bias",
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_detrex_names_both_ways(variant):
    """DINO's state with a head for each layer (as detrex's) -> detrex's names -> back, bit for bit; its label_enc
    a row per class there."""
    state = their_state(variant)
    for key in [k for k in state if SHARED.match(k)]:
        state[key] = state[key] + int(SHARED.match(key)[3])  # unshared: each layer its own (the copies still equal)
    theirs = dino.to_detrex(state)
    assert dino.is_detrex(theirs) and not dino.is_dino(theirs)
    assert theirs["label_enc.weight"].shape[0] == state["transformer.enc_out_class_embed.weight"].shape[0]
    if variant == "r50_4scale":
        for detrex_key, dino_key in DETREX_NAMES.items():
            np.testing.assert_array_equal(theirs[detrex_key], state[dino_key], err_msg=detrex_key)
    if variant == "swin_t_4scale":
        np.testing.assert_array_equal(theirs["backbone.norm3.weight"], state["backbone.0.norm3.weight"])
    back = dino.from_detrex(theirs)
    assert back.keys() == state.keys()
    for key, value in state.items():
        if key != "label_enc.weight":
            assert np.array_equal(back[key], value), key
    np.testing.assert_array_equal(back["label_enc.weight"][:-1], state["label_enc.weight"][:-1])
    again = dino.to_detrex(back)
    assert again.keys() == theirs.keys() and all(np.array_equal(again[k], theirs[k]) for k in theirs)
    options = dino.model_options(back, {}, "detrex.pth", detrex=True)  # its heads per layer, the authors' encoding
    assert (options["decoder_heads"], options["position_temperature"], options["position_offset"]) == (
        "per_layer",
        10000.0,
        0.5,
    )


def test_detrex_unknown_key():
    theirs = dino.to_detrex(their_state("r50_4scale"))
    theirs["neck.fpn.0.weight"] = theirs["neck.convs.0.conv.weight"]
    with pytest.raises(ConversionError, match=r"^x: unknown key neck.fpn.0.weight for detrex's DINO$"):
        dino.from_detrex(theirs, "x")


def test_export_writes_their_checkpoint_and_convert_reads_it_back(tmp_path):
    """export_torch of a DINO model: {"model", "args": Namespace}, read back (weights only) to the same weights
    and options. convert's full path is checked where the MLX model builds (below)."""
    torch = pytest.importorskip("torch", reason="writing their .pth needs PyTorch (the convert extra)")
    from deformable_detr.weights.authors import read_checkpoint
    from deformable_detr.weights.conversion import export_torch

    state = their_state("r50_5scale")
    weights = dino.sanitize(state)
    options = dino.model_options(state, their_args("r50_5scale"))
    message = export_torch(weights, options, tmp_path / "dino.pth")
    assert (
        message == f"wrote {len(state)} tensors ({len(weights)} distinct) in DINO's layout to {tmp_path / 'dino.pth'}"
    )
    checkpoint = torch.load(tmp_path / "dino.pth", weights_only=False)
    assert isinstance(checkpoint["args"], argparse.Namespace)
    args = vars(checkpoint["args"])
    assert args["return_interm_indices"] == [0, 1, 2, 3] and args["num_feature_levels"] == 5
    assert (args["backbone"], args["pe_temperatureH"], args["dn_labelbook_size"], args["num_classes"]) == (
        "resnet50",
        20.0,
        5,
        5,
    )
    read, read_args = read_checkpoint(tmp_path / "dino.pth")
    assert read.keys() == state.keys() and all(np.array_equal(read[k], state[k]) for k in state)
    assert dino.model_options(read, read_args) == options


def test_hugging_face_export_is_refused_in_one_line(tmp_path):
    from deformable_detr.weights.conversion import export_huggingface

    weights = dino.sanitize(their_state("r50_4scale"))
    config = {"model": {"architecture": "dino", "mixed_selection": True}, "data": {}}
    with pytest.raises(ConversionError, match=r"^the model: transformers has no DINO model .*--to torch") as error:
        export_huggingface(weights, config, {}, tmp_path / "hf")
    assert "\n" not in str(error.value) and not (tmp_path / "hf").exists()


def test_fine_tuning_carries_dino_class_rows():
    """The encoder's class head and label_enc have a row per class: fine-tuning takes any count of them."""
    from deformable_detr.weights.loading import CLASS_HEAD

    for key in ("class_embed.0.weight", "transformer.enc_out_class_embed.bias", "label_enc.weight"):
        assert CLASS_HEAD.match(key), key
    for key in (
        "bbox_embed.0.layers.0.weight",
        "transformer.enc_out_bbox_embed.layers.2.bias",
        "transformer.tgt_embed.weight",
    ):
        assert not CLASS_HEAD.match(key), key


@cache
def their_models():
    """DINO's own code (a checkout at DINO_CHECKOUT), or a skip that says why."""
    checkout = os.environ.get("DINO_CHECKOUT")
    if not checkout:
        pytest.skip("DINO's own code is read from a checkout of IDEA-Research/DINO at DINO_CHECKOUT (unset)")
    pytest.importorskip("torch", reason="DINO's code is PyTorch")
    from dino_code import import_dino

    return import_dino(Path(checkout))


@pytest.mark.parametrize("scales", [4, 5])
def test_their_code_loads_the_export_strict(scales):
    """DINO's build_dino with the args export writes builds a model whose state_dict is the export's key for key
    and shape for shape, and load_state_dict(strict=True) takes it (R50 4-scale and 5-scale, their configs' sizes)."""
    torch = pytest.importorskip("torch")
    from dino_code import on_the_cpu

    models = their_models()
    variant = f"r50_{scales}scale"
    state = their_state(variant)
    options = dino.model_options(state, their_args(variant))
    args = dino.dino_args(options, dino.sanitize(state))
    args.device = "cpu"
    with on_the_cpu():
        model = models.dino.dino.build_dino(args)[0]
    theirs = model.state_dict()
    exported = dino.to_dino(dino.sanitize(state))
    assert {k: tuple(v.shape) for k, v in theirs.items()} == {k: v.shape for k, v in exported.items()}
    model.load_state_dict({k: torch.from_numpy(v) for k, v in exported.items()}, strict=True)
    for key in ("class_embed.2.weight", "transformer.decoder.bbox_embed.1.layers.1.bias", "input_proj.0.0.weight"):
        np.testing.assert_array_equal(model.state_dict()[key].numpy(), state[key])


def mlx_dino(options: dict):
    """The MLX DINO model of `options`, or a skip until build_model builds one (models/dino.py)."""
    from deformable_detr import build_model, load_config
    from deformable_detr.config import CONFIGS_DIR, model_overrides

    if not (CONFIGS_DIR / dino.config_for(options)).is_file():
        pytest.skip(f"configs/{dino.config_for(options)} (the lead's DINO configs) is not there yet")
    return build_model(load_config(None, model_overrides(options)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_converted_key_is_a_parameter_of_the_mlx_model(variant):
    """Their state -> the MLX model's parameters, every key and shape (strict both ways), and the model's
    parameters -> their state again, bit for bit."""
    from deformable_detr.weights.authors import expected_shapes

    import mlx.core as mx
    from mlx.utils import tree_flatten

    state = their_state(variant)
    model = mlx_dino(dino.model_options(state, their_args(variant)))
    weights = dino.sanitize(state, expected_shapes(model), variant)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    back = dino.to_dino({k: np.array(v) for k, v in tree_flatten(model.parameters())})
    assert back.keys() == state.keys()
    for key, value in state.items():
        assert back[key].dtype == value.dtype and np.array_equal(back[key], value), key


def test_convert_reads_their_checkpoint_and_detrexs(tmp_path):
    """convert: their main.py checkpoint -> weights, options and config the file records -> the model loaded; so a
    detrex checkpoint (its own heads for every layer, the authors' position encoding), every head its own."""
    torch = pytest.importorskip("torch", reason="writing their .pth needs PyTorch (the convert extra)")
    from deformable_detr.weights.conversion import convert, save_converted
    from deformable_detr.weights.loading import config_from_weights, load_trained_model

    state = their_state("r50_4scale")
    mlx_dino(dino.model_options(state, their_args("r50_4scale")))  # or the skip
    checkpoint = {"model": {k: torch.from_numpy(v) for k, v in state.items()}, "epoch": 11}
    checkpoint["args"] = argparse.Namespace(**their_args("r50_4scale"))
    torch.save(checkpoint, tmp_path / "dino.pth")
    weights, options, message = convert(tmp_path / "dino.pth")
    assert message.startswith("variant: resnet50, DINO, two-stage, box refinement, 4 feature level(s)\n")
    assert "config: configs/dino_r50_4scale_12ep.yaml with " in message
    save_converted(tmp_path / "dino.safetensors", weights, options, tmp_path / "dino.pth")
    cfg = config_from_weights(tmp_path / "dino.safetensors")
    assert (cfg.model.architecture, cfg.model.num_queries, cfg.model.hidden_dim, cfg.model.dn_labelbook_size) == (
        "dino",
        30,
        64,
        5,
    )
    model, _ = load_trained_model(tmp_path / "dino.safetensors", cfg)
    np.testing.assert_array_equal(np.array(model.label_enc.weight), state["label_enc.weight"])

    per_layer = dict(state)
    for key in [k for k in per_layer if SHARED.match(k)]:
        per_layer[key] = per_layer[key] + int(SHARED.match(key)[3])  # each layer's head its own, as detrex's
    theirs = dino.to_detrex(per_layer)
    torch.save({"model": {k: torch.from_numpy(v) for k, v in theirs.items()}}, tmp_path / "detrex.pth")
    weights, options, message = convert(tmp_path / "detrex.pth")
    assert (options["decoder_heads"], options["position_offset"], options["position_temperature"]) == (
        "per_layer",
        0.5,
        10000.0,
    )
    save_converted(tmp_path / "detrex.safetensors", weights, options, tmp_path / "detrex.pth")
    cfg = config_from_weights(tmp_path / "detrex.safetensors")
    model, _ = load_trained_model(tmp_path / "detrex.safetensors", cfg)
    assert len(model.class_embed) == len(model.bbox_embed) == 3
    np.testing.assert_array_equal(np.array(model.class_embed[2].bias), per_layer["class_embed.2.bias"])
    with pytest.raises(ConversionError, match=r"half-pixel offset .*detrex's DINO") as error:
        dino.dino_args(vars(cfg.model), weights)  # DINO's layout has no such encoding
    assert "\n" not in str(error.value)
