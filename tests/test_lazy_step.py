"""The training step is lazy: nothing inside the differentiated loss evaluates (an evaluation there
keeps every intermediate above it alive until the step ends). `mx.compile` refuses any evaluation
inside the function it traces, so a loss-and-gradient function that compiles has none; and it gives
the losses and gradients of the step as it was before, with scipy's matching and the MLX-ops
attention (both synchronise)."""

from deformable_detr import build_model, load_config
from deformable_detr.training.trainer import Trainer
from kernels import native

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_train import TINY, TINY_IMAGES

pytestmark = pytest.mark.skipif(native.missing() is not None, reason=f"{native.missing()}")


def batch():
    rng = np.random.default_rng(1)
    images = mx.array(rng.standard_normal((2, 64, 80, 3)).astype(np.float32))
    mask = np.zeros((2, 64, 80), dtype=bool)
    mask[1, :, 60:] = True  # the second image is padded
    targets = [
        {
            "labels": np.array([1, 2, 5]),
            "boxes": np.array([[0.5, 0.5, 0.2, 0.2], [0.3, 0.3, 0.1, 0.2], [0.7, 0.2, 0.3, 0.3]]),
        },
        {"labels": np.array([3]), "boxes": np.array([[0.4, 0.6, 0.3, 0.2]])},
    ]
    return images, mx.array(mask), targets


def loss_and_grad(*overrides):
    """A two-stage, refining tiny model (every loss: aux, _enc), backbone trainable."""
    cfg = load_config(TINY, ["model.dropout=0.0", "model.two_stage=true", "model.with_box_refine=true", *overrides])
    mx.random.seed(0)
    model = build_model(cfg)
    trainer = Trainer.from_config(model, cfg, TINY_IMAGES)
    images, mask, targets = batch()
    return lambda images, mask: trainer.loss_and_grad(images, mask, targets, 4.0), (images, mask)


def synchronising(monkeypatch):
    """The step before this change: no C++ operations, so scipy matches on evaluated costs."""
    monkeypatch.setattr(native, "_load", lambda: (None, "turned off for the reference"))


def test_loss_and_gradients_compile_and_equal_the_synchronising_step(monkeypatch):
    step, inputs = loss_and_grad("optimizer.lr_backbone=1e-5", "optimizer.freeze_stem_and_layer1=false")
    (total, losses), grads = mx.compile(step)(*inputs)
    mx.eval(total, losses, grads)

    synchronising(monkeypatch)
    reference_step, _ = loss_and_grad("optimizer.lr_backbone=1e-5", "optimizer.freeze_stem_and_layer1=false")
    (want_total, want_losses), want_grads = reference_step(*inputs)
    assert len(losses) == len(want_losses) == 13  # the last layer, aux_0 and _enc losses
    for key, value in want_losses.items():
        assert losses[key].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-6), key
    assert total.item() == pytest.approx(want_total.item(), rel=1e-6)
    got, want = dict(tree_flatten(grads)), dict(tree_flatten(want_grads))
    assert got.keys() == want.keys() and any(k.startswith("backbone") for k in got)
    for key in want:
        scale = max(float(np.abs(np.array(want[key])).max()), 1e-8)
        np.testing.assert_allclose(np.array(got[key]), np.array(want[key]), rtol=0, atol=2e-4 * scale, err_msg=key)


def test_compile_refuses_the_synchronising_step(monkeypatch):
    """The check above has teeth: with a host call inside (scipy's matching), compiling fails."""
    synchronising(monkeypatch)
    step, inputs = loss_and_grad()
    with pytest.raises(ValueError, match="eval"):
        mx.compile(step)(*inputs)
