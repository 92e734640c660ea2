"""What follows a product in the network as oneDNN post-ops of it (kernels.onednn.conv2d's bias, residual and
ReLU; linear's ReLU), their gradients, the result's dtype (bfloat16 kept between products), and the model's
uses: the frozen batch norm folded into the convolution before it (Conv2d.with_batch_norm), the FFN's ReLU in
linear1. References: MLX's own operations on the same (or bfloat16-rounded) operands, and the unfolded model."""

import kernels
from deformable_detr.models.backbone import ResNet
from deformable_detr.models.convolution import Conv2d
from deformable_detr.models.deformable_transformer import feed_forward, with_feed_forward
from deformable_detr.models.precision import FrozenBatchNorm2d
from kernels import onednn

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from test_onednn import PRODUCTS, assert_close, needs_bfloat16, rounded

pytestmark = pytest.mark.skipif(onednn.module() is None, reason=f"oneDNN is not used here: {onednn.missing()}")
FUSIONS = [  # (bias, residual, relu)
    (True, False, False),
    (False, False, True),
    (True, True, True),  # a ResNet block's last convolution, its norm folded
    (False, True, False),
]


@pytest.mark.parametrize("kernel,stride,padding", [(1, 1, 0), (3, 2, 1), (7, 2, 3)])
@pytest.mark.parametrize("bias,residual,relu", FUSIONS)
@pytest.mark.parametrize("products", PRODUCTS)
def test_conv2d_post_ops_and_their_gradients_equal_mlx(kernel, stride, padding, bias, residual, relu, products, rng):
    x = mx.array(rng.standard_normal((2, 13, 11, 16)).astype(np.float32))
    w = mx.array(rng.standard_normal((24, kernel, kernel, 16)).astype(np.float32) / (kernel * kernel * 16) ** 0.5)
    out_h, out_w = (13 + 2 * padding - kernel) // stride + 1, (11 + 2 * padding - kernel) // stride + 1
    b = mx.array(rng.standard_normal(24).astype(np.float32)) if bias else None
    r = mx.array(rng.standard_normal((2, out_h, out_w, 24)).astype(np.float32)) if residual else None
    cotangent = mx.array(rng.standard_normal((2, out_h, out_w, 24)).astype(np.float32))
    bf16 = products == "bfloat16"
    as_used = rounded if bf16 else (lambda a: a)

    def ours(x, w, b, r):
        with onednn.products_in(mx.bfloat16 if bf16 else mx.float32):
            return onednn.conv2d(x, w, stride, padding, 1, bias=b, residual=r, relu=relu)

    def theirs(x, w, b, r):
        y = mx.conv2d(as_used(x), as_used(w), stride, padding)
        y = y + b if b is not None else y
        y = y + r if r is not None else y
        return mx.maximum(y, 0) if relu else y

    y = ours(x, w, b, r)
    assert y.dtype == mx.float32
    assert_close(y, theirs(x, w, b, r), 1e-6)
    operands = [a for a in (x, w, b, r) if a is not None]
    argnums = tuple(range(len(operands)))

    def loss(f):
        def of(*given):
            it = iter(given)
            args = [next(it) if a is not None else None for a in (x, w, b, r)]
            return (f(*args) * cotangent).sum()

        return of

    got = mx.grad(loss(ours), argnums)(*operands)
    # the backward's products take the cotangent (masked by the ReLU) as ours rounds it
    want = mx.grad(loss(theirs), argnums)(*operands)
    for g, expected in zip(got, want, strict=True):
        assert g.dtype == mx.float32
        assert_close(g, expected, 1e-5 if not bf16 else 2**-7)


