"""Convolutions and matrix products on oneDNN, Intel's deep learning kernels (the ones under PyTorch,
OpenVINO and TensorFlow on x86 CPUs): `conv2d` and `linear`, as MLX operations with their gradients
(C++ `Primitive`s of `kernels._onednn`, built from native/onednn.cpp where oneDNN's headers were there).

Why: MLX's CPU back-end runs a convolution as im2col + one sgemm and has no fast bfloat16 product (a
bf16 2048^2 product takes 3.9 s, f32 0.19 s). oneDNN's JIT kernels use blocked layouts, AVX-512 and,
for bfloat16, AVX512-BF16 and AMX: the R50 backbone's convolutions at 800 x 1066 took 660 ms at float32
and 374 ms with bfloat16 products on an AMD EPYC Zen 4, 2 threads (bench/onednn_device/, 2026-12-04);
the whole R50 inference 2.05 / 1.39 s against 2.44 s before (bench/README.md#onednn).

Precision: products in bfloat16 (float32 accumulation) inside `products_in(mx.bfloat16)` or where
either operand is bfloat16, float32 otherwise; the result in the first operand's dtype. So float32
activations and weights inside `products_in(mx.bfloat16)` give float32 results computed with bfloat16
products (`--precision bfloat16` at inference: no bfloat16 copy of the weights is kept, the
convolutions' weights are reordered into oneDNN's layout at every call anyway), and bfloat16
activations give bfloat16 results (`train.precision: bfloat16`).

Where it is not used: off the CPU (Metal on a Mac keeps MLX's kernels), in `export_mode()` (an
exported file holds MLX ops), where the extension or the library is missing (one line on stderr, once,
on x86-64 Linux, where it is expected), where oneDNN has only its reference loops for a shape (bfloat16
on a CPU without AVX-512), or with DEFORMABLE_DETR_ONEDNN=0. Then `conv2d` and `linear` answer None and
the caller computes as before: the same answers, up to float32 rounding.

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

from .cpu import threads
from .export import exporting

VARIABLE = "DEFORMABLE_DETR_ONEDNN"
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
    if os.environ.get(VARIABLE, "1") == "0":
        return None, f"{VARIABLE}=0"
    library = _library()
    if library is None or not library.is_file():
        return None, f"oneDNN's library is not installed (pip install {DISTRIBUTION}==2023.2.0)"
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when libgomp loads, with the library
    try:
        ctypes.CDLL(str(library), mode=os.RTLD_GLOBAL)
        module = importlib.import_module("kernels._onednn")
    except (OSError, ImportError) as error:
        return None, f"kernels._onednn cannot be loaded ({error}); reinstalling the package builds it"
    if module.mlx_version != mx.__version__:
        return None, f"kernels._onednn was built against MLX {module.mlx_version}, not {mx.__version__}"
    return module, None


def module():
    """The extension, or None where it cannot be used (`missing()` says why)."""
    return _load()[0]


def missing() -> str | None:
    return _load()[1]


@cache
def _say_missing_once():
    why = missing()
    if why is not None and EXPECTED and not why.startswith(VARIABLE):
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


_products = ContextVar("kernels_onednn_products", default=mx.float32)


@contextmanager
def products_in(dtype):
    """Inside, `conv2d` and `linear` of float32 operands run their products in `dtype` (bfloat16 or
    float32), their results still float32; read when an operation is built (as `export_mode`)."""
    if dtype not in (mx.float32, mx.bfloat16):
        raise ValueError(f"products_in: bfloat16 or float32, not {dtype}")
    token = _products.set(dtype)
    try:
        yield
    finally:
        _products.reset(token)


def products() -> mx.Dtype:
    """The dtype `products_in` asks for here (float32 outside it)."""
    return _products.get()


# Shapes oneDNN refused (only its reference loops): computed with MLX from then on, without asking again.
_refused: set = set()


def conv2d(x: mx.array, weight: mx.array, stride: int = 1, padding: int = 0, dilation: int = 1):
    """`mx.conv2d(x, weight, stride, padding, dilation)` (x (N, H, W, C), weight (O, k, k, C)) on oneDNN,
    differentiable w.r.t. both, in x's dtype; or None where oneDNN is not used (see the module)."""
    extension = _usable(x, weight)
    bfloat16 = products() == mx.bfloat16
    key = ("conv", x.shape, weight.shape, x.dtype, weight.dtype, stride, padding, dilation, bfloat16)
    if extension is None or key in _refused:
        return None
    try:
        return extension.conv2d(x, weight, stride, padding, dilation, bfloat16, threads())
    except RuntimeError:  # only oneDNN's reference loops for it
        _refused.add(key)
        return None


def linear(x: mx.array, weight: mx.array, bias=None):
    """x @ weight.T + bias (x (..., in), weight (out, in), bias (out,) or None) on oneDNN, differentiable
    w.r.t. all three, in x's dtype; or None where oneDNN is not used (see the module)."""
    operands = (x, weight) if bias is None else (x, weight, bias)
    extension = _usable(*operands)
    bfloat16 = products() == mx.bfloat16
    key = ("linear", x.shape, weight.shape, x.dtype, weight.dtype, bias is None or bias.dtype, bfloat16)
    if extension is None or key in _refused or x.ndim == 0 or (bias is not None and bias.ndim != 1):
        return None
    flat = x.reshape(-1, x.shape[-1])
    try:
        y = extension.product(flat, weight, bias, False, True, bfloat16, threads())
    except RuntimeError:
        _refused.add(key)
        return None
    return y.reshape(*x.shape[:-1], weight.shape[0])


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
