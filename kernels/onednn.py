"""Convolutions and matrix products on oneDNN, Intel's deep learning kernels (the ones under PyTorch,
OpenVINO and TensorFlow on x86 CPUs): `conv2d` and `linear`, as MLX operations with their gradients
(C++ `Primitive`s of `kernels._onednn`, built from native/onednn*.cpp where oneDNN's headers were there).

Why: MLX's CPU back-end runs a convolution as im2col + one sgemm and has no fast bfloat16 product (a
bf16 2048^2 product takes 3.9 s, f32 0.19 s). oneDNN's JIT kernels use blocked layouts, AVX2, AVX-512
and, for bfloat16, AVX512-BF16 and AMX (bench/README.md#onednn has the measurements).

Precision: products in bfloat16 (float32 accumulation) inside `products_in(mx.bfloat16)` or where
either operand is bfloat16, float32 otherwise; the result in the first operand's dtype. So float32
activations and weights inside `products_in(mx.bfloat16)` give float32 results computed with bfloat16
products (`--precision bfloat16` at inference), and bfloat16 activations give bfloat16 results
(`train.precision: bfloat16`). Whether bfloat16 is fast here is oneDNN's own answer
(`bfloat16_kernels`: AMX or AVX512-BF16 kernels; kernels.precision decides from it).

Memory: each shape's primitives (a plan, JIT-compiled where the shape is first met or was let go) are kept in
a least-recently-used cache of KERNELS_ONEDNN_PLANS plans of each kind, convolutions and products
(default 32; oneDNN's own primitive cache holds as many primitives, reorders too; `caches()` counts the
lookups that found a plan and those that made one), their scratchpads allocated for a call only. 32 hold an
R50 inference's plans at one size (25 + 11) and a training step's 25 convolutions', not its 33 products': 27
of those are made again every step, under 1% of its time (7 ms in float32, 31 in bfloat16 on a Xeon with AMX);
a plan holds 0.04-0.25 MiB, up to 2.2 MiB for a bfloat16 convolution on AMX (bench/onednn_plans.py); an AMX
convolution's plan stays beyond the capacity (`lasting`: oneDNN 3.2 would keep the kernels of each remake for
good, native/onednn_conv.cpp). A Detector keeps its weights' copies in oneDNN's layouts in its own store
(`kept_weights`, at most KERNELS_ONEDNN_WEIGHTS_MIB MiB, default 512), freed with it. Before, a
process grew by every new image shape's primitives without bound (46 MiB a shape in R50 training on AVX2;
bench/shape_memory.py).

Where it is not used: off the CPU (Metal on a Mac keeps MLX's kernels), in `export_mode()` (an
exported file holds MLX ops), where the extension or the library is missing (one line on stderr, once,
on x86-64 Linux, where it is expected), or with KERNELS_ONEDNN=0: `conv2d` and `linear` answer
None and the caller computes as before, the same answers up to float32 rounding. They also answer None
for a shape where oneDNN has only its reference loops or its im2col + GEMM (bfloat16 on AVX2, a 7 x 7 stem
on a one-pixel-wide image), remembered per shape: the caller's own fast path computes it (the patches, as
deformable_detr/models/convolution.py takes them). Where only a backward pass is refused (on AVX2 a strided 1 x 1
of an odd size, a dilated 3 x 3), the forward stays oneDNN's and the VJP takes the patches' way, in C++.

The library: PyPI's `onednn-cpu-gomp` 2023.2.0 (oneDNN 3.2, CPU only, on GNU OpenMP; 39 MB to download),
a dependency on x86-64 Linux (pyproject.toml says why not the 2026 wheel). Its OpenMP threads are
told to sleep when idle (OMP_WAIT_POLICY=PASSIVE, before the library loads): spinning, they took the
cores MLX's own one-thread operations and the attention kernel run on next.
"""

import ctypes
import importlib
import os
import platform
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from importlib import metadata

import mlx.core as mx
import mlx.nn as nn

from . import settings
from .cpu import threads
from .export import exporting
from .native import other_mlx

# Whether oneDNN is used, and the caches' capacities (native/onednn.cpp, whose top says what 32 keeps and what it
# makes again): plans (a shape's primitives) of each kind (oneDNN's own primitive cache gets as many primitives),
# and MiB of a model's kept weight copies (`kept_weights`). Their defaults and parsers: kernels/settings.py.
SWITCH, PLANS, WEIGHTS_MIB = settings.ONEDNN, settings.ONEDNN_PLANS, settings.ONEDNN_WEIGHTS_MIB
DISTRIBUTION = "onednn-cpu-gomp"
EXPECTED = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def _library():
    """libdnnl.so.3 of the `onednn-cpu-gomp` distribution (installed into the environment's lib/)."""
    try:
        distribution = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None
    for file in distribution.files or ():
        if file.name == "libdnnl.so.3":
            return distribution.locate_file(file).resolve()
    return None


