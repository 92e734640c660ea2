"""`kernels.channel_affine` against MLX's own ops (x * scale + shift, + residual, max(., 0)): bit for
bit with and without each part, at non-finite inputs and signed zeros, over threads; its gradients
against MLX's; `recompute.channel_affine` (training's, whose backward reads the output) with MLX's
ops' gradients; the frozen batch norm of the backbone the same in eval mode as in training."""

import sys

import kernels
from kernels import native

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(native.missing() is not None, reason=f"{native.missing()}")


def mlx_ops(x, scale, shift, residual=None, relu=False):
    y = x * scale + shift
    y = y if residual is None else y + residual
    return mx.maximum(y, 0) if relu else y


def assert_bits(got, want):
    got, want = np.array(got), np.array(want)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def arrays(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    x.flat[:12] = [np.nan, -0.0, 0.0, np.inf, -np.inf, 1e-45, -1e-45, 3e38, -3e38, -np.nan, 0.0, -0.0]
    scale = rng.standard_normal(shape[-1]).astype(np.float32)
    scale[:3] = [0.0, -1.0, np.inf]
    shift = rng.standard_normal(shape[-1]).astype(np.float32)
    shift[4] = -np.inf
    residual = rng.standard_normal(shape).astype(np.float32)
    residual.flat[20:24] = [np.nan, -0.0, np.inf, -np.inf]
    return (mx.array(a) for a in (x, scale, shift, residual))


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("shape", [(2, 7, 9, 70), (1, 5, 5, 8), (33, 5)])
def test_channel_affine_is_mlx_ops_bit_for_bit(shape, with_residual, relu, rng):
    x, scale, shift, residual = arrays(rng, shape)
    residual = residual if with_residual else None
    assert_bits(kernels.channel_affine(x, scale, shift, residual, relu), mlx_ops(x, scale, shift, residual, relu))


def test_channel_affine_threads_split_rows_not_results(rng, monkeypatch):
    x, scale, shift, residual = arrays(rng, (1, 61, 67, 64))  # above the 2^16 elements a thread
    results = []
    for count in (1, 3):
        monkeypatch.setattr(sys.modules["kernels.channel_affine"], "threads", lambda count=count: count)
        results.append(np.array(kernels.channel_affine(x, scale, shift, residual, True)))
    assert_bits(results[0], results[1])
    assert_bits(results[0], mlx_ops(x, scale, shift, residual, True))


@pytest.mark.parametrize("relu", [False, True])
def test_channel_affine_gradients_are_mlx_ops_gradients(relu, rng):
    x, scale, shift, residual = (
        mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((2, 6, 5, 16), (16,), (16,), (2, 6, 5, 16))
    )
    cotangent = mx.array(rng.standard_normal((2, 6, 5, 16)).astype(np.float32))

    def run(f):
        return mx.vjp(lambda *a: f(*a, relu=relu), [x, scale, shift, residual], [cotangent])

    (got,), got_grads = run(kernels.channel_affine)
    (want,), want_grads = run(mlx_ops)
    assert_bits(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-5)


def test_channel_affine_is_lazy_and_compiles(rng):
    x, scale, shift, residual = (
        mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((4, 8), (8,), (8,), (4, 8))
    )
    got = mx.compile(lambda *a: kernels.channel_affine(*a, relu=True).sum())(x, scale, shift, residual)
    assert_bits(got, mlx_ops(x, scale, shift, residual, True).sum())


def test_channel_affine_of_other_dtypes_is_mlx_ops(rng):
    x, scale, shift, residual = (
        mx.array(rng.standard_normal(s).astype(np.float32)).astype(mx.bfloat16) for s in ((4, 8), (8,), (8,), (4, 8))
    )
    assert_bits(
        kernels.channel_affine(x, scale, shift, residual, True).astype(mx.float32),
        mlx_ops(x, scale, shift, residual, True).astype(mx.float32),
    )


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("relu", [False, True])
def test_recomputed_channel_affine_has_mlx_ops_gradients(with_residual, relu, rng):
    """Training's op, whose backward is (g where the output is positive) * scale: MLX's ops' output and
    gradients, x's and the residual's bit for bit (a zero's sign aside), the scale's and shift's too."""
    from deformable_detr.models import recompute

    x, scale, shift, residual = arrays(rng, (2, 6, 5, 16))
    x, residual = mx.nan_to_num(x), mx.nan_to_num(residual)  # finite: the gradients' sums compared
    scale, shift = mx.nan_to_num(scale), mx.nan_to_num(shift)
    primals = [x, scale, shift, residual] if with_residual else [x, scale, shift]
    cotangent = mx.array(rng.standard_normal((2, 6, 5, 16)).astype(np.float32))

    def run(f):
        return mx.vjp(lambda *a: f(*a[:3], a[3] if with_residual else None, relu=relu), primals, [cotangent])

    (got,), got_grads = run(recompute.channel_affine)
    (want,), want_grads = run(mlx_ops)
    assert_bits(got, want)
    for name, g, w in zip(("x", "scale", "shift", "residual"), got_grads, want_grads, strict=False):
        if name in ("x", "residual"):
            np.testing.assert_array_equal(np.array(g), np.array(w), err_msg=name)
        else:
            np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-5, err_msg=name)


