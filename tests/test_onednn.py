"""kernels.onednn: convolutions and matrix products on oneDNN, with their gradients, against MLX's own
(`mx.conv2d`, `@`, their VJPs). float32: to float32 rounding. bfloat16 products (float32 accumulation):
equal, to float32 rounding, to MLX's float32 operations on the operands rounded to bfloat16, which is
what a bfloat16 product with a float32 sum computes; the cotangents are rounded the same way for the
gradients. Then where it is not used (MLX's answers), its caches (bounded: plans by count, weight copies
by bytes), and the inference precision that rides on it. bfloat16 cases skip where oneDNN has no fast
bfloat16 kernels (a CPU without AVX512-BF16 or AMX, or ONEDNN_MAX_CPU_ISA below them): there the
precision resolves to float32 and oneDNN's refusal is tested instead."""

import gc
import os
import subprocess
import sys
import threading

import kernels
from deformable_detr.models.precision import Precision, check_training_precision, resolve_precision
from kernels import onednn, precision
from kernels.precision import BfloatRule

import mlx.core as mx
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(onednn.module() is None, reason=f"oneDNN is not used here: {onednn.missing()}")
NO_FAST_BFLOAT16 = onednn.bfloat16_kernels() if onednn.module() is not None else None
needs_bfloat16 = pytest.mark.skipif(NO_FAST_BFLOAT16 is not None, reason=f"no fast bfloat16: {NO_FAST_BFLOAT16}")
PRODUCTS = ["float32", pytest.param("bfloat16", marks=needs_bfloat16)]


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
@pytest.mark.parametrize("products", PRODUCTS)
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


@needs_bfloat16
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


@pytest.mark.parametrize("products", PRODUCTS)
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


@needs_bfloat16
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


def clear_caches():
    for cached in (onednn._load, onednn._say_missing_once, onednn.bfloat16_kernels):
        cached.cache_clear()


def test_without_it_mlx_computes_and_says_so_once(capsys, monkeypatch, rng):
    monkeypatch.setattr(onednn, "_library", lambda: None)
    monkeypatch.setattr(onednn, "EXPECTED", True)
    clear_caches()
    try:
        x = mx.array(rng.standard_normal((4, 8)).astype(np.float32))
        w = mx.array(rng.standard_normal((3, 8)).astype(np.float32))
        assert onednn.linear(x, w) is None and onednn.linear(x, w) is None
        assert_close(kernels.linear(x, w), x @ w.T, 1e-6)
        assert resolve_precision("auto").ran == "float32" and resolve_precision("bfloat16").ran == "float32"
        lines = capsys.readouterr().err.splitlines()
        assert lines == [
            "kernels: convolutions and products run on MLX, not oneDNN: oneDNN's library is not "
            "installed (pip install onednn-cpu-gomp==2023.2.0)"
        ]
    finally:
        clear_caches()


