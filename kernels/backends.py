"""Which implementation runs an op: the MLX-ops path (every device, every float dtype), a fused
GPU kernel (`kernels.metal`, `kernels.cuda`) or the C++ CPU kernel (`kernels.cpu`)."""

import mlx.core as mx

from . import cpu, cuda, metal
from .export import exporting
from .settings import BACKEND

FUSED = {"metal": metal.METAL, "cuda": cuda.CUDA}
NATIVE_CPU = {"cpu": cpu.CPU}  # ms_deform_attn only
NAMES = ("mlx", *FUSED, *NATIVE_CPU)


def select(op: str, backend: str | None, dtype: mx.Dtype, unsupported: str | None = None, cpu_kernel: bool = False):
    """The kernel back-end to run (an entry of FUSED or NATIVE_CPU), or None for the MLX-ops path.

    None picks Metal, then CUDA, then the CPU kernel (where the op has one: `cpu_kernel`), the first
    that can run (built, and the default device is its device) and takes the call; otherwise the
    MLX-ops path. Forcing a back-end that cannot run, or a call it does not take (float64, or
    `unsupported`: why not), is an error that says which and why. In `export_mode()` it is None
    whatever was asked: an exported file holds MLX ops only, and runs on every device.
    """
    if exporting():
        return None
    candidates = {**FUSED, **(NATIVE_CPU if cpu_kernel else {})}
    if backend == "mlx":
        return None
    if backend is None:
        if dtype == mx.float64 or unsupported is not None:
            return None
        return next((kernel for kernel in candidates.values() if kernel.missing() is None), None)
    if backend not in candidates:
        raise ValueError(f"{op}: backend {backend!r} has no {op}; backend='mlx' has it")
    fused = candidates[backend]
    why = fused.missing()
    if why is not None:
        raise RuntimeError(f"{op}: backend {backend!r} cannot run here: {why}. backend='mlx' runs everywhere.")
    if dtype == mx.float64:
        raise ValueError(
            f"{op}: backend {backend!r} has no float64 (it computes in float32, as MLX's GPUs do); "
            "use float32, or backend='mlx' on the CPU device"
        )
    if unsupported is not None:
        raise ValueError(f"{op}: backend {backend!r} {unsupported}; backend='mlx' has it")
    return fused


def from_environment() -> str | None:
    """KERNELS_BACKEND: the back-end for calls that name none (for callers such as a model, which
    cannot pass `backend=`); unset or empty: the automatic choice."""
    return BACKEND.value()


def available() -> tuple[str, ...]:
    """The back-ends that can run here, "mlx" first."""
    kernels = {**FUSED, **NATIVE_CPU}
    return ("mlx", *(name for name, kernel in kernels.items() if kernel.missing() is None))