def test_frozen_batch_norm_is_the_same_in_eval_mode_as_in_training(rng):
    """Eval mode takes the kernel, training recompute.channel_affine: a ResNet-50's outputs agree bit for
    bit, and in training its weights' gradients are those of MLX's ops (x * scale + shift, + residual, ReLU)."""
    from deformable_detr.models.backbone import ResNet

    from mlx.utils import tree_flatten, tree_unflatten

    mx.random.seed(0)
    net = ResNet("resnet50", width=16)
    statistics = [
        (k, mx.array(rng.uniform(0.5, 1.5, v.shape).astype(np.float32)) if v.ndim == 1 else v)
        for k, v in tree_flatten(net.parameters())
    ]
    net.update(tree_unflatten(statistics))
    x = mx.array(rng.standard_normal((1, 64, 96, 3)).astype(np.float32))
    net.eval()
    evaluated = net(x)
    net.train()
    trained = net(x)
    for got, want in zip(evaluated, trained, strict=True):
        assert_bits(got, want)

    from deformable_detr.models.precision import FrozenBatchNorm2d

    def loss(model, x):
        return sum((y * y).mean() for y in model(x))

    def with_mlx_ops(self, x, residual=None, relu=False):
        scale = self.weight * mx.rsqrt(self.running_var + self.eps)
        return mlx_ops(x, scale, self.bias - self.running_mean * scale, residual, relu)

    _, grads = nn.value_and_grad(net, loss)(net, x)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FrozenBatchNorm2d, "__call__", with_mlx_ops)
        _, want = nn.value_and_grad(net, loss)(net, x)
    for (name, g), (_, w) in zip(tree_flatten(grads), tree_flatten(want), strict=True):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("with_residual", [False, True])
def test_channel_affine_takes_over_a_buffer_nothing_else_holds(with_residual, rng):
    """A fresh x (or residual) gives its buffer to the output, as MLX's element-wise ops do: the same
    bits, and no more memory at the peak than MLX's ops."""
    x, scale, shift, residual = (
        mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((1, 64, 80, 64), (64,), (64,), (1, 64, 80, 64))
    )
    peaks, results = [], []
    for f in (mlx_ops, kernels.channel_affine):
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        y = f(x * 2, scale, shift, residual * 2 if with_residual else None, relu=True)  # fresh: nothing holds them
        mx.eval(y)
        peaks.append(mx.get_peak_memory() - base)
        results.append(np.array(y))
        del y
    assert_bits(results[1], results[0])
    assert peaks[1] <= peaks[0]
