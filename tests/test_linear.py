"""`kernels.linear` where oneDNN is not used (its path there: tests/test_onednn.py) against
`mx.addmm(bias, x, weight.T)` (what `nn.Linear` computes): bit for bit in 2 and 3 dimensions, over
threads, with its gradients; without a bias; other dtypes; and the model's `Linear` against `nn.Linear`
with the same parameters."""

import sys

import kernels
from kernels import native

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(native.missing() is not None, reason=f"{native.missing()}")


@pytest.fixture(autouse=True)
def without_onednn(monkeypatch):
    monkeypatch.setattr(kernels.onednn, "linear", lambda *args: None)


def assert_bits(got, want):
    got, want = np.array(got), np.array(want)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def operands(rng, shape, out):
    x = mx.array(rng.standard_normal(shape).astype(np.float32))
    weight = mx.array(rng.standard_normal((out, shape[-1])).astype(np.float32))
    bias = mx.array(rng.standard_normal(out).astype(np.float32))
    return x, weight, bias


@pytest.mark.parametrize("shape, out", [((300, 256), 256), ((2, 517, 64), 1024), ((1, 3, 7, 33), 5), ((9,), 4)])
def test_linear_is_addmm_bit_for_bit(shape, out, rng):
    x, weight, bias = operands(rng, shape, out)
    assert_bits(kernels.linear(x, weight, bias), mx.addmm(bias, x, weight.T))
    assert_bits(kernels.linear(x, weight), x @ weight.T)


def test_linear_threads_split_rows_not_results(rng, monkeypatch):
    x, weight, bias = operands(rng, (1, 1031, 128), 256)  # above the 2^16 elements a thread
    results = []
    for count in (1, 3):
        monkeypatch.setattr(sys.modules["kernels.linear"], "threads", lambda count=count: count)
        results.append(np.array(kernels.linear(x, weight, bias)))
    assert_bits(results[0], results[1])
    assert_bits(results[0], mx.addmm(bias, x, weight.T))


def test_linear_gradients_are_addmms(rng):
    x, weight, bias = operands(rng, (2, 40, 24), 16)
    cotangent = mx.array(rng.standard_normal((2, 40, 16)).astype(np.float32))
    (got,), got_grads = mx.vjp(kernels.linear, [x, weight, bias], [cotangent])
    (want,), want_grads = mx.vjp(lambda a, w, b: mx.addmm(b, a, w.T), [x, weight, bias], [cotangent])
    assert_bits(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-5)


def test_linear_of_other_dtypes_is_addmm(rng):
    x, weight, bias = (a.astype(mx.bfloat16) for a in operands(rng, (6, 8), 4))
    assert_bits(kernels.linear(x, weight, bias).astype(mx.float32), mx.addmm(bias, x, weight.T).astype(mx.float32))


def test_models_linear_is_nn_linear(rng):
    from deformable_detr.models.linear import Linear

    ours, theirs = Linear(32, 48), nn.Linear(32, 48)
    theirs.update(ours.parameters())
    x = mx.array(rng.standard_normal((3, 11, 32)).astype(np.float32))
    assert_bits(ours(x), theirs(x))
