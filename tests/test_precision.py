"""Mixed precision (`train.precision: bfloat16`) against float32 on the same weights and batch: the
first step's losses within 1%, the gradients pointing the same way; the weights and AdamW's state
stay float32; the attention's values are bfloat16 and its sampling locations float32."""

from deformable_detr import build_model, load_config
from deformable_detr.models import ms_deform_attn as attention_module
from deformable_detr.training.trainer import Trainer

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_lazy_step import batch
from test_train import TINY, TINY_IMAGES


def first_step(precision, monkeypatch):
    """-> (losses, gradients, grad norm) of one step of a two-stage refining model, and the trainer."""
    cfg = load_config(
        TINY,
        [
            f"train.precision={precision}",
            "model.dropout=0.0",
            "model.two_stage=true",
            "model.with_box_refine=true",
            "optimizer.lr_backbone=1e-5",
        ],
    )
    mx.random.seed(0)
    trainer = Trainer.from_config(build_model(cfg), cfg, TINY_IMAGES)
    captured = {}
    update = Trainer._update

    def capturing(self, grads, total, losses):
        captured["grads"] = grads
        return update(self, grads, total, losses)

    monkeypatch.setattr(Trainer, "_update", capturing)
    images, mask, targets = batch()
    losses, grad_norm = trainer.step([(np.array(images), np.array(mask), targets)])
    return losses, {k: np.array(v) for k, v in tree_flatten(captured["grads"])}, grad_norm, trainer


@pytest.fixture(scope="module")
def float32():
    with pytest.MonkeyPatch.context() as monkeypatch:
        return first_step("float32", monkeypatch)


def test_bfloat16_first_step_is_float32_within_one_percent(float32, monkeypatch):
    want_losses, want_grads, want_norm, _ = float32
    losses, grads, grad_norm, trainer = first_step("bfloat16", monkeypatch)
    assert losses["loss"] == pytest.approx(want_losses["loss"], rel=0.01)
    for key in ("loss_ce", "loss_bbox", "loss_giou", "loss_ce_enc", "loss_bbox_0"):
        assert losses[key] == pytest.approx(want_losses[key], rel=0.02), key
    assert grad_norm == pytest.approx(want_norm, rel=0.02)
    assert grads.keys() == want_grads.keys()
    cosines = {
        key: (grads[key] * want).sum() / (np.linalg.norm(grads[key]) * np.linalg.norm(want))
        for key, want in want_grads.items()
        if np.abs(want).max() > 1e-6 * want_norm  # a direction to compare
    }
    assert len(cosines) > 100 and any("sampling_offsets" in key for key in cosines)
    worst = min(cosines, key=cosines.get)
    assert cosines[worst] > 0.98, (worst, cosines[worst])  # bfloat16's 8 bits: 0.989-0.993 seen
    assert np.median(list(cosines.values())) > 0.999


def test_the_weights_and_adamw_stay_float32(float32, monkeypatch):
    *_, trainer = first_step("bfloat16", monkeypatch)
    assert {v.dtype for _, v in tree_flatten(trainer.model.parameters())} == {mx.float32}
    moments = [v for k, v in tree_flatten(trainer.optimizer.state) if k.endswith((".m", ".v"))]
    assert moments and {v.dtype for v in moments} == {mx.float32}


@pytest.mark.parametrize("precision, value_dtype", [("float32", mx.float32), ("bfloat16", mx.bfloat16)])
def test_the_attention_takes_values_in_the_precision_and_locations_in_float32(monkeypatch, precision, value_dtype):
    seen = []
    core = attention_module.kernels.ms_deform_attn

    def recording(value, shapes, starts, locations, weights, **kwargs):
        seen.append((value.dtype, locations.dtype))
        return core(value, shapes, starts, locations, weights, **kwargs)

    monkeypatch.setattr(attention_module.kernels, "ms_deform_attn", recording)
    first_step(precision, monkeypatch)
    assert seen and set(seen) == {(value_dtype, mx.float32)}
