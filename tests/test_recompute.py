"""Activation checkpointing (`train.activation_checkpointing`) recomputes backbone stages 2-4 and every
encoder and decoder layer in the backward: the gradients must be those without it, dropout on (the
recomputation draws the same masks)."""

from contextlib import contextmanager

from deformable_detr import build_model, load_config
from deformable_detr.models import recompute
from deformable_detr.training.trainer import Trainer

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_lazy_step import batch
from test_train import TINY, TINY_IMAGES


def gradients(activation_checkpointing: bool, step_seed: int = 0, backbone_trains: bool = True):
    trains = ["optimizer.lr_backbone=1e-5", "optimizer.freeze_stem_and_layer1=false"]  # its stages checkpointed too
    cfg = load_config(
        TINY,
        [
            "model.dropout=0.3",
            "model.two_stage=true",
            "model.with_box_refine=true",
            *(trains if backbone_trains else []),
            f"train.activation_checkpointing={str(activation_checkpointing).lower()}",
        ],
    )
    mx.random.seed(0)
    model = build_model(cfg)
    model.train()
    trainer = Trainer.from_config(model, cfg, TINY_IMAGES)
    images, mask, targets = batch()
    mx.random.seed(step_seed)
    (total, _), grads = trainer.loss_and_grad(images, mask, targets, 4.0)
    mx.eval(total, grads)
    return total.item(), {k: np.array(v) for k, v in tree_flatten(grads)}


def largest_difference(a, b):
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max() / max(np.abs(b[k]).max(), 1e-12)) for k in b)


@pytest.fixture(scope="module")
def plain():
    return gradients(False)


def test_checkpointing_gives_the_same_gradients_with_dropout(plain):
    total, grads = gradients(True)
    assert total == pytest.approx(plain[0], rel=1e-6)
    assert any(k.startswith("backbone.0.body.layer2") for k in grads)
    assert largest_difference(grads, plain[1]) < 1e-4


def test_checkpointing_a_frozen_backbone(plain):
    """lr_backbone 0 freezes the backbone: its checkpointed stages have no parameters to pass (this
    raised a ValueError before)."""
    total, grads = gradients(True, backbone_trains=False)
    reference_total, reference = gradients(False, backbone_trains=False)
    assert not any(k.startswith("backbone.") for k in grads)
    assert total == pytest.approx(reference_total, rel=1e-6) and largest_difference(grads, reference) < 1e-4


def test_dropout_is_on_and_the_masks_matter(plain):
    """Another step seed draws other masks: the comparison above is not of dropout-free networks."""
    _, grads = gradients(False, step_seed=1)
    assert largest_difference(grads, plain[1]) > 0.05


def test_a_recomputation_with_fresh_masks_is_caught(monkeypatch):
    """What the key in recompute.py prevents: if dropout drew from MLX's generator (as
    `nn.Dropout` under `nn.utils.checkpoint` does), the forward would be the same but the
    recomputation would draw other masks, and the gradients would be another network's."""

    @contextmanager
    def global_generator(key):
        with original(None):
            yield

    original = recompute._drawing_from
    monkeypatch.setattr(recompute, "_drawing_from", global_generator)
    total, grads = gradients(True)
    want_total, want_grads = gradients(False)
    assert total == pytest.approx(want_total, rel=1e-6)  # the same forward
    assert largest_difference(grads, want_grads) > 0.05


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_drops_a_fraction_p_and_keeps_the_mean(p):
    dropout = recompute.Dropout(p)
    x = mx.ones((1000, 1000))
    with recompute._drawing_from(mx.random.key(3)):
        y = np.array(dropout(x))
    with recompute._drawing_from(mx.random.key(3)):
        again = np.array(dropout(x))
    assert (y == 0).mean() == pytest.approx(p, abs=0.003)
    assert y.mean() == pytest.approx(1.0, abs=0.005)
    np.testing.assert_array_equal(y, again)  # a key gives its masks again
    dropout.eval()
    assert dropout(x) is x


def test_relu_gradient_is_pytorchs_read_from_the_output():
    """`recompute.relu` keeps its output, not its input, for the backward, and gives PyTorch's ReLU
    gradient (0 at 0) wherever x falls."""
    torch = pytest.importorskip("torch", reason="PyTorch is the reference for ReLU's gradient")
    x = np.array([-2.0, -1e-30, 0.0, 1e-30, 0.5, 3.0] * 3, np.float32)
    cotangent = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    (ours,), (grad,) = mx.vjp(recompute.relu, [mx.array(x)], [mx.array(cotangent)])
    reference = torch.tensor(x, requires_grad=True)
    torch.relu(reference).backward(torch.tensor(cotangent))
    np.testing.assert_array_equal(np.array(ours), torch.relu(torch.tensor(x)).numpy())
    np.testing.assert_array_equal(np.array(grad), reference.grad.numpy())


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_dropout_after_relu_is_dropout_of_relu(dtype):
    """The fused op draws the same mask and gives the same output and gradient as the two ops."""
    dropout = recompute.Dropout(0.3)
    x = mx.random.normal((64, 1024), key=mx.random.key(0)).astype(dtype)
    x = mx.where(mx.arange(1024) % 7 == 0, 0, x)  # exact zeros as well
    cotangent = mx.random.normal((64, 1024), key=mx.random.key(1)).astype(dtype)

    def run(fused):
        def f(x):
            with recompute._drawing_from(mx.random.key(2)):
                return dropout(x, after_relu=True) if fused else dropout(recompute.relu(x))

        (out,), (grad,) = mx.vjp(f, [x], [cotangent])
        return np.array(out.astype(mx.float32)), np.array(grad.astype(mx.float32))

    (out, grad), (want_out, want_grad) = run(True), run(False)
    assert 0.25 < (want_out == 0).mean() < 0.75 and (want_grad != 0).mean() > 0.25
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(grad, want_grad)
    dropout.eval()
    assert mx.array_equal(dropout(x, after_relu=True), recompute.relu(x)).item()


def test_dropout_after_relu_keeps_only_its_output_for_the_backward():
    """What the fused op is for: an FFN's backward keeps (L, 1024) once, not the linear's output, the
    mask and the dropped output. Peaks in units of one such activation (measured: 3.9 against 4.9 with
    kernels.masked_scale, whose own VJP needs only the mask; 4.6 against 6.6 with MLX's where)."""
    dropout = recompute.Dropout(0.1)
    n, hidden = 4096, 1024
    x, w1, w2 = (
        mx.random.normal(s, key=mx.random.key(i)) * 0.05 for i, s in enumerate([(n, 256), (256, hidden), (hidden, 256)])
    )
    mx.eval(x, w1, w2)

    def peak(fused):
        def f(w1, w2):
            with recompute._drawing_from(mx.random.key(1)):
                h = dropout(x @ w1, after_relu=True) if fused else dropout(recompute.relu(x @ w1))
            return (h @ w2).sum()

        mx.synchronize()
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(mx.grad(f, argnums=(0, 1))(w1, w2))
        return (mx.get_peak_memory() - base) / (n * hidden * 4)

    fused, unfused = peak(True), peak(False)
    assert fused < unfused - 0.75 and fused < 4.25