@cache
def _load():
    if not SWITCH.value():
        return None, f"{SWITCH.name}=0"
    library = _library()
    if library is None or not library.is_file():
        return None, f"oneDNN's library is not installed (pip install {DISTRIBUTION}==2023.2.0)"
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when libgomp loads, with the library
    try:
        ctypes.CDLL(str(library), mode=os.RTLD_GLOBAL)
        module = importlib.import_module("kernels._onednn")
    except (OSError, ImportError) as error:
        return None, f"kernels._onednn cannot be loaded ({error}); reinstalling the package builds it"
    mismatch = other_mlx(module)
    if mismatch:
        return None, mismatch
    module.set_capacity(PLANS.value())
    module.set_slower_passes(settings.ONEDNN_SLOWER_PASSES.value())  # its C++ reads no environment
    return module, None


def module():
    """The extension, or None where it cannot be used (`missing()` says why)."""
    return _load()[0]


def missing() -> str | None:
    return _load()[1]


@cache
def _say_missing_once():
    why = missing()
    if why is not None and EXPECTED and not why.startswith(SWITCH.name):
        print(f"kernels: convolutions and products run on MLX, not oneDNN: {why}", file=sys.stderr)


def describe() -> str:
    """ "oneDNN 3.2.0", or why it is not used."""
    extension = module()
    return extension.describe() if extension is not None else f"not used ({missing()})"


def _usable(*arrays):
    if exporting() or mx.default_device().type != mx.cpu:
        return None
    if any(a.dtype not in (mx.float32, mx.bfloat16) for a in arrays):
        return None
    extension = module()
    if extension is None:
        _say_missing_once()
    return extension


_products = ContextVar("kernels_onednn_products", default=(mx.float32, None, None))


@contextmanager
def products_in(dtype, kept=None, rule=None):
    """Inside, `conv2d` and `linear` of float32 operands run their products in `dtype` (bfloat16 or
    float32), their results still float32; read when an operation is built (as `export_mode`). `kept`:
    a model's KeptWeights (`kept_weights()`), where the copies of its weights oneDNN's kernels need (a
    convolution's weight in its blocked layout, a bfloat16 copy) are kept instead of made at every call;
    None: as outside. `rule` (a kernels.precision.BfloatRule, `auto`'s): with bfloat16, only the products
    it says pay run in bfloat16, the others float32; None: every product in `dtype`."""
    if dtype not in (mx.float32, mx.bfloat16):
        raise ValueError(f"products_in: bfloat16 or float32, not {dtype}")
    token = _products.set((dtype, _products.get()[1] if kept is None else kept, rule))
    try:
        yield
    finally:
        _products.reset(token)


def kept_weights():
    """A new store for a model's weight copies (products_in's `kept`), at most
    KERNELS_ONEDNN_WEIGHTS_MIB MiB (default 512; its `count`, `bytes`, `capacity`), for a model
    whose weights do not change while it is used (a Detector's: dropped with it, which frees the copies
    and lets MLX free the weights); None where oneDNN is not used."""
    extension = module()
    return None if extension is None else extension.KeptWeights(WEIGHTS_MIB.value() << 20)


def conv2d(
    x: mx.array,
    weight: mx.array,
    stride: int = 1,
    padding: int = 0,
    dilation: int = 1,
    bias=None,
    residual=None,
    relu: bool = False,
    keep_bfloat16: bool = False,
    dtype=None,
):
    """`mx.conv2d(x, weight, stride, padding, dilation)` (x (N, H, W, C), weight (O, k, k, C)) on oneDNN,
    differentiable w.r.t. both, in x's dtype; or None where oneDNN is not used (see the module) or has
    no fast kernel for this shape (remembered per shape): the caller then computes it its own way. Where
    it has a fast forward but no fast backward pass, the gradients are the patches' (im2col and col2im
    on every core, as deformable_detr/models/convolution.py's takes them).

    What follows the convolution in a network runs as oneDNN post-ops, in the same pass: `bias` (O,) added,
    then `residual` (the result's shape) added, then max(., 0) where `relu` (all differentiable: the ReLU's
    gradient is the cotangent where the result is positive). The result's dtype: `dtype` where given, else
    with `keep_bfloat16` bfloat16 where the products run in bfloat16 (for the next convolution to take as it
    is: a float32 result would be converted back at its next use), else x's. A bfloat16 x whose products
    `auto`'s rule puts in float32 is widened first."""
    extension = _usable(x, weight)
    if extension is None:
        return None
    bfloat16, kept = _in_bfloat16("conv", x.shape, weight.shape, stride, padding, dilation)
    if bias is None and residual is None and not relu and not keep_bfloat16 and dtype is None:
        return extension.conv2d(x, weight, stride, padding, dilation, bfloat16, kept, threads())
    x, result = _operand_and_result(x, weight, bfloat16, keep_bfloat16, dtype)
    return extension.conv2d_fused(
        x, weight, bias, residual, relu, result, stride, padding, dilation, bfloat16, kept, threads()
    )