@needs_bfloat16
def test_the_result_stays_bfloat16_between_bfloat16_products_or_takes_the_dtype_asked(rng):
    x = mx.array(rng.standard_normal((1, 9, 9, 32)).astype(np.float32))
    w = mx.array(rng.standard_normal((32, 3, 3, 32)).astype(np.float32) / 17)
    with onednn.products_in(mx.bfloat16):
        kept = onednn.conv2d(x, w, 1, 1, 1, relu=True, keep_bfloat16=True)
        assert kept.dtype == mx.bfloat16
        following = onednn.conv2d(kept, w, 1, 1, 1, residual=kept, relu=True, keep_bfloat16=True)
        assert following.dtype == mx.bfloat16
        back = onednn.conv2d(kept, w, 1, 1, 1, dtype=mx.float32)
        assert back.dtype == mx.float32
        hidden = onednn.linear(x.reshape(-1, 32), w.reshape(32, -1)[:, :32], relu=True, keep_bfloat16=True)
        assert hidden.dtype == mx.bfloat16
    with onednn.products_in(mx.float32):
        assert onednn.conv2d(x, w, 1, 1, 1, relu=True, keep_bfloat16=True).dtype == mx.float32
    first = mx.maximum(mx.conv2d(rounded(x), rounded(w), 1, 1), 0)
    assert_close(kept, first, 2**-8)  # the float32 result rounded once to bfloat16
    second = mx.maximum(mx.conv2d(kept.astype(mx.float32), rounded(w), 1, 1) + kept.astype(mx.float32), 0)
    assert_close(following, second, 2**-8)
    assert_close(back, mx.conv2d(kept.astype(mx.float32), rounded(w), 1, 1), 1e-6)


@pytest.mark.parametrize("products", PRODUCTS)
@pytest.mark.parametrize("relu,residual", [(True, False), (False, True), (True, True)])
def test_linears_post_ops_and_their_gradients_equal_mlx(products, relu, residual, rng):
    x = mx.array(rng.standard_normal((3, 37, 24)).astype(np.float32))
    w = mx.array(rng.standard_normal((40, 24)).astype(np.float32) / 24**0.5)
    b = mx.array(rng.standard_normal(40).astype(np.float32))
    r = mx.array(rng.standard_normal((3, 37, 40)).astype(np.float32))
    cotangent = mx.array(rng.standard_normal((3, 37, 40)).astype(np.float32))
    bf16 = products == "bfloat16"
    as_used = rounded if bf16 else (lambda a: a)

    def ours(x, w, b, r):
        with onednn.products_in(mx.bfloat16 if bf16 else mx.float32):
            y = onednn.linear(x, w, b, relu=relu, residual=r if residual else None)
        assert y.dtype == mx.float32
        return (y * cotangent).sum()

    def theirs(x, w, b, r):
        y = as_used(x) @ as_used(w).T + b + (r if residual else 0)
        return ((mx.maximum(y, 0) if relu else y) * cotangent).sum()

    assert_close(ours(x, w, b, r), theirs(x, w, b, r), 1e-5)
    got, want = mx.grad(ours, (0, 1, 2, 3))(x, w, b, r), mx.grad(theirs, (0, 1, 2, 3))(x, w, b, r)
    for g, expected in zip(got[: 3 + residual], want[: 3 + residual], strict=True):
        assert_close(g, expected, 1e-5 if not bf16 else 2**-7)


def a_norm(channels, rng):
    norm = FrozenBatchNorm2d(channels)
    norm.update(
        {
            "weight": mx.array(rng.uniform(0.5, 1.5, channels).astype(np.float32)),
            "bias": mx.array(rng.standard_normal(channels).astype(np.float32)),
            "running_mean": mx.array(rng.standard_normal(channels).astype(np.float32)),
            "running_var": mx.array(rng.uniform(0.5, 2.0, channels).astype(np.float32)),
        }
    )
    return norm


def test_a_folded_batch_norm_equals_the_unfolded_one_and_its_gradients_reach_the_weight(rng):
    mx.random.seed(0)
    conv, norm = Conv2d(16, 32, 3, 2, 1, bias=False), a_norm(32, rng)
    x = mx.array(rng.standard_normal((2, 12, 10, 16)).astype(np.float32))
    r = mx.array(rng.standard_normal((2, 6, 5, 32)).astype(np.float32))
    cotangent = mx.array(rng.standard_normal((2, 6, 5, 32)).astype(np.float32))

    def folded(w, x, r):
        conv.weight = w
        return (conv.with_batch_norm(x, norm, residual=r, relu=True) * cotangent).sum()

    def unfolded(w, x, r):
        conv.weight = w
        return (norm(conv(x), residual=r, relu=True) * cotangent).sum()

    w = conv.weight
    conv.weight = w
    # the weight scaled before the products, not their sums after: float32 rounding apart
    assert_close(conv.with_batch_norm(x, norm, residual=r, relu=True), norm(conv(x), residual=r, relu=True), 1e-6)
    got, want = mx.grad(folded, (0, 1, 2))(w, x, r), mx.grad(unfolded, (0, 1, 2))(w, x, r)
    for g, expected in zip(got, want, strict=True):
        assert_close(g, expected, 1e-5)


