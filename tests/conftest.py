import os

# MLX runs float32 matmuls as TF32 on GPUs with matrix units unless told not to (its own test
# harness says so too); the references here are full float32. Set before MLX's first operation.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

# The tests run on the BLAS the commands run on (kernels/blas.py, set up as kernels is imported, before
# MLX): 2.5x faster as a suite than on MLX's bundled one.
import kernels  # noqa: E402, F401

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

DTYPES = {"float32": (mx.float32, np.float32), "float64": (mx.float64, np.float64)}
# float32 agreement with PyTorch: outputs to ~1e-6, gradients accumulate more rounding.
TOLERANCE = {"float32": dict(rtol=1e-4, atol=1e-4), "float64": dict(rtol=1e-10, atol=1e-10)}


def to_mx(array, dtype=mx.float64):
    return mx.array(np.asarray(array), dtype=dtype)


def to_np(array: mx.array) -> np.ndarray:
    return np.array(array.astype(mx.float32) if array.dtype in (mx.float16, mx.bfloat16) else array)


def pytest_configure(config):
    config.addinivalue_line("markers", "float64: computes in float64, which MLX has on the CPU only")


@pytest.fixture(autouse=True)
def float64_on_cpu(request):
    """MLX's GPUs (Metal, CUDA) have no float64: run float64 tests on the CPU device, the others on
    the default device (the GPU where there is one)."""
    params = getattr(request.node, "callspec", None)
    wants_float64 = request.node.get_closest_marker("float64") or (
        params is not None and params.params.get("dtype_name") == "float64"
    )
    if not wants_float64:
        yield
        return
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def directional_check(f, args, argnum, rng, eps=1e-6, directions=3):
    """Compare the gradient of scalar f w.r.t. args[argnum] along random directions with central
    finite differences (float64)."""
    grad = mx.grad(f, argnums=argnum)(*args)
    base = np.array(args[argnum])
    for _ in range(directions):
        d = rng.standard_normal(base.shape)
        plus = list(args)
        minus = list(args)
        plus[argnum] = to_mx(base + eps * d)
        minus[argnum] = to_mx(base - eps * d)
        numeric = (f(*plus).item() - f(*minus).item()) / (2 * eps)
        analytic = float((np.array(grad) * d).sum())
        assert analytic == pytest.approx(numeric, rel=1e-6, abs=1e-8), (argnum, analytic, numeric)
    return grad
