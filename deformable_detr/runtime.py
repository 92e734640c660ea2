"""The process's run-time set-up, done once by every entry point (`cli.entry_point`) before it works:
a fast BLAS in place of the reference BLAS of MLX's Linux CPU wheel, and glibc's malloc keeping freed
memory for reuse. Both must be in place when the process starts, so `setup()` re-executes the
process once with them in its environment. (The tests, which cannot re-execute pytest, take the BLAS
with `load_blas()` before anything imports MLX.)

BLAS: MLX's matrix products and convolutions go through `cblas_sgemm`. On Linux x86-64 the project
installs two from PyPI, OpenBLAS (`scipy-openblas32`) and MKL, and DEFORMABLE_DETR_BLAS chooses:
- `auto` (the default): MKL on Intel CPUs, OpenBLAS on the others (and the other one where the
  first is not installed). On AMD CPUs MKL runs its generic kernels: on this project's AMD EPYC
  (AVX-512) the model's products took MKL 1.3-1.6x OpenBLAS's time, an R50 inference 1.35x
  (bench/train_step.py, bench/README.md);
- `openblas` or `mkl`: that one, where installed; `bundled`: MLX's own.
scipy-openblas32 names its symbols `scipy_cblas_*`: kernels' `libopenblas_cblas.so` (built with the
C++ extension) gives MLX them under the names it calls, preloaded after OpenBLAS.

malloc: MLX's CPU back-end allocates a fresh buffer for every op's output, and glibc maps each large
one anew and returns it on free, so every activation is page-faulted in again (23.5 M page faults in
two R50 steps at 800 px). Kept in the heap instead, an R50 training step at 512 x 683 took 28 s
instead of 33 s here, for about 150 MiB more peak RSS. (PyTorch gains as much or more from it: the
benchmarks run both sides with it, `malloc_environment`.)"""

import ctypes
import importlib.util
import os
import sys
from pathlib import Path

CHOICES = ("auto", "openblas", "mkl", "bundled")
# Set beside each BLAS. OpenBLAS's idle threads spin for 2**28 cycles after each product, on the cores
# MLX's one-thread operations and the attention kernel's threads need: 2**4 made an R50 inference
# 0.3 s faster here (2.98 / 3.49 s against 3.32 / 3.81 s, alternating) and a 512 x 683 training step
# 0.5-1.5 s (9.02 / 9.06 against 9.51 / 10.52 s).
BLAS_SETTINGS = {"openblas": {"OPENBLAS_THREAD_TIMEOUT": "4"}}
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(16 * 2**30), "MALLOC_TRIM_THRESHOLD_": str(16 * 2**30)}


def _package_dir(name: str) -> Path | None:
    """An installed package's folder, found without importing it (kernels imports MLX)."""
    spec = importlib.util.find_spec(name)
    return Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None


def mkl_libraries() -> list[Path]:
    """libmkl_rt of this environment, if MKL is installed in it."""
    return sorted((Path(sys.prefix) / "lib").glob("libmkl_rt.so*"))[:1]


def openblas_libraries() -> list[Path]:
    """scipy-openblas32's OpenBLAS and the library that gives MLX its products, if both are here."""
    openblas, kernels = _package_dir("scipy_openblas32"), _package_dir("kernels")
    if openblas is None or kernels is None:
        return []
    libraries = [openblas / "lib" / "libscipy_openblas.so", kernels / "libopenblas_cblas.so"]
    return libraries if all(library.is_file() for library in libraries) else []


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...), or "" where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def blas_preference(environ=None) -> list[str]:
    """DEFORMABLE_DETR_BLAS of `environ` (default: this process's) as the BLAS to try, in order."""
    choice = (os.environ if environ is None else environ).get("DEFORMABLE_DETR_BLAS", "auto")
    if choice not in CHOICES:
        raise ValueError(f"DEFORMABLE_DETR_BLAS={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "auto":
        return ["mkl", "openblas"] if cpu_vendor() == "GenuineIntel" else ["openblas", "mkl"]
    return [] if choice == "bundled" else [choice]


def _installed(name: str) -> list[Path]:
    """What to preload for `name`: [] for MLX's own, or where it is not installed."""
    return {"openblas": openblas_libraries, "mkl": mkl_libraries}.get(name, list)()


def blas_choice(environ=None) -> str:
    """The BLAS the set-up gives MLX: the first of `blas_preference` installed here, or "bundled"."""
    if sys.platform != "linux":
        return "bundled"
    return next((name for name in blas_preference(environ) if _installed(name)), "bundled")


def blas_libraries(environ=None) -> list[Path]:
    """What to preload, in order, for `blas_choice`: [] for MLX's own."""
    return _installed(blas_choice(environ))


def malloc_environment(environ=None) -> dict:
    """`environ` (default: this process's) with glibc's malloc keeping freed memory."""
    env = dict(os.environ if environ is None else environ)
    for name, value in MALLOC.items():
        env.setdefault(name, value)
    return env


def runtime_environment(environ=None) -> dict:
    """`environ` (default: this process's) with the BLAS preloaded and set and the malloc thresholds
    set, as the entry points run (the benchmarks start their measured processes with it)."""
    env = malloc_environment(environ)
    choice = blas_choice(env)
    preload = [entry for entry in env.get("LD_PRELOAD", "").split(":") if entry]
    missing = [str(library) for library in _installed(choice) if str(library) not in preload]
    if missing:
        env["LD_PRELOAD"] = ":".join(missing + preload)
    for name, value in BLAS_SETTINGS.get(choice, {}).items():
        env.setdefault(name, value)
    return env


def setup(blas: bool = True):
    """Re-execute this process once with `runtime_environment()` (or `blas=False`: with the malloc
    thresholds only), where that changes anything (Linux)."""
    if sys.platform != "linux":
        return
    env = runtime_environment() if blas else malloc_environment()
    if env == dict(os.environ):
        return
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)  # keeps `-m module`


def load_blas() -> list[Path]:
    """The chosen BLAS for this process's MLX without re-executing it: loaded into the global symbol
    scope before MLX's library is, MLX's BLAS calls bind to it, as with LD_PRELOAD (a 2048 x 2048
    matmul: about 0.1 s instead of 2.8 s here). -> what was loaded. Only before `mlx.core` is imported."""
    if "mlx.core" in sys.modules:
        raise RuntimeError("load_blas() must come before the first import of mlx.core")
    choice = blas_choice()
    for name, value in BLAS_SETTINGS.get(choice, {}).items():
        os.environ.setdefault(name, value)  # read when the library loads
    libraries = _installed(choice)
    for library in libraries:
        ctypes.CDLL(str(library), mode=os.RTLD_GLOBAL)
    return libraries


def blas_in_use() -> str:
    """The BLAS this process's MLX calls, from the libraries it has loaded: openblas, mkl or bundled."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "bundled"
    for name in ("openblas", "mkl"):
        libraries = _installed(name)
        if libraries and all(str(library.resolve()) in maps for library in libraries):
            return name
    return "bundled"


def blas_description() -> str:
    """`blas_in_use()`, with the kernels OpenBLAS runs (it reads OPENBLAS_CORETYPE, which some machines
    set): e.g. "openblas (SkylakeX kernels)"."""
    name = blas_in_use()
    corename = getattr(ctypes.CDLL(None), "scipy_openblas_get_corename", None) if name == "openblas" else None
    if corename is None:
        return name
    corename.restype = ctypes.c_char_p
    return f"{name} ({corename().decode()} kernels)"
