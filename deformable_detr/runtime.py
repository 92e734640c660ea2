"""The process's run-time set-up, done once by every entry point (`cli.entry_point`) before it works:
MKL's BLAS in place of the reference BLAS of MLX's Linux CPU wheel, and glibc's malloc keeping freed
memory for reuse. Both must be in place when the process starts, so `setup()` re-executes the
process once with them in its environment. (The tests, which cannot re-execute pytest, take MKL with
`load_mkl()` before anything imports MLX.)

MKL: on Linux x86-64 the project installs `mkl` from PyPI; MLX's matrix products and convolutions
go through BLAS, and with MKL preloaded they run several times faster (bench/results).
DEFORMABLE_DETR_MKL=0 turns the re-execution off; where MKL is not installed, nothing changes.

malloc: MLX's CPU back-end allocates a fresh buffer for every op's output, and glibc maps each large
one anew and returns it on free, so every activation is page-faulted in again (23.5 M page faults in
two R50 steps at 800 px). Kept in the heap instead, an R50 training step at 512 x 683 took 28 s
instead of 33 s here, for about 150 MiB more peak RSS."""

import ctypes
import os
import sys
from pathlib import Path


def mkl_runtime() -> Path | None:
    """libmkl_rt of this environment, if MKL is installed in it."""
    for lib in (Path(sys.prefix) / "lib").glob("libmkl_rt.so*"):
        return lib
    return None


def runtime_environment(environ=None) -> dict:
    """`environ` (default: this process's) with MKL preloaded and the malloc thresholds set, as the
    entry points run (the benchmarks start their measured processes with it)."""
    env = dict(os.environ if environ is None else environ)
    lib = mkl_runtime()
    preload = env.get("LD_PRELOAD", "")
    if lib is not None and "libmkl_rt" not in preload:
        env["LD_PRELOAD"] = f"{lib}:{preload}" if preload else str(lib)
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        env.setdefault(name, str(16 * 2**30))
    return env


def setup():
    """Re-execute this process once with `runtime_environment()` (Linux, where MKL is installed)."""
    if sys.platform != "linux" or os.environ.get("DEFORMABLE_DETR_MKL") == "0":
        return
    if mkl_runtime() is None or "libmkl_rt" in os.environ.get("LD_PRELOAD", ""):
        return
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], runtime_environment())  # keeps `-m module`


def load_mkl() -> bool:
    """MKL's BLAS for this process's MLX without re-executing it: loaded into the global symbol scope
    before MLX's library is, MLX's BLAS calls bind to it, as with LD_PRELOAD (a 2048 x 2048 matmul:
    0.095 s instead of 2.8 s here). -> whether MKL is in place. Only before `mlx.core` is imported."""
    if "mlx.core" in sys.modules:
        raise RuntimeError("load_mkl() must come before the first import of mlx.core")
    lib = mkl_runtime()
    if sys.platform != "linux" or lib is None or os.environ.get("DEFORMABLE_DETR_MKL") == "0":
        return False
    ctypes.CDLL(str(lib), mode=os.RTLD_GLOBAL)
    return True
