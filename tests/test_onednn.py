"""kernels.onednn: convolutions and matrix products on oneDNN, with their gradients, against MLX's own
(`mx.conv2d`, `@`, their VJPs). float32: to float32 rounding. bfloat16 products (float32 accumulation):
equal, to float32 rounding, to MLX's float32 operations on the operands rounded to bfloat16, which is
what a bfloat16 product with a float32 sum computes; the cotangents are rounded the same way for the
gradients. Then where it is not used (MLX's answers), and the inference precision that rides on it."""

import subprocess
import sys

import kernels
from deformable_detr.models.precision import inference_precision
from kernels import onednn

import mlx.core as mx
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(onednn.module() is None, reason=f"oneDNN is not used here: {onednn.missing()}")


def rounded(a):
    """`a` rounded to bfloat16, as float32."""
    return a.astype(mx.bfloat16).astype(mx.float32)


def assert_close(got, want, tolerance):
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    scale = max(np.abs(want).max(), 1e-6)
    assert np.abs(got - want).max() <= tolerance * scale, (np.abs(got - want).max(), scale)


CONVOLUTIONS = [  # (kernel, stride, padding, dilation, input size, channels in, out)
    (1, 1, 0, 1, (7, 9), 16, 32),
    (1, 2, 0, 1, (9, 12), 32, 16),  # a ResNet downsample
    (3, 1, 1, 1, (10, 11), 16, 16),
    (3, 2, 1, 1, (11, 10), 16, 32),
    (3, 1, 2, 2, (12, 9), 16, 16),  # DC5's dilated stage
    (7, 2, 3, 1, (17, 15), 3, 16),  # the stem
]


@pytest.mark.parametrize("kernel,stride,padding,dilation,size,cin,cout", CONVOLUTIONS)
@pytest.mark.parametrize("products", ["float32", "bfloat16"])
def test_conv2d_and_its_gradients_equal_mlx(kernel, stride, padding, dilation, size, cin, cout, products, rng):
    x = mx.array(rng.standard_normal((2, *size, cin)).astype(np.float32))
    w = mx.array(rng.standard_normal((cout, kernel, kernel, cin)).astype(np.float32) / (kernel * kernel * cin) ** 0.5)
    bf16 = products == "bfloat16"
    with onednn.products_in(mx.bfloat16 if bf16 else mx.float32):
        y = onednn.conv2d(x, w, stride, padding, dilation)
    assert y is not None and y.dtype == mx.float32
    as_used = rounded if bf16 else (lambda a: a)
    want = mx.conv2d(as_used(x), as_used(w), stride, padding, dilation)
    assert_close(y, want, 1e-6)
    cotangent = mx.array(rng.standard_normal(want.shape).astype(np.float32))

    def ours(x, w):
        with onednn.products_in(mx.bfloat16 if bf16 else mx.float32):
            return (onednn.conv2d(x, w, stride, padding, dilation) * cotangent).sum()

    def theirs(x, w):  # the cotangent as ours uses it in the backward's products
        return (mx.conv2d(x, w, stride, padding, dilation) * as_used(cotangent)).sum()

    got = mx.grad(ours, argnums=(0, 1))(x, w)
    want = mx.grad(theirs, argnums=(0, 1))(as_used(x), as_used(w))
    for g, r in zip(got, want, strict=True):
        assert g.dtype == mx.float32
        assert_close(g, r, 1e-5)


@pytest.mark.parametrize("kernel,stride,padding,dilation,size,cin,cout", CONVOLUTIONS[2:4])
def test_conv2d_of_bfloat16_operands_is_bfloat16(kernel, stride, padding, dilation, size, cin, cout, rng):
    """train.precision: bfloat16 hands it bfloat16 activations and weights: a bfloat16 result and gradients."""
    x = mx.array(rng.standard_normal((2, *size, cin)).astype(np.float32)).astype(mx.bfloat16)
    w = mx.array(rng.standard_normal((cout, kernel, kernel, cin)).astype(np.float32)).astype(mx.bfloat16)
    y = onednn.conv2d(x, w, stride, padding, dilation)
    assert y.dtype == mx.bfloat16
    want = mx.conv2d(x.astype(mx.float32), w.astype(mx.float32), stride, padding, dilation)
    assert_close(y, want, 2**-8)  # the result rounded to bfloat16
    gx, gw = mx.grad(lambda x, w: onednn.conv2d(x, w, stride, padding, dilation).astype(mx.float32).sum(), (0, 1))(x, w)
    rx, rw = mx.grad(lambda x, w: mx.conv2d(x, w, stride, padding, dilation).sum(), (0, 1))(
        x.astype(mx.float32), w.astype(mx.float32)
    )
    assert (gx.dtype, gw.dtype) == (mx.bfloat16, mx.bfloat16)
    assert_close(gx, rx, 2**-7)
    assert_close(gw, rw, 2**-7)


