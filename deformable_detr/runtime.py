"""The process's set-up, done once when `deformable_detr` is imported, before MLX (which the package
imports): the same in a command, a script of your own, a notebook or an app.

- BLAS: `kernels` loads OpenBLAS or MKL for MLX's matrix products in place of the reference BLAS of
  MLX's Linux CPU wheel (kernels/blas.py; KERNELS_BLAS chooses), or warns where MLX was
  imported first;
- malloc: MLX's CPU back-end allocates a fresh buffer for every op's output, and glibc maps each large
  one anew and returns it on free, so every activation is page-faulted in again (23.5 M page faults in
  two R50 steps at 800 px). glibc is told to keep freed memory in its heap for reuse (`mallopt`, as
  MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ would at start-up): an R50 training step at 512 x 683
  took 28 s instead of 33 s on an AMD EPYC, for about 150 MiB more peak RSS. Kept memory stays in the
  heap (arena) that freed it, and glibc makes up to 8 heaps a core as threads meet in malloc (MLX's
  stream, oneDNN's and OpenBLAS's workers, the kernels' threads, started for each call): each holding
  its own high water, on a many-core server hundreds of them. So glibc is told to make at most one a
  core, at least 2 (M_ARENA_MAX, as MALLOC_ARENA_MAX would): the R50 step at 512 x 683 on 2 cores took
  the same time (6.04 s against 6.10; one heap in all: 6.35-6.85 s, the threads waiting on its lock).
  A user's own MALLOC_* settings stay theirs. (PyTorch gains as much from the thresholds: the benchmarks
  run its processes with `malloc_environment()`, which leaves the heaps to glibc: capped at 2, PyTorch's
  R50 step as AVX2 took 9.54-9.60 s against 8.88-9.15.)"""

import ctypes
import os
import sys

# glibc's mallopt parameters, and the thresholds: 2 GiB (mallopt takes an int), above any one buffer of
# an R50 step (the largest, the stem's patches at 800 x 1066 for 2 images, is about 250 MB).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
THRESHOLD = 2**31 - 1
ARENAS = max(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(THRESHOLD)}
ARENA_VARIABLE = "MALLOC_ARENA_MAX"


def keep_freed_memory() -> bool:
    """glibc's malloc keeps freed memory in the heap from now on, in at most ARENAS heaps (Linux; not
    where the user set any of MALLOC or ARENA_VARIABLE). -> whether it was set here."""
    if sys.platform != "linux" or any(name in os.environ for name in (*MALLOC, ARENA_VARIABLE)):
        return False
    try:
        libc = ctypes.CDLL(None)
        settings = ((M_MMAP_THRESHOLD, THRESHOLD), (M_TRIM_THRESHOLD, THRESHOLD), (M_ARENA_MAX, ARENAS))
        return all(libc.mallopt(option, value) == 1 for option, value in settings)
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


def malloc_environment(environ=None) -> dict:
    """`environ` (default: this process's) with glibc's malloc keeping freed memory from the start, its
    heaps its own: for processes that do not import this package (the benchmarks' PyTorch side)."""
    env = dict(os.environ if environ is None else environ)
    for name, value in MALLOC.items():
        env.setdefault(name, value)
    return env


def set_up():
    keep_freed_memory()
    import kernels  # noqa: F401  (sets up the BLAS, before anything here imports MLX)