def linear(
    x: mx.array,
    weight: mx.array,
    bias=None,
    relu: bool = False,
    keep_bfloat16: bool = False,
    dtype=None,
    residual=None,
):
    """x @ weight.T + bias (x (..., in), weight (out, in), bias (out,) or None) on oneDNN, differentiable
    w.r.t. all three, in x's dtype; or None where oneDNN is not used (see the module) or has no fast
    kernel for it (remembered per shape). `residual` (the result's shape): added as the product's post-op (a
    layer's residual addition, no pass of its own; its gradient the cotangent), then `relu`: max(., 0) likewise;
    the result's dtype: `dtype`, or bfloat16 with `keep_bfloat16` where the product runs in bfloat16 (for
    the next product to take as it is), else x's, as conv2d's."""
    operands = [a for a in (x, weight, bias, residual) if a is not None]
    extension = _usable(*operands)
    if extension is None or x.ndim == 0 or (bias is not None and bias.ndim != 1):
        return None
    bfloat16, kept = _in_bfloat16("linear", x.shape, weight.shape)
    x, result = _operand_and_result(x, weight, bfloat16, keep_bfloat16, dtype)
    flat = x.reshape(-1, x.shape[-1])
    rows = None if residual is None else residual.reshape(flat.shape[0], weight.shape[0])
    y = extension.product(flat, weight, bias, False, True, bfloat16, kept, threads(), relu, result, rows)
    return None if y is None else y.reshape(*x.shape[:-1], weight.shape[0])


def binary(operation: str, a: mx.array, b: mx.array):
    """a + b ("add") or a * b ("multiply") on oneDNN (b of a's shape or broadcast along dimensions of 1; float32 or
    bfloat16), differentiable, in a's dtype; or None where oneDNN is not used or the shapes are not such."""
    extension = _usable(a, b)
    if extension is None:
        return None
    return extension.binary(operation, a, b, threads())


def astype(x: mx.array, dtype):
    """x cast between float32 and bfloat16 on oneDNN (round to nearest even, MLX's bits), differentiable; or None
    where oneDNN is not used, the dtypes are others, or they are the same."""
    extension = _usable(x)
    if extension is None or dtype not in (mx.float32, mx.bfloat16) or x.dtype == dtype:
        return None
    if bfloat16_kernels() is not None:  # without bfloat16 instructions its conversions are emulated (-0 lost on AVX2)
        return None
    return extension.cast(x, dtype, threads())