def test_switched_off_by_its_variable_silently():
    code = (
        "import kernels, mlx.core as mx; from kernels import onednn; x = mx.ones((2, 3)); "
        "assert onednn.linear(x, x) is None and onednn.missing() == 'KERNELS_ONEDNN=0'; "
        "print(kernels.linear(x, x).tolist())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "KERNELS_ONEDNN": "0"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "[[3.0, 3.0], [3.0, 3.0]]" and done.stderr == ""


def test_precision_resolves_once_from_whether_bfloat16_products_are_fast(monkeypatch):
    monkeypatch.setattr(onednn, "bfloat16_kernels", lambda: None)
    monkeypatch.setattr(onednn, "bfloat16_instructions", lambda: ["avx512_bf16"])
    rule = BfloatRule(17_000_000, None, "measured")  # where bfloat16 pays (a test below measures it)
    monkeypatch.setattr(kernels, "bfloat16_rule", lambda: rule)
    said = f"auto: {rule}; this CPU has avx512_bf16 (oneDNN)"
    assert resolve_precision("auto") == Precision("bfloat16", "auto", said, rule)
    monkeypatch.setattr(kernels, "bfloat16_rule", lambda: BfloatRule(None, None, "measured"))
    never = f"auto: bfloat16 products measured under {precision.PAYS}x float32's speed here at every size"
    assert resolve_precision("auto") == Precision("float32", "auto", never)
    assert resolve_precision("bfloat16") == Precision(
        "bfloat16", "bfloat16", "asked for: this CPU has avx512_bf16 (oneDNN)"
    )
    why = "this CPU has no bfloat16 product instructions (AVX512-BF16, AMX): oneDNN has none for them"
    monkeypatch.setattr(onednn, "bfloat16_kernels", lambda: why)
    assert resolve_precision("auto") == Precision("float32", "auto", f"auto: {why}")
    asked = resolve_precision("bfloat16")
    assert asked == Precision("float32", "bfloat16", f"bfloat16 asked for, but {why}")
    assert str(asked) == f"float32 (bfloat16 asked for, but {why})" and asked.dtype == mx.float32
    assert resolve_precision("float32") == Precision("float32", "float32", "asked for")
    assert Precision() == Precision("float32", "float32", "the default")  # a Detector given none
    assert check_training_precision("bfloat16", even_if_slow=False).startswith(f"train.precision=bfloat16: {why}")
    assert check_training_precision("bfloat16", even_if_slow=True) is None
    assert check_training_precision("float32", even_if_slow=False) is None
    with pytest.raises(ValueError, match="expected one of auto, float32, bfloat16"):
        resolve_precision("fp16")
    gpu = mx.Device(mx.gpu, 0)  # MLX's bfloat16 is fast there, but inference reaches it through oneDNN only
    monkeypatch.setattr(mx, "default_device", lambda: gpu)
    assert kernels.bfloat16_products() == (True, f"MLX's bfloat16 products on {gpu}")
    said = f"inference's bfloat16 products are oneDNN's: on {gpu} it is float32"
    assert resolve_precision("bfloat16") == Precision("float32", "bfloat16", f"bfloat16 asked for, but {said}")
    assert check_training_precision("bfloat16", even_if_slow=False) is None  # training casts its weights there


def test_bfloat16_pays_from_the_smallest_rung_from_which_every_rung_pays(monkeypatch):
    """bfloat16_rule's reading of its ladders' ratios (float32's time over bfloat16's; each ladder's rungs
    growing): a threshold where that rung and every larger one reach PAYS, the wide reductions' the larger of
    their ladders', none where the largest rung does not pay; a shape oneDNN refuses pays nothing."""
    pays = precision.PAYS
    ratios = {  # by ladder: a dip at rung 1 (noise, or a layout), growing after it
        "3 x 3 convolution of 64 channels": [pays + 0.1, pays - 0.6, pays, 2 * pays],
        "product 256 -> 256": [pays - 0.6, pays + 0.2, pays + 0.5, pays + 1],
        "1 x 1 convolution 32 -> 128": [0.6, 0.8, pays - 0.05, pays + 0.1],
    }
    calls, timed = iter([r for name, _, _ in precision.LADDERS for r in ratios[name]]), precision._ratio
    monkeypatch.setattr(precision, "_ratio", lambda *rung: next(calls))
    monkeypatch.setattr(precision, "bfloat16_products", lambda: (True, "measured"))
    precision.bfloat16_rule.cache_clear()
    try:
        rule = precision.bfloat16_rule()
        conv_sizes = [onednn.work("conv", x, w, 1, 1)[0] for _, x, w in precision.LADDERS[0][2]]
        narrow_sizes = [onednn.work("conv", x, w)[0] for _, x, w in precision.LADDERS[2][2]]
        assert (rule.wide, rule.narrow) == (conv_sizes[2], narrow_sizes[3])  # 37.7 M over the product's 16.8 M
        assert rule.pays(conv_sizes[2], 576) and not rule.pays(conv_sizes[2] - 1, 576)
        assert rule.pays(narrow_sizes[3], 32) and not rule.pays(narrow_sizes[3] - 1, 32)
        calls = iter([0.9] * 12)  # nowhere: float32 throughout
        assert precision.bfloat16_rule.__wrapped__().never
    finally:
        precision.bfloat16_rule.cache_clear()
    assert timed("conv", (1, 2, 2, 3), (8, 7, 7, 3), onednn.kept_weights()) >= 0  # refused (0) or timed


@needs_bfloat16
def test_under_a_rule_each_product_runs_in_the_precision_its_size_pays_for(rng):
    """products_in(bfloat16, rule=...): a product the rule says pays is bfloat16's (the operands rounded), one it
    does not is float32's, bit for bit, whatever the batch (the rule weighs one image: a server's batch answers
    as each image alone); and a weight whose products run in both keeps one copy of each (so that neither is
    made again when the size changes), counted by the store."""
    w = mx.array(rng.standard_normal((64, 3, 3, 64)).astype(np.float32))
    small, large = (mx.array(rng.standard_normal((1, s, s, 64)).astype(np.float32)) for s in (6, 20))
    rule = BfloatRule(onednn.work("conv", large.shape, w.shape, 1, 1)[0], None, "a test's")
    assert not rule.pays(*onednn.work("conv", small.shape, w.shape, 1, 1))
    kept = onednn.kept_weights()
    with onednn.products_in(mx.float32):
        want_small = onednn.conv2d(small, w, 1, 1)
    for _ in range(2):
        with onednn.products_in(mx.bfloat16, kept, rule):
            got_small, got_large = onednn.conv2d(small, w, 1, 1), onednn.conv2d(large, w, 1, 1)
        assert np.array_equal(np.array(got_small), np.array(want_small))  # float32's
        assert_close(got_large, mx.conv2d(rounded(large), rounded(w), 1, 1), 1e-5)  # bfloat16's
        assert kept.count == 2  # the weight in float32's layout and in bfloat16's
    batch = mx.concatenate([small] * 16)  # more work than `large` together, each image less
    rows = mx.array(rng.standard_normal((16, 30, 64)).astype(np.float32))  # (batch, tokens, channels)
    weight = mx.array(rng.standard_normal((64, 64)).astype(np.float32))
    per_image = BfloatRule(onednn.work("linear", rows.shape, weight.shape)[0] + 1, None, "a test's")
    with onednn.products_in(mx.float32):
        want_batch, want_rows = onednn.conv2d(batch, w, 1, 1), onednn.linear(rows, weight)
    with onednn.products_in(mx.bfloat16, kept, rule):
        assert np.array_equal(np.array(onednn.conv2d(batch, w, 1, 1)), np.array(want_batch))
    with onednn.products_in(mx.bfloat16, kept, per_image):
        assert np.array_equal(np.array(onednn.linear(rows, weight)), np.array(want_rows))


def test_bfloat16_is_fast_only_with_the_instructions_oneDNN_may_use():
    """What oneDNN itself picks for a bfloat16 convolution, against the CPU's flags and the cap."""
    has = onednn.bfloat16_instructions()
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    why_not = onednn.bfloat16_kernels()
    if not has:
        assert why_not.startswith("this CPU has no bfloat16 product instructions (AVX512-BF16, AMX)")
    elif capped in ("AVX2", "AVX512_CORE", "AVX512_CORE_VNNI"):
        assert why_not == f"ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']} keeps oneDNN from this CPU's " + (
            ", ".join(has)
        )
    elif capped in ("", "ALL", "AVX512_CORE_BF16", "AVX512_CORE_AMX"):
        assert why_not is None
    assert kernels.bfloat16_products() == (
        (False, why_not) if why_not else (True, f"this CPU has {', '.join(has)} (oneDNN)")
    )


@pytest.mark.skipif(NO_FAST_BFLOAT16 is None, reason="bfloat16 is fast here")
def test_where_bfloat16_is_not_fast_float32_runs_and_oneDNN_has_at_most_an_emulation(rng):
    """AVX2: oneDNN 3.2 has no bfloat16 convolution (None: the caller computes); AVX-512 without BF16:
    it emulates one. Either way the precision resolves to float32, so no command asks for it."""
    x = mx.array(rng.standard_normal((1, 9, 10, 16)).astype(np.float32))
    w = mx.array(rng.standard_normal((16, 3, 3, 16)).astype(np.float32))
    kernel = onednn.module().conv2d_implementation(x, w, 1, 1, 1, True)
    assert kernel.startswith("refused") or kernel.endswith(":avx512_core"), kernel
    with onednn.products_in(mx.bfloat16):
        assert (onednn.conv2d(x, w, 1, 1) is None) == kernel.startswith("refused")
    assert resolve_precision("bfloat16").ran == "float32" and not kernels.bfloat16_products()[0]


def test_the_plans_are_bounded_and_a_graph_keeps_its_own(rng):
    """Each shape's primitives are a plan; past the capacity the least recently used go (oneDNN's own
    cache set to the same), while a graph built before still holds and runs its plan."""
    extension, before = onednn.module(), onednn.caches()
    w = mx.array(rng.standard_normal((8, 3, 3, 4)).astype(np.float32))
    first_x = mx.array(rng.standard_normal((1, 5, 6, 4)).astype(np.float32))
    extension.set_capacity(6)
    try:
        first = onednn.conv2d(first_x, w, 1, 1)  # built, not evaluated, before its plan goes
        for size in range(6, 26):
            x = mx.array(rng.standard_normal((1, size, size + 1, 4)).astype(np.float32))
            got = mx.grad(lambda x, w: (onednn.conv2d(x, w, 1, 1) ** 2).sum(), (0, 1))(x, w)
            want = mx.grad(lambda x, w: (mx.conv2d(x, w, 1, 1) ** 2).sum(), (0, 1))(x, w)
            for g, r in zip(got, want, strict=True):
                assert_close(g, r, 1e-5)
            a = x.reshape(-1, 4)
            assert_close(onednn.linear(a, w[:, 0, 0]), a @ w[:, 0, 0].T, 1e-6)
        caches = onednn.caches()
        bounded = caches["convolutions"] - caches["lasting"]  # AMX convolutions of other tests stay (a test below)
        assert (bounded, caches["products"], caches["onednn_capacity"]) == (6, 6, 6), caches
        assert_close(first, mx.conv2d(first_x, w, 1, 1), 1e-6)
    finally:
        extension.set_capacity(before["capacity"])
    assert onednn.caches()["onednn_capacity"] == before["capacity"]


@pytest.mark.parametrize(
    "plans, answer", [("3", "3"), ("", "32"), ("many", "KERNELS_ONEDNN_PLANS='many': expected a whole number >= 0")]
)
def test_the_plan_capacity_comes_from_its_variable(plans, answer):
    code = "from kernels import onednn; c = onednn.caches(); assert c['onednn_capacity'] == c['capacity']; "
    code += "print(c['capacity'])"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "KERNELS_ONEDNN_PLANS": plans},
        capture_output=True,
        text=True,
    )
    assert answer in (done.stdout if done.returncode == 0 else done.stderr), done.stderr


