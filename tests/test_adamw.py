"""The recipe's optimizer step (deformable_detr/training/optimizer.py: AdamW on kernels.adamw_update,
clipping folded into it) against MLX's own: mlx.optimizers.AdamW after optim.clip_grad_norm, bit for
bit over several steps, on the C++ operation and on MLX's ops alike, clipping on and off."""

import math

import kernels
import kernels.adamw
from deformable_detr.training.optimizer import AdamW, clip_and_update

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

native = pytest.mark.skipif(
    kernels.native.module() is None, reason=f"the C++ extension is not built: {kernels.native.missing()}"
)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Linear(300, 700)  # 210,000 weights: more than one thread's share
        self.head = nn.Linear(700, 3)


def grads_for(model, seed: int):
    rng = np.random.default_rng(seed)
    return tree_map(lambda p: mx.array(rng.standard_normal(p.shape).astype(np.float32)), model.trainable_parameters())


def optimizers(kind):
    def adamw(lr):
        if kind == "mlx":
            return optim.AdamW(learning_rate=lr, betas=[0.9, 0.999], eps=1e-8, weight_decay=1e-4, bias_correction=True)
        return AdamW(learning_rate=lr, betas=[0.9, 0.999], eps=1e-8, weight_decay=1e-4)

    return optim.MultiOptimizer([adamw(2e-5), adamw(2e-4)], [lambda path, _: path.startswith("backbone")])


def three_steps(kind, max_norm):
    mx.random.seed(0)
    model = Model()
    optimizer = optimizers(kind)
    norms = []
    for step in range(3):
        grads = grads_for(model, step)
        if kind == "mlx":
            clipped, norm = optim.clip_grad_norm(grads, max_norm)
            optimizer.update(model, clipped)
        else:
            norm = clip_and_update(optimizer, model, grads, max_norm)
        if step == 1:  # the learning rate changed between steps, as the step decay does
            for sub in optimizer.optimizers:
                sub.learning_rate = sub.learning_rate * 0.1
        mx.eval(model.parameters(), optimizer.state, norm)
        norms.append(norm.item())
    return model, optimizer, norms


def assert_same(ours, theirs):
    (model, optimizer, norms), (model_ref, optimizer_ref, norms_ref) = ours, theirs
    assert norms == norms_ref
    for (name, p), (_, q) in zip(tree_flatten(model.parameters()), tree_flatten(model_ref.parameters()), strict=True):
        np.testing.assert_array_equal(np.array(p), np.array(q), err_msg=name)
    for (name, p), (_, q) in zip(tree_flatten(optimizer.state), tree_flatten(optimizer_ref.state), strict=True):
        np.testing.assert_array_equal(np.array(p), np.array(q), err_msg=name)


@native
@pytest.mark.parametrize("max_norm", [0.1, math.inf], ids=["clipped", "unclipped"])
def test_the_fused_step_is_mlx_adamw_after_clipping_bit_for_bit(max_norm):
    ours = three_steps("ours", max_norm)
    assert_same(ours, three_steps("mlx", max_norm))
    moved = np.abs(np.array(ours[0].head.weight) - np.array(Model().head.weight)).max()
    assert moved > 1e-5  # the steps did move the weights


@pytest.mark.parametrize("max_norm", [0.1, math.inf], ids=["clipped", "unclipped"])
def test_mlx_ops_path_is_mlx_adamw_after_clipping_bit_for_bit(monkeypatch, max_norm):
    monkeypatch.setattr(kernels.adamw.native, "for_float32", lambda *arrays: None)
    assert_same(three_steps("ours", max_norm), three_steps("mlx", max_norm))


@native
def test_the_operation_makes_its_three_outputs_and_nothing_more():
    """The new parameter, m and v and no temporaries (MLX's ops make one an operation, most of them
    written into their inputs' buffers)."""
    shape = (1000, 1000)
    factors = kernels.adamw.adamw_factors(mx.array(1e-3), 1e-4, 0.9, 0.999, mx.array(1))
    p, g, m, v = (mx.random.normal(shape) for _ in range(4))
    mx.eval(factors, p, g, m, v)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    new = kernels.adamw.adamw_update(p, g, m, v, factors, 0.9, 0.999, 1e-8)
    del p, m, v
    mx.eval(new)
    assert mx.get_peak_memory() - base <= 3 * 4 * 10**6 + 2**16
