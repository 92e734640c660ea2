"""Checkpoint conversion: the authors' .pth (as released or bare), Hugging Face weights, torchvision
ResNet weights; and a clear one-line error for each kind of bad checkpoint."""

import argparse
import os

from deformable_detr import build_model, load_config
from deformable_detr.config import model_overrides as overrides
from deformable_detr.convert import main
from deformable_detr.errors import ConversionError
from deformable_detr.weights.authors import expected_shapes, sanitize
from deformable_detr.weights.conversion import convert

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from reference_weights import state_dict

torch = pytest.importorskip("torch", reason="reading .pth files needs PyTorch (the dev extra)")

TINY = [
    "model.backbone=resnet18",
    "model.hidden_dim=64",
    "model.nheads=8",
    "model.enc_layers=1",
    "model.dec_layers=2",
    "model.dim_feedforward=32",
    "model.num_queries=5",
    "model.num_classes=3",
]


def authors_layout(model) -> dict:
    """A model's weights as the authors' state_dict (torch tensors, OIHW convolutions)."""
    return {
        k: torch.tensor(np.array(v.transpose(0, 3, 1, 2) if v.ndim == 4 else v))
        for k, v in tree_flatten(model.parameters())
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A small model saved as the authors save checkpoints (heads and points at their defaults, which
    a bare state_dict cannot show), and the model."""
    mx.random.seed(0)
    model = build_model(load_config(None, TINY))
    path = tmp_path_factory.mktemp("tiny") / "checkpoint.pth"
    args = argparse.Namespace(nheads=8, enc_n_points=4, dec_n_points=4, dilation=False, num_queries=5)
    torch.save({"model": authors_layout(model), "args": args, "epoch": 7, "optimizer": {"state": {}}}, path)
    return path, model


def test_released_checkpoint_of_the_reference_model(tmp_path):
    state = state_dict("base")
    path = tmp_path / "r50_deformable_detr.pth"
    args = argparse.Namespace(nheads=8, enc_n_points=4, dec_n_points=4, dilation=False, lr=2e-4)
    torch.save({"model": {k: torch.tensor(v) for k, v in state.items()}, "args": args, "epoch": 49}, path)
    weights, options, message = convert(path)
    assert message == "variant: resnet50, 4 feature level(s)\nconfig: configs/r50.yaml"
    model = build_model(load_config(None, overrides(options)))
    assert weights.keys() == expected_shapes(model).keys()
    np.testing.assert_array_equal(
        weights["backbone.0.body.conv1.weight"], state["backbone.0.body.conv1.weight"].transpose(0, 2, 3, 1)
    )
    np.testing.assert_array_equal(weights["class_embed.0.bias"], state["class_embed.0.bias"])
    assert "class_embed.3.bias" not in weights  # tied to class_embed.0 without box refinement


def test_bare_state_dict_equals_the_checkpoint(tiny, tmp_path):
    path, model = tiny
    bare = tmp_path / "bare.pth"
    torch.save(authors_layout(model), bare)
    from_checkpoint, _, _ = convert(path)
    from_bare, _, _ = convert(bare)
    for key, value in tree_flatten(model.parameters()):
        np.testing.assert_array_equal(from_checkpoint[key], np.array(value), err_msg=key)
        np.testing.assert_array_equal(from_bare[key], np.array(value), err_msg=key)


def test_tied_heads_that_differ_are_refused():
    state = state_dict("base")
    state["class_embed.2.bias"] = state["class_embed.2.bias"] + 1
    with pytest.raises(ConversionError, match="class_embed.2.bias should be tied to class_embed.0.bias"):
        sanitize(state)


def cli_error(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    message = str(exit_info.value.code)
    assert "\n" not in message and message.startswith("error: "), message
    return message


def test_truncated_file(tiny, tmp_path, capsys):
    path, _ = tiny
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes(path.read_bytes()[: os.path.getsize(path) // 2])
    message = cli_error(capsys, truncated, tmp_path / "out.safetensors")
    assert f"{truncated}: not a readable PyTorch checkpoint (truncated or corrupt?)" in message
    assert not (tmp_path / "out.safetensors").exists()


def test_unknown_key(tiny, tmp_path, capsys):
    _, model = tiny
    state = authors_layout(model)
    state["transformer.extra.weight"] = torch.zeros(2)
    torch.save(state, tmp_path / "unknown.pth")
    message = cli_error(capsys, tmp_path / "unknown.pth", tmp_path / "out.safetensors")
    assert message == f"error: {tmp_path / 'unknown.pth'}: unknown key transformer.extra.weight"


def test_missing_key(tiny, tmp_path, capsys):
    _, model = tiny
    state = authors_layout(model)
    del state["transformer.decoder.layers.1.norm3.bias"]
    torch.save(state, tmp_path / "missing.pth")
    message = cli_error(capsys, tmp_path / "missing.pth", tmp_path / "out.safetensors")
    assert message == f"error: {tmp_path / 'missing.pth'}: missing key transformer.decoder.layers.1.norm3.bias"


class Payload:
    def __reduce__(self):
        return (os.getcwd, ())


def test_disallowed_pickle_global(tmp_path, capsys):
    torch.save({"model": {}, "extra": Payload()}, tmp_path / "evil.pth")
    message = cli_error(capsys, tmp_path / "evil.pth", tmp_path / "out.safetensors")
    assert "refused: the pickle asks for the global posix.getcwd" in message


def test_truncated_safetensors(tmp_path, capsys):
    from safetensors.numpy import save_file

    save_file({"class_embed.0.weight": np.zeros((91, 256), np.float32)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    message = cli_error(capsys, tmp_path / "model.safetensors", tmp_path / "out.safetensors")
    assert f"{tmp_path / 'model.safetensors'}: not a readable safetensors file" in message


def test_missing_file(tmp_path, capsys):
    message = cli_error(capsys, tmp_path / "nothing.pth", tmp_path / "out.safetensors")
    assert message == f"error: {tmp_path / 'nothing.pth'}: no such file"


def test_cli_writes_weights_the_model_loads(tiny, tmp_path, capsys):
    path, model = tiny
    main([str(path), str(tmp_path / "tiny.safetensors")])
    printed = capsys.readouterr().out
    assert "config: configs/r50.yaml with " in printed and "model.backbone=resnet18" in printed
    loaded = build_model(load_config(None, TINY))
    loaded.load_weights(str(tmp_path / "tiny.safetensors"))
    for (key, want), (_, got) in zip(tree_flatten(model.parameters()), tree_flatten(loaded.parameters()), strict=True):
        np.testing.assert_array_equal(np.array(got), np.array(want), err_msg=key)


def test_torchvision_backbone_only(tmp_path, capsys):
    """torchvision's ResNet-50 layout: the backbone keys without prefix, plus the classifier."""
    state = {
        k.removeprefix("backbone.0.body."): torch.tensor(v)
        for k, v in state_dict("base").items()
        if k.startswith("backbone.0.body.")
    }
    state["fc.weight"], state["fc.bias"] = torch.zeros(1000, 2048), torch.zeros(1000)
    state["bn1.num_batches_tracked"] = torch.tensor(0)
    torch.save(state, tmp_path / "resnet50.pth")
    main([str(tmp_path / "resnet50.pth"), str(tmp_path / "backbone.safetensors"), "--backbone-only"])
    assert "backbone: resnet50" in capsys.readouterr().out
    model = build_model(load_config(None, ["model.dropout=0.0"]))
    model.load_weights(str(tmp_path / "backbone.safetensors"), strict=False)
    np.testing.assert_array_equal(
        np.array(model.backbone[0].body.layer2[0].conv2.weight),
        state["layer2.0.conv2.weight"].numpy().transpose(0, 2, 3, 1),
    )


@pytest.mark.parametrize("variant", ["base", "refine+two_stage"])
def test_huggingface_model_converts_and_matches(variant, tmp_path):
    pytest.importorskip("transformers", reason="the Hugging Face reference (dev extra)")
    from hf_reference import huggingface_model

    two_stage = variant != "base"
    hf = huggingface_model(variant)
    hf.save_pretrained(tmp_path)

    weights, options, message = convert(tmp_path)
    assert ("two-stage, box refinement" in message) == two_stage
    model = build_model(load_config(None, overrides(options) + ["model.dropout=0.0"]))
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    model.eval()

    images = torch.randn(2, 3, 96, 128)
    mask = torch.zeros(2, 96, 128, dtype=torch.bool)
    mask[0, 80:], mask[1, :, 100:] = True, True
    with torch.no_grad():
        theirs = hf(pixel_values=images, pixel_mask=(~mask).long())
    ours = model(mx.array(images.permute(0, 2, 3, 1).numpy()), mx.array(mask.numpy()))
    np.testing.assert_allclose(np.array(ours["pred_logits"]), theirs.logits.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(ours["pred_boxes"]), theirs.pred_boxes.numpy(), rtol=1e-4, atol=1e-4)

    # the same weights as pytorch_model.bin (older Hugging Face releases) convert to the same arrays
    (tmp_path / "bin").mkdir()
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "config.json").read_text())
    from_bin, _, _ = convert(tmp_path / "bin")
    assert from_bin.keys() == weights.keys()
    for key in weights:
        np.testing.assert_array_equal(from_bin[key], weights[key], err_msg=key)