@pytest.mark.parametrize("products", ["float32", "bfloat16"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_and_its_gradients_equal_mlx(products, bias, rng):
    x = mx.array(rng.standard_normal((3, 37, 24)).astype(np.float32))
    w = mx.array(rng.standard_normal((40, 24)).astype(np.float32) / 24**0.5)
    b = mx.array(rng.standard_normal(40).astype(np.float32)) if bias else None
    bf16 = products == "bfloat16"
    as_used = rounded if bf16 else (lambda a: a)
    cotangent = mx.array(rng.standard_normal((3, 37, 40)).astype(np.float32))

    def ours(x, w, b):
        with onednn.products_in(mx.bfloat16 if bf16 else mx.float32):
            return onednn.linear(x, w, b)

    def theirs(x, w, b):  # MLX's, given the operands as ours uses them
        return x @ w.T + (b if b is not None else 0)

    assert_close(ours(x, w, b), theirs(as_used(x), as_used(w), b), 1e-6)
    arguments = (0, 1, 2) if bias else (0, 1)
    got = mx.grad(lambda *a: (ours(*a) * cotangent).sum(), arguments)(x, w, b)
    # the gradients' products take the cotangent (and x, w) as bfloat16 too; the bias's is a plain sum
    want = mx.grad(lambda *a: (theirs(*a) * as_used(cotangent)).sum(), arguments)(as_used(x), as_used(w), b)
    if bias:
        want = (*want[:2], cotangent.sum(axis=(0, 1)))
    for g, r in zip(got, want, strict=True):
        assert g.dtype == mx.float32
        assert_close(g, r, 1e-5)


def test_the_models_linear_and_conv_run_on_it_and_products_in_is_scoped(rng):
    x = mx.array(rng.standard_normal((50, 64)).astype(np.float32))
    w = mx.array(rng.standard_normal((32, 64)).astype(np.float32))
    exact = x @ w.T
    assert_close(kernels.linear(x, w), exact, 1e-6)
    with onednn.products_in(mx.bfloat16):
        inside = kernels.linear(x, w)
        with onednn.products_in(mx.float32):  # the heads' float32 inside a bfloat16 forward
            heads = kernels.linear(x, w)
    assert_close(inside, rounded(x) @ rounded(w).T, 1e-6)
    assert np.abs(np.array(inside - exact)).max() > 1e-4  # bfloat16 products did round
    assert_close(heads, exact, 1e-6)
    assert_close(kernels.linear(x, w), exact, 1e-6)  # outside again
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        with onednn.products_in(mx.float16):
            pass


def test_not_used_in_export_mode_or_off_the_cpu(rng):
    x = mx.array(rng.standard_normal((1, 6, 6, 4)).astype(np.float32))
    w = mx.array(rng.standard_normal((4, 3, 3, 4)).astype(np.float32))
    with kernels.export_mode():
        assert onednn.conv2d(x, w, 1, 1) is None
        assert onednn.linear(x, w.reshape(4, -1)[:, :4]) is None
    assert onednn.conv2d(x.astype(mx.float16), w.astype(mx.float16), 1, 1) is None  # float16: MLX's


def test_without_it_mlx_computes_and_says_so_once(capsys, monkeypatch, rng):
    monkeypatch.setattr(onednn, "_library", lambda: None)
    monkeypatch.setattr(onednn, "EXPECTED", True)
    onednn._load.cache_clear()
    onednn._say_missing_once.cache_clear()
    try:
        x = mx.array(rng.standard_normal((4, 8)).astype(np.float32))
        w = mx.array(rng.standard_normal((3, 8)).astype(np.float32))
        assert onednn.linear(x, w) is None and onednn.linear(x, w) is None
        assert_close(kernels.linear(x, w), x @ w.T, 1e-6)
        assert inference_precision("auto")[0] == "float32"
        lines = capsys.readouterr().err.splitlines()
        assert lines == [
            "kernels: convolutions and products run on MLX, not oneDNN: oneDNN's library is not "
            "installed (pip install onednn-cpu-gomp==2023.2.0)"
        ]
    finally:
        onednn._load.cache_clear()
        onednn._say_missing_once.cache_clear()


def test_switched_off_by_its_variable_silently():
    code = (
        "import kernels, mlx.core as mx; from kernels import onednn; x = mx.ones((2, 3)); "
        "assert onednn.linear(x, x) is None and onednn.missing() == 'DEFORMABLE_DETR_ONEDNN=0'; "
        "print(kernels.linear(x, x).tolist())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**__import__("os").environ, "DEFORMABLE_DETR_ONEDNN": "0"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "[[3.0, 3.0], [3.0, 3.0]]" and done.stderr == ""


def test_auto_precision_follows_the_cpus_bfloat16_instructions(monkeypatch):
    monkeypatch.setattr(onednn, "bfloat16_instructions", lambda: ["avx512_bf16"])
    assert inference_precision("auto") == ("bfloat16", "auto: this CPU has avx512_bf16")
    monkeypatch.setattr(onednn, "bfloat16_instructions", lambda: [])
    assert inference_precision("auto")[0] == "float32"
    assert inference_precision("bfloat16") == ("bfloat16", "asked for")
    with pytest.raises(ValueError, match="expected one of auto, float32, bfloat16"):
        inference_precision("fp16")


def test_bfloat16_instructions_are_read_from_cpuinfo():
    flags = open("/proc/cpuinfo").read().split()
    assert onednn.bfloat16_instructions() == [f for f in onednn.BFLOAT16_FLAGS if f in flags]


def test_a_shape_it_has_only_im2col_for_is_mlxs(rng):
    """A 7 x 7 stem on a one-pixel-wide image: oneDNN 3.2 offers only its im2col + GEMM there (which
    crashed): refused, and the model's convolution computes it with MLX, gradients included."""
    from deformable_detr.models.backbone import Conv2d

    x = mx.array(rng.standard_normal((1, 64, 1, 3)).astype(np.float32))
    conv = Conv2d(3, 8, 7, 2, 3, bias=False)
    assert onednn.conv2d(x, conv.weight, 2, 3) is None
    np.testing.assert_allclose(np.array(conv(x)), np.array(mx.conv2d(x, conv.weight, 2, 3)), rtol=1e-6, atol=1e-6)
    got = mx.grad(lambda x: conv(x).sum())(x)
    want = mx.grad(lambda x: mx.conv2d(x, conv.weight, 2, 3).sum())(x)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
