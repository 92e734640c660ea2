"""The BLAS under MLX's matrix products, set up when `kernels` is imported (before MLX, which it
imports): MLX's Linux CPU wheel bundles a reference BLAS, on which a 2048 x 2048 float32 product
takes 2.5-13 s; OpenBLAS or MKL take about 0.1 s.

MLX's products and convolutions call `cblas_sgemm`, bound when MLX's library loads. A BLAS loaded
into the global symbol scope before that (`load`, as LD_PRELOAD would) takes those calls; one
loaded after cannot. So `set_up()` loads the chosen BLAS where MLX is not imported yet, and where it
is, says once (a warning) which BLAS MLX runs and how to get the fast one.

Which: KERNELS_BLAS=auto|openblas|mkl|bundled (kernels/settings.py).
- `auto` (the default): MKL on Intel CPUs where it is installed (the `mkl` extra), else
  OpenBLAS (`scipy-openblas32`, installed on Linux x86-64), else MLX's own. On AMD CPUs MKL runs its
  generic kernels: the model's products took it 1.3-1.6x OpenBLAS's time on an AMD EPYC (AVX-512);
  on Intel: bench/README.md#which-blas-and-what-an-install-costs;
- `openblas` or `mkl`: that one, where installed; `bundled`: MLX's own.
scipy-openblas32 names its symbols `scipy_cblas_*`: `libopenblas_cblas.so` (built with the C++
extension, native/openblas_cblas.cpp) gives MLX them under the names it calls, loaded after OpenBLAS.
This module imports no MLX."""

import ctypes
import importlib.util
import os
import sys
import warnings
from pathlib import Path

from . import settings

CHOICES = settings.BLAS_CHOICES
# Set beside each BLAS before it loads. OpenBLAS's idle threads spin for 2**28 cycles after each product,
# on the cores MLX's one-thread operations and the attention kernel's threads need: 2**4 made an R50
# inference 0.3 s faster on an AMD EPYC (2.98 / 3.49 s against 3.32 / 3.81 s, alternating) and a
# 512 x 683 training step 0.5-1.5 s (9.02 / 9.06 against 9.51 / 10.52 s).
SETTINGS = {"openblas": {"OPENBLAS_THREAD_TIMEOUT": "4"}}


def _package_dir(name: str) -> Path | None:
    """An installed package's folder, found without importing it."""
    spec = importlib.util.find_spec(name)
    return Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None


def mkl_libraries() -> list[Path]:
    """libmkl_rt of this environment, if MKL is installed in it."""
    return sorted((Path(sys.prefix) / "lib").glob("libmkl_rt.so*"))[:1]


def openblas_libraries() -> list[Path]:
    """scipy-openblas32's OpenBLAS and the library that gives MLX its products, if both are here."""
    openblas = _package_dir("scipy_openblas32")
    if openblas is None:
        return []
    libraries = [openblas / "lib" / "libscipy_openblas.so", Path(__file__).parent / "libopenblas_cblas.so"]
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


def preference(environ=None) -> list[str]:
    """KERNELS_BLAS of `environ` (default: this process's) as the BLAS to try, in order."""
    choice = settings.BLAS.value(environ)
    if choice == "auto":
        return ["mkl", "openblas"] if cpu_vendor() == "GenuineIntel" else ["openblas", "mkl"]
    return [] if choice == "bundled" else [choice]


def libraries_of(name: str) -> list[Path]:
    """What to load for `name`: [] for MLX's own, or where it is not installed."""
    return {"openblas": openblas_libraries, "mkl": mkl_libraries}.get(name, list)()


def choice(environ=None) -> str:
    """The BLAS to give MLX: the first of `preference` installed here, or "bundled"."""
    if sys.platform != "linux":
        return "bundled"
    return next((name for name in preference(environ) if libraries_of(name)), "bundled")


def load() -> list[Path]:
    """Load `choice()`'s libraries into the global symbol scope, with its settings: MLX, loaded after,
    binds its products to them. -> what was loaded. Only before `mlx.core` is imported."""
    if "mlx.core" in sys.modules:
        raise RuntimeError("the BLAS can be loaded for MLX only before the first import of mlx.core")
    chosen = choice()
    for name, value in SETTINGS.get(chosen, {}).items():
        os.environ.setdefault(name, value)  # read when the library loads
    libraries = libraries_of(chosen)
    for library in libraries:
        ctypes.CDLL(str(library), mode=os.RTLD_GLOBAL)
    return libraries


def in_use() -> str:
    """The BLAS this process's MLX calls, from the libraries it has loaded: openblas, mkl or bundled."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "bundled"
    for name in ("openblas", "mkl"):
        libraries = libraries_of(name)
        if libraries and all(str(library.resolve()) in maps for library in libraries):
            return name
    return "bundled"


def description() -> str:
    """`in_use()`, with the kernels OpenBLAS runs (it reads OPENBLAS_CORETYPE, which some machines set):
    e.g. "openblas (SkylakeX kernels)"."""
    name = in_use()
    corename = getattr(ctypes.CDLL(None), "scipy_openblas_get_corename", None) if name == "openblas" else None
    if corename is None:
        return name
    corename.restype = ctypes.c_char_p
    return f"{name} ({corename().decode()} kernels)"


def set_up():
    """Before MLX is imported: load the chosen BLAS. After: warn where MLX runs its bundled BLAS while a
    faster one is installed. A KERNELS_BLAS that is none of CHOICES: a warning, and `auto`."""
    try:
        preference()
    except ValueError as error:
        warnings.warn(f"{error}; using auto", RuntimeWarning, stacklevel=3)
        os.environ[settings.BLAS.name] = "auto"  # this process's later reads, and its children's
    if "mlx.core" not in sys.modules:
        load()
        return
    chosen, running = choice(), in_use()
    if running == "bundled" and chosen != "bundled":
        preload = ":".join(str(library) for library in libraries_of(chosen))
        warnings.warn(
            f"MLX was imported before kernels (or deformable_detr), so its matrix products run on MLX's bundled "
            f"reference BLAS, 25-100x slower than {chosen}: import deformable_detr (or kernels) before mlx, "
            f"or start Python with LD_PRELOAD={preload}",
            RuntimeWarning,
            stacklevel=3,
        )
