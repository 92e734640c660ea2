"""The Swin backbone against H-Deformable-DETR's own (fixtures/swin, made by make_swin_reference.py with
their code): outputs, masks and gradients with the recipe's weights; drop path; and ImageNet weights
from Microsoft's and timm's layouts."""

import json
import math
from functools import cache
from pathlib import Path

from deformable_detr.errors import ConversionError
from deformable_detr.models.backbones import backbone_family
from deformable_detr.models.gelu import gelu
from deformable_detr.models.swin import (
    BUFFERS,
    SWIN_ARCHITECTURES,
    DropPath,
    SwinArchitecture,
    SwinBackbone,
    is_buffer,
)
from deformable_detr.weights.swin import (
    detect_architecture,
    expected_shapes,
    read_swin_imagenet,
    swin_imagenet_to_body,
)

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from reference_weights import recipe_value
from safetensors.numpy import load_file, save_file

FIXTURE = Path(__file__).parent / "fixtures" / "swin"
OUTPUT_TOLERANCE = dict(rtol=1e-4, atol=1e-4)  # float32 on a CPU, as test_fidelity.py
GRADIENT_TOLERANCE = 1e-3  # of the largest magnitude of each gradient
WINDOW12 = SwinArchitecture(96, (2, 2, 2, 2), (3, 6, 12, 24), 12)  # the fixture's window-12 case
SMALL = SwinArchitecture(16, (2, 2, 2, 2), (1, 2, 4, 8), 7)  # for the conversions: little to write


@cache
def manifest() -> dict:
    return json.loads((FIXTURE / "manifest.json").read_text())


@cache
def reference() -> dict:
    return load_file(str(FIXTURE / "reference.safetensors"))


def recipe_body(case: str) -> dict:
    """The fixture's weights as {body key: array} in MLX's layout (the patch embedding OHWI)."""
    weights = {}
    for key, shape in manifest()["cases"][case]["parameters"].items():
        value = recipe_value("backbone.0.body." + key, tuple(shape), manifest()["seed"])
        weights[key] = value.transpose(0, 2, 3, 1) if value.ndim == 4 else value
    return weights


def backbone(case: str, **options) -> SwinBackbone:
    model = SwinBackbone("swin_tiny" if case == "tiny" else WINDOW12, **options)
    model.load_weights([("body." + k, mx.array(v)) for k, v in recipe_body(case).items()], strict=True)
    return model


def inputs():
    ref = reference()
    return mx.array(ref["images"].transpose(0, 2, 3, 1)), mx.array(ref["mask"].astype(bool))


@cache
def run(case: str):
    """Our outputs and the gradients of sum_i sum(out_i * cotangent_i), eval mode, as the fixture's."""
    model = backbone(case)
    model.eval()
    images, mask = inputs()
    seed = manifest()["seed"]
    cotangents = [
        mx.array(recipe_value(f"cotangent.{i}", reference()[f"{case}.out{i}"].shape, seed).transpose(0, 2, 3, 1))
        for i in (1, 2, 3)
    ]

    def objective(model):
        out = model(images, mask)
        return sum((features * c).sum() for (features, _), c in zip(out, cotangents, strict=True)), out

    (total, out), grads = nn.value_and_grad(model, objective)(model)
    mx.eval(total, out, grads)
    return float(total), out, dict(tree_flatten(grads))


@pytest.mark.parametrize("case", ["tiny", "window12"])
def test_outputs_and_masks_match_hdetr(case):
    total, out, _ = run(case)
    assert [f.shape[1:3] for f, _ in out] == [(15, 17), (8, 9), (4, 5)]  # ceil(h / stride) of 118 x 134
    for i, (features, mask) in zip((1, 2, 3), out, strict=True):
        expected = reference()[f"{case}.out{i}"].transpose(0, 2, 3, 1)
        np.testing.assert_allclose(np.array(features), expected, **OUTPUT_TOLERANCE, err_msg=f"out{i}")
        np.testing.assert_array_equal(np.array(mask), reference()[f"{case}.mask{i}"].astype(bool))
    assert total == pytest.approx(manifest()["cases"][case]["objective"], rel=1e-5)