def test_in_evaluation_the_folded_weights_are_made_once_and_again_when_the_weights_change(rng):
    mx.random.seed(0)
    conv, norm = Conv2d(8, 8, 3, 1, 1, bias=False), a_norm(8, rng)
    conv.eval()
    x = mx.array(rng.standard_normal((1, 6, 6, 8)).astype(np.float32))
    first = conv.with_batch_norm(x, norm, relu=True)
    kept = conv._folded_weights
    assert "_folded_weights" not in conv.parameters()  # not a parameter: checkpoints hold the unfolded model
    assert conv.with_batch_norm(x, norm, relu=True) is not None and conv._folded_weights is kept
    conv.update({"weight": conv.weight * 2})  # a fine-tune's step, a new checkpoint
    again = conv.with_batch_norm(x, norm, relu=True)
    assert conv._folded_weights is not kept
    assert_close(again, mx.maximum(norm(mx.conv2d(x, conv.weight, 1, 1)), 0), 1e-6)
    assert not np.allclose(np.array(first), np.array(again))


@pytest.mark.parametrize("products", PRODUCTS)
def test_the_resnet_hands_on_its_maps_as_its_products_leave_them_as_the_unfolded_one_computes_them(products, rng):
    mx.random.seed(0)
    body = ResNet("resnet18", width=16)
    for module in body.modules():
        if isinstance(module, FrozenBatchNorm2d):
            module.update(a_norm(module.weight.shape[0], rng).parameters())
    body.eval()
    images = mx.array(rng.standard_normal((1, 64, 80, 3)).astype(np.float32))
    dtype = mx.bfloat16 if products == "bfloat16" else mx.float32
    with onednn.products_in(dtype):
        maps = body(images)
    with kernels.export_mode():  # MLX's convolutions and the norms unfolded, in float32
        reference = body(images)
    for got, want in zip(maps, reference, strict=True):
        assert got.dtype == dtype  # bfloat16 from bfloat16 products: the input projections take them as they are
        # bfloat16: each convolution's operands and result rounded, through 8 blocks
        assert_close(got, want, 1e-5 if products == "float32" else 0.05)


def test_the_ffn_with_its_relu_and_addition_as_post_ops_equals_the_unfused_one(rng):
    mx.random.seed(0)
    layer = nn.Module()
    with_feed_forward(layer, 32, 64, 0.0, "norm")
    layer.eval()
    x = mx.array(rng.standard_normal((2, 50, 32)).astype(np.float32))
    got = feed_forward(layer, x, layer.norm)
    hidden = mx.maximum(x @ layer.linear1.weight.T + layer.linear1.bias, 0)
    want = layer.norm(x + hidden @ layer.linear2.weight.T + layer.linear2.bias)
    assert got.dtype == mx.float32
    assert_close(got, want, 1e-5)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_add_and_masked_rows_on_every_core_equal_mlxs_ops_and_their_gradients(dtype, rng):
    a = mx.array(rng.standard_normal((2, 300, 64)).astype(np.float32)).astype(dtype)
    b = mx.array(rng.standard_normal((2, 300, 64)).astype(np.float32)).astype(dtype)
    row = mx.array(rng.standard_normal((2, 300, 1)).astype(np.float32)).astype(dtype)
    keep = mx.array(rng.uniform(size=(2, 300, 1)) > 0.3)
    assert mx.array_equal(kernels.add(a, b), a + b).item()
    assert mx.array_equal(kernels.add(a, row), a + row).item()  # b broadcast along the last axis
    assert mx.array_equal(kernels.masked_rows(a, keep), mx.where(keep, a, mx.array(0, dtype))).item()
    cotangent = mx.array(rng.standard_normal((2, 300, 64)).astype(np.float32)).astype(dtype)
    got = mx.grad(lambda a, r: (kernels.add(a, r) * cotangent).astype(mx.float32).sum(), (0, 1))(a, row)
    want = mx.grad(lambda a, r: (mx.add(a, r) * cotangent).astype(mx.float32).sum(), (0, 1))(a, row)
    for g, expected in zip(got, want, strict=True):
        assert_close(g, expected, 1e-6 if dtype == mx.float32 else 2**-7)  # b's: summed in float32
    got = mx.grad(lambda a: (kernels.masked_rows(a, keep) * cotangent).astype(mx.float32).sum())(a)
    want = mx.grad(lambda a: (mx.where(keep, a, mx.array(0, dtype)) * cotangent).astype(mx.float32).sum())(a)
    assert mx.array_equal(got, want).item()
    with kernels.export_mode():  # an exported file holds MLX's ops
        assert kernels.onednn.binary("add", a, b) is None
        assert mx.array_equal(kernels.add(a, b), a + b).item()


