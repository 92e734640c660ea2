"""Which implementation runs an op: the MLX-ops path (every device, every float dtype) or a fused
GPU kernel (`kernels.metal`, `kernels.cuda`)."""

import mlx.core as mx

from . import cuda, metal
from .fused import Backend

FUSED = {"metal": metal.METAL, "cuda": cuda.CUDA}
NAMES = ("mlx", *FUSED)


def select(op: str, backend: str | None, dtype: mx.Dtype, unsupported: str | None = None) -> Backend | None:
    """The fused back-end to run, or None for the MLX-ops path.

    None picks Metal, then CUDA, where one can run (MLX has the back-end and the default device is
    the GPU) and the call is one the kernels take; otherwise the MLX-ops path. Forcing a fused
    back-end that cannot run, or a call it does not take (float64, or `unsupported`: why not),
    is an error that says which and why.
    """
    if backend == "mlx":
        return None
    if backend is None:
        if dtype == mx.float64 or unsupported is not None:
            return None
        return next((fused for fused in FUSED.values() if fused.missing() is None), None)
    fused = FUSED[backend]
    why = fused.missing()
    if why is not None:
        raise RuntimeError(f"{op}: backend {backend!r} cannot run here: {why}. backend='mlx' runs everywhere.")
    if dtype == mx.float64:
        raise ValueError(
            f"{op}: backend {backend!r} has no float64 (MLX's GPUs have none); "
            "use float32, or backend='mlx' on the CPU device"
        )
    if unsupported is not None:
        raise ValueError(f"{op}: backend {backend!r} {unsupported}; backend='mlx' has it")
    return fused


def available() -> tuple[str, ...]:
    """The back-ends that can run here, "mlx" first."""
    return ("mlx", *(name for name, fused in FUSED.items() if fused.missing() is None))
