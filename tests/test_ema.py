"""The EMA of the weights (`train.ema_decay`): its recurrence with the warm-up, kept in float32; saved
with the checkpoint and resumed exactly; what evaluations during training, eval.py, predict and
export use (the average, or the trained weights with --raw-weights)."""

import json
import math

from deformable_detr import build_model, load_config
from deformable_detr.training.trainer import Trainer
from deformable_detr.weights.files import read_weights
from deformable_detr.weights.loading import load_trained_model

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_train import TINY, TINY_IMAGES, run, shapes, weights  # noqa: F401  (the fixture)

import eval as eval_script

EMA = ["train.ema_decay=0.9", "train.ema_warmup=3"]


def test_the_average_follows_the_recurrence_with_its_warm_up():
    cfg = load_config(TINY, [*EMA, "model.dropout=0.0"])
    mx.random.seed(0)
    trainer = Trainer.from_config(build_model(cfg), cfg, TINY_IMAGES)
    rng = np.random.default_rng(0)
    images, mask = rng.standard_normal((2, 64, 64, 3)).astype(np.float32), np.zeros((2, 64, 64), bool)
    targets = [{"labels": np.array([1, 3]), "boxes": np.full((2, 4), 0.3, np.float32)}] * 2
    trained = {k for k, _ in tree_flatten(trainer.model.trainable_parameters())}
    expected = {k: np.array(v) for k, v in tree_flatten(trainer.model.parameters())}
    for update in range(1, 5):
        trainer.step([(images, mask, targets)])
        d = 0.9 * (1 - math.exp(-update / 3))
        now = {k: np.array(v) for k, v in tree_flatten(trainer.model.parameters())}
        expected = {k: d * expected[k] + (1 - d) * now[k] if k in trained else now[k] for k in now}
    assert trainer.ema.updates == 4
    key = "transformer.level_embed"
    assert key in trained and trainer.ema.weights[key].dtype == mx.float32
    assert not np.allclose(expected[key], now[key], atol=1e-6)  # the average is not the weights
    for k, want in expected.items():
        np.testing.assert_allclose(np.array(trainer.ema.weights[k]), want, rtol=1e-6, atol=1e-7, err_msg=k)
    frozen = "backbone.0.body.conv1.weight"  # lr_backbone 0 in TINY: frozen, the model's own
    assert frozen not in trained and np.array_equal(np.array(trainer.ema.weights[frozen]), now[frozen])


def test_resume_with_the_average_is_bit_for_bit(shapes, tmp_path):  # noqa: F811
    stopped = run(shapes, tmp_path / "a", "train.max_steps=5", *EMA)
    resumed = run(shapes, tmp_path / "b", "train.max_steps=9", *EMA, resume=stopped)
    straight = run(shapes, tmp_path / "c", "train.max_steps=9", *EMA)
    got, want = weights(resumed), weights(straight)
    assert got.keys() == want.keys() and any(k.startswith("ema.") for k in want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert read_weights(resumed).ema_updates == 9


@pytest.fixture(scope="module")
def with_ema(shapes, tmp_path_factory):  # noqa: F811
    output = tmp_path_factory.mktemp("ema")
    return run(shapes, output, "schedule.epochs=2", *EMA), output


def test_evaluations_eval_and_predict_use_the_average(with_ema, shapes, tmp_path):  # noqa: F811
    checkpoint, output = with_ema
    saved, raw = read_weights(checkpoint), read_weights(checkpoint, raw=True)
    cfg = load_config(TINY)
    for flag, tensors in ((False, saved.ema), (True, raw.tensors)):
        model, _ = load_trained_model(checkpoint, cfg, raw=flag)
        loaded = dict(tree_flatten(model.parameters()))
        for key in ("transformer.level_embed", "class_embed.0.bias"):
            np.testing.assert_array_equal(np.array(loaded[key]), np.array(tensors[key]), err_msg=key)
    assert not np.array_equal(np.array(saved.ema["class_embed.0.bias"]), np.array(raw.tensors["class_embed.0.bias"]))

    argv = ["--config", str(TINY), "--checkpoint", str(checkpoint), "--coco-path", str(shapes)]
    averaged = eval_script.main([*argv, "--output-dir", str(tmp_path / "ema")])
    trained = eval_script.main([*argv, "--output-dir", str(tmp_path / "raw"), "--raw-weights"])
    during_training = json.loads((output / "eval_results.json").read_text())
    assert averaged["AP"] == pytest.approx(during_training["AP"], abs=1e-12)
    detections = [json.loads((tmp_path / d / "detections_val.json").read_text()) for d in ("ema", "raw")]
    assert detections[0] != detections[1]  # the two weights give other detections: the flag matters
    assert trained is not None


def test_export_takes_the_average(with_ema, tmp_path):
    torch = pytest.importorskip("torch", reason="writing .pth files needs PyTorch (the dev extra)")
    import argparse

    from deformable_detr.inference.detector import Detector

    checkpoint, _ = with_ema
    for flag, tensors in (
        (False, read_weights(checkpoint).tensors),
        (True, read_weights(checkpoint, raw=True).tensors),
    ):
        Detector.load(checkpoint, raw_weights=flag).export("torch", tmp_path / "out.pth")
        with torch.serialization.safe_globals([argparse.Namespace]):
            state = torch.load(str(tmp_path / "out.pth"), weights_only=True)["model"]
        np.testing.assert_array_equal(state["class_embed.0.bias"].numpy(), np.array(tensors["class_embed.0.bias"]))