@pytest.mark.parametrize("case", ["tiny", "window12"])
def test_gradients_match_hdetr(case):
    _, _, grads = run(case)
    for key in manifest()["cases"][case]["gradients"]:
        ours = np.array(grads["body." + key])
        ours = ours.transpose(0, 3, 1, 2) if ours.ndim == 4 else ours
        expected = reference()[f"{case}.grad.{key}"]
        atol = GRADIENT_TOLERANCE * np.abs(expected).max()
        np.testing.assert_allclose(ours, expected, rtol=GRADIENT_TOLERANCE, atol=atol, err_msg=key)


def test_names_are_hdetr_state_dict_names():
    """Parameter for parameter, HDETR's backbone body (the fixture lists them, with their buffers)."""
    theirs = {k: tuple(v) for k, v in manifest()["cases"]["tiny"]["parameters"].items()}
    theirs["patch_embed.proj.weight"] = (96, 4, 4, 3)  # OIHW there, OHWI here
    ours = {k.removeprefix("body."): v.shape for k, v in tree_flatten(SwinBackbone("swin_tiny").parameters())}
    assert ours == theirs
    assert list(expected_shapes("swin_tiny").items()) == list(theirs.items())  # and in their order
    assert manifest()["hdetr_commit"] == "f58ceb1165da4b0cd10e9a5a30c7a77fbd33f492"
    assert all(is_buffer(k) for k in manifest()["cases"]["tiny"]["buffers"])
    assert not any(is_buffer(k) for k in theirs) and BUFFERS == ("relative_position_index", "attn_mask")


def test_interface():
    swin = SwinBackbone("swin_tiny", drop_path_rate=0.0)
    assert swin.strides == [8, 16, 32] and swin.num_channels == [192, 384, 768]
    last = SwinBackbone("swin_large_window12", maps=1)
    assert last.strides == [32] and last.num_channels == [1536]
    assert backbone_family("swin_tiny") == "swin" and backbone_family("resnet50") == "resnet"
    rates = [block.drop_path.p for layer in SwinBackbone("swin_tiny").body.layers for block in layer.blocks]
    np.testing.assert_allclose(rates, np.linspace(0, 0.2, 12), rtol=1e-6)  # HDETR's: linear over all 12 blocks
    with pytest.raises(ValueError, match="unknown Swin backbone 'swin_huge'"):
        SwinBackbone("swin_huge")
    swin.set_trainable(False)
    assert tree_flatten(swin.trainable_parameters()) == []
    swin.set_trainable(True, freeze_stem_and_layer1=True)  # HDETR trains all of Swin: the flag is ignored
    assert len(tree_flatten(swin.trainable_parameters())) == len(tree_flatten(swin.parameters()))
    images, mask = inputs()
    swin.maps = 1
    ((features, features_mask),) = swin(images, mask)
    assert features.shape == (2, 4, 5, 768) and features_mask.shape == (2, 4, 5)


def test_gelu_is_torchs_exact_gelu():
    """x * Phi(x) and its derivative, against float64 (torch's nn.GELU() is within 1.3e-6 of it too)."""
    x = np.linspace(-12, 12, 240001, dtype=np.float32)
    exact = np.vectorize(math.erf)(x.astype(np.float64) / math.sqrt(2))
    np.testing.assert_allclose(np.array(gelu(mx.array(x))), 0.5 * x * (1 + exact), rtol=0, atol=2e-6)
    slope = 0.5 * (1 + exact) + x * np.exp(-(x.astype(np.float64) ** 2) / 2) / math.sqrt(2 * math.pi)
    np.testing.assert_allclose(np.array(mx.grad(lambda v: gelu(v).sum())(mx.array(x))), slope, rtol=0, atol=1e-5)
    halves = mx.array(x[:7], dtype=mx.bfloat16)
    assert gelu(halves).dtype == mx.bfloat16


