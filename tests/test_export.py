"""Export to the authors' PyTorch layout: converting their checkpoint and exporting it gives back
every key and value; training checkpoints carry their model options into `args`."""

import argparse

from deformable_detr import build_model, load_config
from deformable_detr.config import CONFIGS_DIR
from deformable_detr.export import main
from deformable_detr.inference.detector import Detector
from deformable_detr.training.optimizer import build_optimizer
from deformable_detr.weights.checkpoint import save_checkpoint
from deformable_detr.weights.conversion import convert, save_converted
from deformable_detr.weights.files import save_weights

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from reference_weights import VARIANTS, state_dict

torch = pytest.importorskip("torch", reason="writing .pth files needs PyTorch (the dev extra)")


def load_pth(path):
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(str(path), weights_only=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_convert_then_export_gives_back_every_key_and_value(variant, tmp_path):
    original = state_dict(variant)
    torch.save({"model": {k: torch.tensor(v) for k, v in original.items()}}, tmp_path / "authors.pth")
    weights, options, _ = convert(tmp_path / "authors.pth")
    save_converted(tmp_path / "port.safetensors", weights, options, tmp_path / "authors.pth")
    assert len(weights) < len(original)  # the tied copies were dropped

    main(["--to", "torch", "--checkpoint", str(tmp_path / "port.safetensors"), str(tmp_path / "exported.pth")])

    exported = load_pth(tmp_path / "exported.pth")["model"]
    assert sorted(exported) == sorted(original)
    for key, value in original.items():
        assert exported[key].dtype == torch.float32, key
        np.testing.assert_array_equal(exported[key].numpy(), value, err_msg=key)


def test_a_training_checkpoint_exports_with_its_model_options(tmp_path):
    cfg = load_config(
        CONFIGS_DIR / "r50_two_stage.yaml",
        [
            *("model.backbone=resnet18", "model.hidden_dim=64", "model.enc_layers=1", "model.dec_layers=2"),
            *("model.dim_feedforward=32", "model.num_queries=7", "model.num_classes=3", "model.dec_n_points=2"),
        ],
    )
    mx.random.seed(0)
    model = build_model(cfg)
    progress = {"epoch": 1, "step": 2, "global_step": 3}
    save_checkpoint(tmp_path / "checkpoint.safetensors", model, build_optimizer(cfg), cfg, progress, {1: "thing"})
    summary = Detector.load(tmp_path / "checkpoint.safetensors").export("torch", tmp_path / "exported.pth")
    assert summary.startswith("wrote ") and "in the authors' layout" in summary

    checkpoint = load_pth(tmp_path / "exported.pth")
    args = vars(checkpoint["args"])
    assert args["two_stage"] and args["with_box_refine"] and args["dec_n_points"] == 2 and args["nheads"] == 8
    assert "transformer.decoder.class_embed.2.bias" in checkpoint["model"]  # two-stage: dec_layers + 1 heads

    weights, options, _ = convert(tmp_path / "exported.pth")  # the args come back as model options
    assert options["dec_n_points"] == 2 and options["two_stage"]
    trained = dict(tree_flatten(model.parameters()))
    assert weights.keys() == trained.keys()
    for key, value in weights.items():
        np.testing.assert_array_equal(value, np.array(trained[key]), err_msg=key)


def test_bad_inputs_are_named_and_nothing_is_written(tmp_path, capsys):
    (tmp_path / "broken.safetensors").write_bytes(b"not safetensors")
    save_weights(tmp_path / "other.safetensors", {"weight": np.zeros(3, np.float32)})
    cases = {
        "missing.safetensors": "no such file",
        "broken.safetensors": "not a readable safetensors file",
        "other.safetensors": "not Deformable DETR weights",
    }
    for name, message in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            main(["--to", "torch", "--checkpoint", str(tmp_path / name), str(tmp_path / "out.pth")])
        assert str(exit_info.value).startswith(f"error: {tmp_path / name}: {message}")
        assert not (tmp_path / "out.pth").exists()
    with pytest.raises(FileNotFoundError, match="missing.safetensors: no such file"):
        Detector.load(tmp_path / "missing.safetensors")