def lookups(kind: str) -> tuple[int, int]:
    """(hits, misses) of one kind's plan cache ("convolution", "product") so far."""
    caches = onednn.caches()
    return caches[f"{kind}_hits"], caches[f"{kind}_misses"]


def test_a_shape_plan_is_made_at_its_first_call_and_found_at_the_next(rng):
    x = mx.array(rng.standard_normal((1, 13, 17, 12)).astype(np.float32))  # shapes no other test uses
    w = mx.array(rng.standard_normal((12, 3, 3, 12)).astype(np.float32))
    a, b = x.reshape(-1, 12)[:37], w.reshape(12, -1)[:, :12]
    for kind, call in [("convolution", lambda: onednn.conv2d(x, w, 1, 1)), ("product", lambda: onednn.linear(a, b))]:
        hits, misses = lookups(kind)
        first = call()
        assert lookups(kind) == (hits, misses + 1), kind
        second = call()
        assert lookups(kind) == (hits + 1, misses + 1), kind
        assert np.array_equal(np.array(first), np.array(second))


def test_a_cycle_of_shapes_longer_than_the_capacity_remakes_every_plan(rng):
    """Least recently used out first: with `capacity` plans, a cycle of `capacity + 1` shapes finds none of
    them the second time round (as 27 of an R50 training step's 33 product plans with 32); `capacity` shapes, all."""
    extension, before = onednn.module(), onednn.caches()
    w = mx.array(rng.standard_normal((8, 3, 3, 4)).astype(np.float32))
    cycle = [mx.array(rng.standard_normal((1, 7, size, 4)).astype(np.float32)) for size in range(30, 34)]
    try:
        for capacity, (found, made) in [(3, (0, 4)), (4, (4, 0))]:
            extension.set_capacity(capacity)
            for x in cycle:
                onednn.conv2d(x, w, 1, 1)
            hits, misses = lookups("convolution")
            for x in cycle:
                onednn.conv2d(x, w, 1, 1)
            assert lookups("convolution") == (hits + found, misses + made), capacity
    finally:
        extension.set_capacity(before["capacity"])