@pytest.mark.parametrize("dtype", [mx.float32, pytest.param(mx.bfloat16, marks=needs_bfloat16)])
@pytest.mark.parametrize("size", [(17, 23), (8, 8), (2, 3)])
def test_max_pooling_on_every_core_equals_mlxs_and_its_gradient(dtype, size, rng):
    x = mx.array(rng.standard_normal((2, *size, 16)).astype(np.float32)).astype(dtype)
    pool = nn.MaxPool2d(3, 2, 1)  # the ResNet stem's
    assert mx.array_equal(onednn.max_pool2d(x, 3, 2, 1), pool(x)).item()
    cotangent = mx.array(rng.standard_normal(pool(x).shape).astype(np.float32)).astype(dtype)
    got = mx.grad(lambda x: (onednn.max_pool2d(x, 3, 2, 1) * cotangent).astype(mx.float32).sum())(x)
    want = mx.grad(lambda x: (pool(x) * cotangent).astype(mx.float32).sum())(x)
    assert mx.array_equal(got, want).item()
    assert onednn.max_pool2d(x, 3, 2, 3) is None  # padding as wide as the window: MLX's


@pytest.mark.parametrize("products", PRODUCTS)
def test_an_input_projection_takes_the_map_as_it_is_and_gives_the_images_dtype(products, rng):
    mx.random.seed(0)
    convolution = Conv2d(32, 16, 1)
    x = mx.array(rng.standard_normal((1, 9, 7, 32)).astype(np.float32))
    given = x.astype(mx.bfloat16) if products == "bfloat16" else x
    with onednn.products_in(mx.bfloat16 if products == "bfloat16" else mx.float32):
        y = convolution(given, dtype=mx.float32)
    assert y.dtype == mx.float32
    want = (
        mx.conv2d(
            given.astype(mx.float32), rounded(convolution.weight) if products == "bfloat16" else convolution.weight
        )
        + convolution.bias
    )
    assert_close(y, want, 1e-6)
    with kernels.export_mode():  # MLX's convolution, then the dtype asked
        assert convolution(given, dtype=mx.float32).dtype == mx.float32


def test_casts_on_every_core_are_mlxs_but_for_subnormals_and_pass_gradients_back(rng):
    x = mx.array(np.concatenate([rng.standard_normal(5000) * 100, [np.inf, -np.inf, np.nan, -0.0, 3.3e38, 1e-39]]))
    x = x.astype(mx.float32)
    narrowed, want = kernels.astype(x, mx.bfloat16), x.astype(mx.bfloat16)
    assert narrowed.dtype == mx.bfloat16
    same = np.array(narrowed.view(mx.uint16)) == np.array(want.view(mx.uint16))
    on_onednn = onednn.astype(x, mx.bfloat16) is not None  # not on AVX2: oneDNN 3.2 has no bfloat16 there
    assert same[:-1].all() and same[-1] != on_onednn  # 1e-39, a float32 subnormal: oneDNN flushes it to 0
    widened = kernels.astype(want, mx.float32)
    assert np.array_equal(np.array(widened.view(mx.uint32)), np.array(want.astype(mx.float32).view(mx.uint32)))
    assert kernels.astype(x, mx.float32) is x
    finite = x[:5000]
    got = mx.grad(lambda v: (kernels.astype(v, mx.bfloat16).astype(mx.float32) ** 2).sum())(finite)
    expected = mx.grad(lambda v: (v.astype(mx.bfloat16).astype(mx.float32) ** 2).sum())(finite)
    assert got.dtype == mx.float32 and mx.array_equal(got, expected).item()