def test_drop_path_draws_whole_samples():
    drop = DropPath(0.25)
    x = mx.ones((4000, 3, 2))
    drop.eval()
    assert mx.array_equal(drop(x), x)
    drop.train()
    y = np.array(drop(x))
    per_sample = y.reshape(len(y), -1)
    assert (per_sample == per_sample[:, :1]).all()  # one draw per sample
    np.testing.assert_allclose(np.unique(per_sample), [0, 1 / 0.75], rtol=1e-6)  # dropped, or kept and scaled
    assert abs((per_sample[:, 0] > 0).mean() - 0.75) < 0.03


def test_drop_path_only_in_training():
    images, mask = inputs()
    model = backbone("tiny", drop_path_rate=0.5)
    model.eval()
    evaluated = np.array(model(images, mask)[-1][0])
    np.testing.assert_allclose(evaluated, reference()["tiny.out3"].transpose(0, 2, 3, 1), **OUTPUT_TOLERANCE)
    model.train()
    mx.random.seed(0)
    trained = np.array(model(images, mask)[-1][0])
    assert np.abs(trained - evaluated).max() > 0.1  # blocks were dropped
    off = backbone("tiny", drop_path_rate=0.0)
    off.train()
    np.testing.assert_array_equal(np.array(off(images, mask)[-1][0]), evaluated)  # nothing else is random


def test_checkpointing_recomputes_the_same_dropped_paths():
    images, mask = inputs()
    model = backbone("tiny", drop_path_rate=0.5)
    model.train()

    def gradients(checkpointing):
        model.body.activation_checkpointing = checkpointing
        mx.random.seed(1)
        _, grads = nn.value_and_grad(model, lambda m: sum(f.sum() for f, _ in m(images, mask)))(model)
        return dict(tree_flatten(grads))

    plain, recomputed = gradients(False), gradients(True)
    for key in ("body.patch_embed.proj.weight", "body.layers.2.blocks.3.mlp.fc1.weight"):
        np.testing.assert_allclose(np.array(recomputed[key]), np.array(plain[key]), rtol=1e-5, atol=1e-6)


def _torch_layout(arch: SwinArchitecture, seed: int = 0) -> dict:
    """Microsoft's layout of a Swin of `arch` (their key order, OIHW, buffers, classifier, final norm)
    with the recipe's values for the body."""
    state = {}
    for key, shape in expected_shapes(arch).items():
        if key.startswith("norm") and key[4].isdigit():
            continue  # the detection norms: not in ImageNet weights
        if key == "patch_embed.proj.weight":
            shape = (shape[0], 3, shape[1], shape[2])
        state[key] = recipe_value(key, shape, seed)
        if key.endswith("relative_position_bias_table"):
            tokens = arch.window_size**2
            state[key.replace("bias_table", "index")] = np.zeros((tokens, tokens), np.int64)
    width = arch.embed_dim * 2 ** (len(arch.depths) - 1)
    state.update({"norm.weight": np.ones(width, np.float32), "norm.bias": np.zeros(width, np.float32)})
    state.update({"head.weight": np.zeros((10, width), np.float32), "head.bias": np.zeros(10, np.float32)})
    return state


def _timm_from_microsoft(state: dict) -> dict:
    timm = {}
    for key, value in state.items():
        if key.endswith("relative_position_index"):
            continue  # not persistent in timm
        if key.startswith("layers.") and ".downsample." in key:
            stage = int(key.split(".")[1])
            key = key.replace(f"layers.{stage}.", f"layers.{stage + 1}.", 1)
        timm[key.replace("head.", "head.fc.")] = value
    return timm