def test_threads_asking_for_the_same_new_plans_at_once_share_one_each(rng):
    """A plan is made outside the cache's lock, the GIL let go: threads asking for the same new shapes at
    once may each make a plan, but the cache keeps one a shape (the first inserted, given to every caller),
    and every answer is right."""
    extension, before = onednn.module(), onednn.caches()
    w = mx.array(rng.standard_normal((64, 3, 3, 64)).astype(np.float32) / 24)  # plans of a few ms: they meet
    images = [mx.array(rng.standard_normal((1, 9, size, 64)).astype(np.float32)) for size in range(40, 46)]
    rows = [mx.array(rng.standard_normal((size, 576)).astype(np.float32)) for size in range(90, 96)]
    weight = w.reshape(64, 576)
    calls = [lambda x=x: onednn.conv2d(x, w, 1, 1) for x in images] + [
        lambda a=a: onednn.linear(a, weight) for a in rows
    ]
    want = [np.array(mx.conv2d(x, w, 1, 1)) for x in images] + [np.array(a @ weight.T) for a in rows]
    threads, start, got, failed = 4, threading.Barrier(4), {}, []

    def run(thread):
        try:
            mx.set_default_stream(mx.new_stream(mx.cpu))  # a thread's own stream, as the server's worker's
            start.wait()
            got[thread] = [np.array(call()) for call in calls]
        except Exception as error:  # noqa: BLE001 (raised below, on the test's thread)
            failed.append(error)
        finally:
            mx.clear_streams()  # as MLX asks of a thread before it ends (serving/batcher.py)

    extension.set_capacity(64)
    try:
        counts = {kind: lookups(kind) for kind in ("convolution", "product")}
        kept = onednn.caches()
        workers = [threading.Thread(target=run, args=(thread,)) for thread in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert not failed, failed
        caches = onednn.caches()
        for kind, plural in [("convolution", "convolutions"), ("product", "products")]:
            hits, misses = (now - then for now, then in zip(lookups(kind), counts[kind], strict=True))
            assert hits + misses == threads * 6 and 6 <= misses <= threads * 6, (kind, hits, misses)
            assert caches[plural] == kept[plural] + 6, (kind, caches)
    finally:
        extension.set_capacity(before["capacity"])
    for thread in range(threads):
        for answer, first, reference in zip(got[thread], got[0], want, strict=True):
            assert np.array_equal(answer, first)  # one plan a shape: the same kernel for every thread
            assert np.abs(answer - reference).max() <= 1e-5 * np.abs(reference).max()


def test_kept_weights_are_reused_bounded_never_stale_and_freed_with_their_store(rng):
    """Given a KeptWeights, a weight's copy in oneDNN's layout is made once; another weight (a new buffer)
    gets its own; at most its capacity of copies is kept; dropping the store lets MLX free the weights."""
    x = mx.array(rng.standard_normal((1, 12, 11, 16)).astype(np.float32))
    w = mx.array(rng.standard_normal((32, 3, 3, 16)).astype(np.float32))  # reordered: a copy to keep
    kept = onednn.kept_weights()
    assert (kept.count, kept.bytes, kept.capacity) == (0, 0, 512 << 20)
    mx.eval(onednn.conv2d(x, w, 1, 1))
    assert kept.count == 0  # not asked to keep
    with onednn.products_in(mx.float32, kept):
        a = onednn.conv2d(x, w, 1, 1)
        mx.eval(a)
        one = kept.bytes  # a copy of this weight
        b = onednn.conv2d(x, w, 1, 1)
        mx.eval(b)
        assert (kept.count, kept.bytes) == (1, one)  # the same weight: its copy
        other = w * 2  # a new buffer: never the first one's copy
        c = onednn.conv2d(x, other, 1, 1)
        assert_close(c, mx.conv2d(x, other, 1, 1), 1e-6)
        assert kept.count == 2
        with onednn.products_in(mx.float32):  # kept None: as outside
            assert onednn._products.get()[1] is kept
    assert np.array_equal(np.array(a), np.array(b)) and one > 0
    assert_close(a, mx.conv2d(x, w, 1, 1), 1e-6)
    small = onednn.module().KeptWeights(one)
    with onednn.products_in(mx.float32, small):
        for scale in (3, 4, 5):
            mx.eval(onednn.conv2d(x, w * scale, 1, 1))
            assert (small.count, small.bytes) == (1, one)  # the most recent copy
    del a, b, c, other
    held = mx.get_active_memory()
    del kept  # its copies and its hold on the weights' buffers go with it
    gc.collect()
    weights = w.nbytes * 2  # w and w * 2: w stays, w * 2 is freed once the store lets it go
    assert held - mx.get_active_memory() >= weights // 2


@needs_bfloat16
def test_a_slice_of_a_kept_weight_is_kept_once_and_a_view_is_read_as_it_lies(rng):
    """A product's weight that is a slice of a larger one (MultiheadAttention's thirds of in_proj_weight) has
    one copy in the store, found at every call: it was copied out of its buffer at each call before (a new
    buffer: a new copy kept, with the buffer, every forward; the server at `auto` grew by 1.5 GB a minute). A
    view that is not contiguous (a column slice) is read as it lies: the product of what it shows."""
    d = 32
    x = mx.array(rng.standard_normal((50, d)).astype(np.float32))
    weight = mx.array(rng.standard_normal((3 * d, 2 * d)).astype(np.float32))
    kept = onednn.kept_weights()
    with onednn.products_in(mx.bfloat16, kept):
        for _ in range(3):
            for third in range(3):
                rows = weight[third * d : (third + 1) * d, :d]  # a slice of rows and columns: a strided view
                y = onednn.linear(x, rows)
                assert_close(y, rounded(x) @ rounded(rows).T, 1e-5)
            assert kept.count == 3  # one copy a third, whatever the calls
        whole = weight[:d]  # rows only: dense, the same buffer, another view than the thirds
        assert_close(onednn.linear(x, whole[:, :d]), rounded(x) @ rounded(whole[:, :d]).T, 1e-5)
        assert_close(onednn.linear(x.reshape(25, 2 * d), whole), rounded(x.reshape(25, 2 * d)) @ rounded(whole).T, 1e-5)


def test_a_copy_whose_weight_is_gone_leaves_the_store(rng):
    """A weight made for a call (a temporary) is held by nothing but the store once the call is done: its
    copy, and the buffer the store held for it, go at the next copy made rather than when the capacity
    pushes them out (512 MiB of copies and their weights)."""
    x = mx.array(rng.standard_normal((1, 9, 10, 16)).astype(np.float32))
    w = mx.array(rng.standard_normal((32, 3, 3, 16)).astype(np.float32))
    kept = onednn.kept_weights()
    with onednn.products_in(mx.float32, kept):
        for scale in range(1, 6):
            y = onednn.conv2d(x, w * scale, 1, 1)
            assert_close(y, mx.conv2d(x, w * scale, 1, 1), 1e-5)
            assert kept.count == 1, scale  # the last call's weight; the ones before it are gone
        mx.eval(onednn.conv2d(x, w, 1, 1))
        assert kept.count == 1


AMX_CONVOLUTION = (
    onednn.module().conv2d_implementation(mx.zeros((1, 8, 8, 64)), mx.zeros((64, 3, 3, 64)), 1, 1, 1, True)
    if onednn.module() is not None and NO_FAST_BFLOAT16 is None
    else "none"
)


@pytest.mark.skipif("amx" not in AMX_CONVOLUTION, reason=f"no AMX convolution here ({AMX_CONVOLUTION})")
def test_amx_convolution_plans_outlast_the_capacity(rng):
    """oneDNN 3.2 keeps the kernels of every AMX convolution it makes for the process's life (made again,
    a convolution adds them again: onednn_conv.cpp's ConvPlan::lasting), so their plans are kept beyond the
    capacity: a cycle of more shapes than it holds finds them all the second time round, `lasting` counting
    them; float32's still go (a test above)."""
    extension, before = onednn.module(), onednn.caches()
    w = mx.array(rng.standard_normal((64, 3, 3, 64)).astype(np.float32))
    cycle = [mx.array(rng.standard_normal((1, 9, size, 64)).astype(np.float32)) for size in range(41, 45)]
    try:
        extension.set_capacity(2)
        with onednn.products_in(mx.bfloat16):
            for x in cycle:
                mx.eval(onednn.conv2d(x, w, 1, 1))
            hits, misses = lookups("convolution")
            for x in cycle:
                y = onednn.conv2d(x, w, 1, 1)
                assert_close(y, mx.conv2d(rounded(x), rounded(w), 1, 1), 1e-5)
        assert lookups("convolution") == (hits + 4, misses)
        assert onednn.caches()["lasting"] >= before["lasting"] + 4
    finally:
        extension.set_capacity(before["capacity"])


def test_a_weight_wanted_in_another_layout_keeps_one_copy(rng):
    """A store keeps one copy of a weight, in the layout last asked: on AVX2 oneDNN's brgconv blocks this
    weight's output channels by 16 or 24 as the image's size suits (the copy's bytes change with it), and
    each size's result is still the convolution's. (Where one layout serves every size, as on AVX-512, the
    count is 1 anyway; tests/test_instruction_sets.py runs this capped to AVX2, where it is not.)"""
    w = mx.array(rng.standard_normal((128, 3, 3, 64)).astype(np.float32))
    kept, sizes = onednn.kept_weights(), set()
    with onednn.products_in(mx.float32, kept):
        for size in (4, 6, 8, 12, 16, 64, 4):
            x = mx.array(rng.standard_normal((1, size, size, 64)).astype(np.float32))
            assert_close(onednn.conv2d(x, w, 2, 1), mx.conv2d(x, w, 2, 1), 1e-5)
            assert kept.count == 1
            sizes.add(kept.bytes)
    assert len(sizes) >= (2 if os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2" else 1)


SLOWER = "patches (oneDNN's jit:avx2 is slower than the patches)"
BACKWARD_ON_AVX2 = [  # (kernel, stride, dilation, size, channels in, the backward passes on AVX2: data; weights)
    (1, 2, 1, (9, 12), 32, f"patches (its backward data has no fast oneDNN kernel here (only x64:gemm:jit)); {SLOWER}"),
    (
        3,
        1,
        2,
        (9, 12),
        5,
        f"{SLOWER}; patches (its backward weights has no fast oneDNN kernel here (only x64:gemm:jit))",
    ),
    (1, 2, 1, (10, 12), 5, "brgconv_strided:avx2; patches (its backward weights: oneDNN 3.2's jit_1x1:avx2 is wrong"),
    (1, 2, 1, (10, 12), 32, "brgconv_strided:avx2; patches (oneDNN's jit_1x1:avx2 is slower than the patches)"),
    (3, 1, 1, (10, 12), 32, f"{SLOWER}; {SLOWER}"),
    (
        1,
        1,
        1,
        (10, 12),
        64,
        "brg_fwd:avx2+brgconv_1x1:avx2; patches (oneDNN's jit_1x1:avx2 is slower than the patches)",
    ),
]


@pytest.mark.parametrize("kernel,stride,dilation,size,cin,passes", BACKWARD_ON_AVX2)
def test_a_backward_pass_oneDNN_has_no_fast_or_right_kernel_for_is_the_patches(
    kernel, stride, dilation, size, cin, passes, rng
):
    """On AVX2 oneDNN 3.2 has only its im2col + GEMM for some backward passes (a strided 1 x 1 of an odd
    size, a dilated 3 x 3 on few channels), a wrong one for another (a strided 1 x 1 on fewer than 8
    channels: up to 90% off), and older direct JIT kernels the patches beat for the rest but its brgemm
    ones: the forward stays oneDNN's, those passes are the patches' (the plan says which and why), MLX's
    numbers either way."""
    padding = dilation * (kernel // 2)
    x = mx.array(rng.standard_normal((2, *size, cin)).astype(np.float32))
    w = mx.array(rng.standard_normal((4, kernel, kernel, cin)).astype(np.float32))
    kernels_used = onednn.module().conv2d_implementation(x, w, stride, padding, dilation, False, True)
    if os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2":
        assert kernels_used.split("; ", 1)[1].startswith(passes), kernels_used
    got = mx.grad(lambda x, w: (onednn.conv2d(x, w, stride, padding, dilation) ** 2).sum(), (0, 1))(x, w)
    want = mx.grad(lambda x, w: (mx.conv2d(x, w, stride, padding, dilation) ** 2).sum(), (0, 1))(x, w)
    for g, r in zip(got, want, strict=True):
        assert_close(g, r, 1e-5)


def test_a_weights_gradient_over_a_long_reduction_is_the_products(rng):
    """A linear's and a convolution's weight gradient over 4,100 and 4,608 rows, a long reduction (on AVX2
    MLX's product on OpenBLAS and the patches' for the convolution): against float64 and MLX's."""
    x = rng.standard_normal((4100, 48)).astype(np.float32)
    g = rng.standard_normal((4100, 40)).astype(np.float32)
    w = mx.array(rng.standard_normal((40, 48)).astype(np.float32))
    got = mx.grad(lambda w: (onednn.linear(mx.array(x), w) * mx.array(g)).sum())(w)
    want = g.astype(np.float64).T @ x.astype(np.float64)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-3)

    images = mx.array(rng.standard_normal((2, 48, 48, 16)).astype(np.float32))
    weight = mx.array(rng.standard_normal((24, 3, 3, 16)).astype(np.float32))
    cotangent = mx.array(rng.standard_normal((2, 48, 48, 24)).astype(np.float32))
    got = mx.grad(lambda w: (onednn.conv2d(images, w, 1, 1, 1) * cotangent).sum())(weight)
    want = mx.grad(lambda w: (mx.conv2d(images, w, 1, 1, 1) * cotangent).sum())(weight)
    assert_close(got, want, 1e-5)


@pytest.mark.parametrize("bias", [True, False])
def test_products_with_a_long_reduction_against_their_width_are_the_products(bias, rng):
    """Where oneDNN's float32 product is its sgemm (AVX2), one whose reduction is at least 4 times its width
    runs as a 1 x 1 convolution: a linear of 512 -> 96 (its forward, the weight stored (n, k)) and one of
    96 -> 512 (its input's gradient, the weight stored (k, n)), against float64, gradients included."""
    x = rng.standard_normal((333, 512)).astype(np.float32)
    w = (rng.standard_normal((96, 512)) / 512**0.5).astype(np.float32)
    b = rng.standard_normal(96).astype(np.float32) if bias else None
    g = rng.standard_normal((333, 96)).astype(np.float32)
    args = [mx.array(x), mx.array(w)] + ([mx.array(b)] if bias else [])
    kernel = onednn.module().product_implementation(args[0], args[1], args[2] if bias else None, False, True)
    if kernel.startswith("gemm:jit") or "(gemm:jit" in kernel:
        assert kernel.startswith("brgconv_1x1"), kernel

    def loss(*a):
        return (onednn.linear(*a) * mx.array(g)).sum()

    want = x.astype(np.float64) @ w.T.astype(np.float64) + (b if bias else 0)
    np.testing.assert_allclose(np.array(onednn.linear(*args)), want, rtol=1e-5, atol=1e-4)
    got = mx.grad(loss, tuple(range(len(args))))(*args)
    np.testing.assert_allclose(np.array(got[0]), g.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.array(got[1]), g.T.astype(np.float64) @ x, rtol=1e-5, atol=1e-3)
    if bias:
        np.testing.assert_allclose(np.array(got[2]), g.sum(0, dtype=np.float64), rtol=1e-5, atol=1e-4)

    # 96 -> 512: the input's gradient is (333, 512) x (512, 96), the weight (512, 96) as stored
    wide = (rng.standard_normal((512, 96)) / 96**0.5).astype(np.float32)
    h = rng.standard_normal((333, 512)).astype(np.float32)
    stored = onednn.module().product_implementation(mx.array(h), mx.array(wide), None, False, False)
    if "gemm:jit" in stored:
        assert stored.startswith("brgconv_1x1"), stored
    got = mx.grad(lambda v: (onednn.linear(v, mx.array(wide)) * mx.array(h)).sum())(mx.array(x[:, :96]))
    np.testing.assert_allclose(np.array(got), h.astype(np.float64) @ wide, rtol=1e-5, atol=1e-4)

    # where a Detector keeps its weights' copies (inference), the product: the convolution's weight layout
    # would be one more copy of each weight kept
    inference = onednn.module().product_implementation(
        args[0], args[1], args[2] if bias else None, False, True, False, True
    )
    assert not inference.startswith("brgconv"), inference
    kept = onednn.kept_weights()
    with onednn.products_in(mx.float32, kept):
        np.testing.assert_allclose(np.array(onednn.linear(*args)), want, rtol=1e-5, atol=1e-4)
    if kernel.startswith("brgconv_1x1"):
        assert kept.count == 0  # the sgemm reads the weight as stored; the convolution would have kept a copy


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