def max_pool2d(x: mx.array, kernel: int, stride: int, padding: int):
    """`nn.MaxPool2d(kernel, stride, padding)(x)` (x (N, H, W, C)) on oneDNN, one pass on every core, its gradient
    MLX's pooling's (recomputed); or None where oneDNN is not used or the window does not fit."""
    extension = _usable(x)
    out_h, out_w = ((side + 2 * padding - kernel) // stride + 1 for side in x.shape[1:3]) if x.ndim == 4 else (0, 0)
    if extension is None or padding >= kernel or min(out_h, out_w) < 1:
        return None
    if extension.max_pool2d(x, kernel, stride, padding, threads()) is None:  # only reference loops, or none
        return None  # (the array made to ask is never evaluated)
    return _max_pool(kernel, stride, padding)(x)


@cache
def _max_pool(kernel: int, stride: int, padding: int):
    mlx_pool = nn.MaxPool2d(kernel, stride, padding)

    @mx.custom_function
    def pooled(x):
        return module().max_pool2d(x, kernel, stride, padding, threads())

    @pooled.vjp
    def pooled_vjp(primals, cotangent, output):
        x = primals[0] if isinstance(primals, (tuple, list)) else primals  # one primal: MLX hands it as it is
        _, (grad,) = mx.vjp(mlx_pool, [x], [cotangent])
        return (grad,)

    return pooled


def _operand_and_result(x, weight, bfloat16: bool, keep_bfloat16: bool, dtype) -> tuple[mx.array, str]:
    """(x as the product takes it, the result's dtype by name) for conv2d's and linear's rules: a bfloat16 x
    (handed on by a product before) whose products the rule puts in float32 widened first."""
    if not bfloat16 and x.dtype == mx.bfloat16 and weight.dtype == mx.float32:
        x = x.astype(mx.float32)
    in_bfloat16 = bfloat16 or mx.bfloat16 in (x.dtype, weight.dtype)
    if dtype is None:
        dtype = mx.bfloat16 if keep_bfloat16 and in_bfloat16 else x.dtype
    return x, "bfloat16" if dtype == mx.bfloat16 else "float32"


def _in_bfloat16(kind: str, x_shape, w_shape, *geometry) -> tuple[bool, object]:
    """(whether this product runs in bfloat16 where products_in asks, the KeptWeights it asks for)."""
    dtype, kept, rule = _products.get()
    if dtype != mx.bfloat16 or rule is None:
        return dtype == mx.bfloat16, kept
    return rule.pays(*work(kind, x_shape, w_shape, *geometry)), kept


def work(kind: str, x_shape, w_shape, stride: int = 1, padding: int = 0, dilation: int = 1) -> tuple[int, int]:
    """(multiply-adds for one item of the batch, the reduction's length) of a convolution (x (N, H, W, C), w (O,
    k, k, C): an image) or a product (x (..., K), w (N, K): a row of a 2-D x, the leading dimension's item of more).
    An item's, not the batch's: a rule deciding by it (`products_in`) gives a product the same precision whatever
    the batch, so that batching changes no answer beyond float32's last bits (the server's batches)."""
    if kind == "linear":
        rows = 1
        for side in x_shape[1:-1] if len(x_shape) > 2 else x_shape[:1]:
            rows *= side
        return rows * x_shape[-1] * w_shape[0], x_shape[-1]
    _, h, w, c = x_shape
    o, k = w_shape[0], w_shape[1]
    out_h = (h + 2 * padding - dilation * (k - 1) - 1) // stride + 1
    out_w = (w + 2 * padding - dilation * (k - 1) - 1) // stride + 1
    return out_h * out_w * o * k * k * c, k * k * c


def caches() -> dict:
    """What the extension keeps: {"convolutions", "products": plans (a shape's primitives) kept now;
    "convolution_hits", "convolution_misses", "product_hits", "product_misses": lookups since the process
    began that found a kept plan or made one; "capacity": plans of each kind; "lasting": plans kept beyond it
    (AMX convolutions: native/onednn_conv.cpp says why); "onednn_capacity": oneDNN's
    primitive cache's; "largest_scratchpad": bytes a call has needed at most}; {} where oneDNN is not used."""
    extension = module()
    return {} if extension is None else dict(extension.caches())


BFLOAT16_FLAGS = ("amx_bf16", "avx512_bf16")


def bfloat16_instructions() -> list[str]:
    """The bfloat16 product instructions this CPU has, of BFLOAT16_FLAGS (/proc/cpuinfo's flags): AMX
    tiles (Intel Xeon since Sapphire Rapids), AVX512-BF16 (Intel Cooper Lake on, AMD Zen 4 on)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return []
    return [flag for flag in BFLOAT16_FLAGS if flag in flags]


@cache
def bfloat16_kernels() -> str | None:
    """Why oneDNN has no fast bfloat16 products here, or None where it has: asked of oneDNN itself (the
    kernel it picks for a bfloat16 convolution), so that ONEDNN_MAX_CPU_ISA's cap counts. Fast: AMX or
    AVX512-BF16 kernels (an ISA named ..._bf16 or ..._amx); not: none at all (AVX2: oneDNN 3.2 refuses
    bfloat16 convolutions) or AVX-512 emulating bfloat16 (`jit_bf16:avx512_core`, slower than float32)."""
    extension = module()
    if extension is None:
        return f"oneDNN is {describe()}"
    x, weight = mx.zeros((1, 8, 8, 32)), mx.zeros((32, 3, 3, 32))
    kernel = extension.conv2d_implementation(x, weight, 1, 1, 1, True)
    isa = kernel.rsplit(":", 1)[-1]
    if not kernel.startswith("refused") and ("bf16" in isa or "amx" in isa):
        return None
    has = bfloat16_instructions()
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA")
    if has and capped:
        return f"ONEDNN_MAX_CPU_ISA={capped} keeps oneDNN from this CPU's {', '.join(has)}"
    what = "none" if kernel.startswith("refused") else f"only {kernel}, which emulates bfloat16"
    return f"this CPU has no bfloat16 product instructions (AVX512-BF16, AMX): oneDNN has {what} for them"