def test_imagenet_layouts_load_identically(tmp_path):
    microsoft = _torch_layout(SMALL)
    timm = _timm_from_microsoft(microsoft)
    assert "layers.3.downsample.reduction.weight" in timm and "layers.0.downsample.reduction.weight" not in timm
    save_file(timm, str(tmp_path / "model.safetensors"))
    from_timm = read_swin_imagenet(tmp_path / "model.safetensors", SMALL)
    from_microsoft = swin_imagenet_to_body(microsoft, SMALL, "swin.pth")
    assert list(from_timm) == list(from_microsoft) == list(expected_shapes(SMALL))
    for key, value in from_microsoft.items():
        np.testing.assert_array_equal(from_timm[key], value, err_msg=key)
    np.testing.assert_array_equal(
        from_microsoft["layers.1.downsample.reduction.weight"], microsoft["layers.1.downsample.reduction.weight"]
    )
    np.testing.assert_array_equal(
        from_microsoft["patch_embed.proj.weight"], microsoft["patch_embed.proj.weight"].transpose(0, 2, 3, 1)
    )
    assert (from_microsoft["norm3.weight"] == 1).all() and (from_microsoft["norm3.bias"] == 0).all()
    model = SwinBackbone(SMALL)
    model.load_weights([("body." + k, mx.array(v)) for k, v in from_timm.items()], strict=True)


def test_microsoft_pth(tmp_path):
    torch = pytest.importorskip("torch")
    microsoft = _torch_layout(SMALL)
    torch.save({"model": {k: torch.from_numpy(v) for k, v in microsoft.items()}}, tmp_path / "swin.pth")
    weights = read_swin_imagenet(tmp_path / "swin.pth", SMALL, prefix="backbone.0.body.")
    expected = swin_imagenet_to_body(microsoft, SMALL)
    assert list(weights) == ["backbone.0.body." + k for k in expected]
    np.testing.assert_array_equal(
        weights["backbone.0.body.layers.0.blocks.1.attn.qkv.weight"], expected["layers.0.blocks.1.attn.qkv.weight"]
    )


def test_unknown_and_missing_keys_are_one_line_errors():
    state = _torch_layout(SMALL)
    state["layers.0.blocks.0.attn.extra.weight"] = np.zeros((2, 2), np.float32)
    with pytest.raises(ConversionError) as error:
        swin_imagenet_to_body(state, SMALL, "swin.pth")
    message = str(error.value)
    assert "\n" not in message
    assert message == "swin.pth: not a Microsoft-layout Swin state: unexpected keys layers.0.blocks.0.attn.extra.weight"
    del state["layers.0.blocks.0.attn.extra.weight"], state["layers.1.blocks.1.mlp.fc2.bias"]
    with pytest.raises(ConversionError, match=r"^swin.pth: .*: missing keys layers\.1\.blocks\.1\.mlp\.fc2\.bias$"):
        swin_imagenet_to_body(state, SMALL, "swin.pth")


def test_architecture_is_read_from_shapes_and_must_be_the_one_asked():
    def shapes_only(name):  # Microsoft's layout of a named Swin, as broadcast zeros: no memory
        state = {
            k: np.broadcast_to(np.float32(0), (v[0], 3, v[1], v[2]) if v[-1] == 3 and len(v) == 4 else v)
            for k, v in expected_shapes(name).items()
        }
        return {k: v for k, v in state.items() if not (k.startswith("norm") and k[4].isdigit())}

    for name in ("swin_base_window12", "swin_large"):
        assert detect_architecture(shapes_only(name))[:4] == SWIN_ARCHITECTURES[name][:4]
    with pytest.raises(ConversionError) as error:
        swin_imagenet_to_body(shapes_only("swin_large_window12"), "swin_large", "swin_l_384.pth")
    assert str(error.value) == (
        "swin_l_384.pth: holds swin_large_window12 (embed 192, depths 2-2-18-2, heads 6-12-24-48, window 12), "
        "not the swin_large asked for"
    )
    with pytest.raises(ConversionError, match="holds a Swin of no known name .embed 16, .*, not the swin_tiny asked"):
        swin_imagenet_to_body(_torch_layout(SMALL), "swin_tiny", "small.pth")


