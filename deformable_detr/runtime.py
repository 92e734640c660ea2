"""The process's set-up, done once when `deformable_detr` is imported, before MLX (which the package
imports): the same in a command, a script of your own, a notebook or an app.

- BLAS: `kernels` loads OpenBLAS or MKL for MLX's matrix products in place of the reference BLAS of
  MLX's Linux CPU wheel (kernels/blas.py; DEFORMABLE_DETR_BLAS chooses), or warns where MLX was
  imported first;
- malloc: MLX's CPU back-end allocates a fresh buffer for every op's output, and glibc maps each large
  one anew and returns it on free, so every activation is page-faulted in again (23.5 M page faults in
  two R50 steps at 800 px). glibc is told to keep freed memory in its heap for reuse (`mallopt`, as
  MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ would at start-up): an R50 training step at 512 x 683
  took 28 s instead of 33 s on an AMD EPYC, for about 150 MiB more peak RSS. A user's own
  MALLOC_MMAP_THRESHOLD_ stays theirs. (PyTorch gains as much from it: the benchmarks run its
  processes with `malloc_environment()`.)"""

import ctypes
import os
import sys

# glibc's mallopt parameters, and the thresholds: 2 GiB (mallopt takes an int), above any one buffer of
# an R50 step (the largest, the stem's patches at 800 x 1066 for 2 images, is about 250 MB).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
THRESHOLD = 2**31 - 1
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(THRESHOLD)}


def keep_freed_memory() -> bool:
    """glibc's malloc keeps freed memory in the heap from now on (Linux; not where the user set its
    thresholds). -> whether it was set here."""
    if sys.platform != "linux" or any(name in os.environ for name in MALLOC):
        return False
    try:
        libc = ctypes.CDLL(None)
        return all(libc.mallopt(option, THRESHOLD) == 1 for option in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


def malloc_environment(environ=None) -> dict:
    """`environ` (default: this process's) with glibc's malloc keeping freed memory from the start: for
    processes that do not import this package (the benchmarks' PyTorch side)."""
    env = dict(os.environ if environ is None else environ)
    for name, value in MALLOC.items():
        env.setdefault(name, value)
    return env


def set_up():
    keep_freed_memory()
    import kernels  # noqa: F401  (sets up the BLAS, before anything here imports MLX)