def test_convert_backbone_only_reads_swin_imagenet_weights_for_training(tmp_path):
    """`convert --backbone-only` of Microsoft's Swin-T release layout -> a backbone file that `train.py --weights`
    loads into a Swin-T detector (H-Deformable-DETR's hdetr_swin_tiny_12ep)."""
    from deformable_detr import build_model, load_config
    from deformable_detr.weights.conversion import convert, save_converted
    from deformable_detr.weights.loading import load_model_weights

    microsoft = _torch_layout(SWIN_ARCHITECTURES["swin_tiny"])
    save_file(microsoft, str(tmp_path / "swin_tiny_patch4_window7_224.safetensors"))
    weights, options, message = convert(tmp_path / "swin_tiny_patch4_window7_224.safetensors", backbone_only=True)
    assert options == {"backbone": "swin_tiny"} and message.startswith("backbone: swin_tiny (ImageNet weights")
    save_converted(tmp_path / "backbone.safetensors", weights, options, tmp_path / "x.safetensors")
    cfg = load_config("hdetr_swin_tiny_12ep", ["model.num_classes=5"])
    model = build_model(cfg)
    assert load_model_weights(model, tmp_path / "backbone.safetensors", strict=False) == len(weights)
    np.testing.assert_array_equal(
        np.array(model.backbone[0].body.layers[2].blocks[5].mlp.fc1.weight),
        microsoft["layers.2.blocks.5.mlp.fc1.weight"],
    )


def test_onnx_export_of_a_swin_model_is_refused_in_one_line(tmp_path):
    pytest.importorskip("onnx", reason="the ONNX exporter needs onnx (the export extra)")
    from deformable_detr import build_model, load_config
    from deformable_detr.deploy.onnx.export import export_onnx
    from deformable_detr.errors import UsageError

    cfg = load_config("hdetr_swin_tiny_12ep", ["model.num_classes=5"])
    model = build_model(cfg)
    model.eval()
    with pytest.raises(UsageError, match=r"model.backbone swin_tiny: the ONNX graph has a ResNet backbone only"):
        export_onnx(model, cfg, tmp_path / "model.onnx", size=(256, 256))
    assert not (tmp_path / "model.onnx").exists()


def test_mlx_export_of_a_swin_model_gives_its_outputs(tmp_path):
    """--to mlx writes a Swin-T H-Deformable-DETR model (plain MLX ops in export mode: the GELU's too) whose file
    answers as the model does."""
    from deformable_detr import build_model, load_config
    from deformable_detr.deploy.mlxfn import export_mlx, run_file

    small = ["model.hidden_dim=64", "model.nheads=4", "model.enc_layers=1", "model.dec_layers=2"]
    small += ["model.dim_feedforward=64", "model.num_queries=12", "model.num_classes=5", "model.dec_n_points=2"]
    cfg = load_config("hdetr_swin_tiny_12ep", small)
    mx.random.seed(0)
    model = build_model(cfg)
    model.eval()
    summary = export_mlx(model, cfg, tmp_path / "model.mlxfn", size=(128, 160))
    assert summary.startswith(f"wrote {tmp_path / 'model.mlxfn'}")
    rng = np.random.default_rng(0)
    images = rng.standard_normal((1, 128, 160, 3)).astype(np.float32)
    mask = np.zeros((1, 128, 160), bool)
    inputs = {"pixel_values": images.transpose(0, 3, 1, 2).copy(), "pixel_mask": np.ones((1, 128, 160), np.int64)}
    logits, boxes = run_file(tmp_path / "model.mlxfn", inputs)[:2]
    ours = model(mx.array(images), mx.array(mask))
    np.testing.assert_allclose(np.array(logits), np.array(ours["pred_logits"]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(boxes), np.array(ours["pred_boxes"]), rtol=1e-4, atol=1e-5)
