"""The process's set-up when the package is imported: in a fresh process, importing deformable_detr or
kernels before MLX gives MLX the chosen BLAS (kernels/blas.py), importing MLX first leaves it on its
bundled BLAS with one warning naming it and the fix; glibc keeps freed memory for reuse
(deformable_detr/runtime.py); and MLX's matrix products reach OpenBLAS through kernels'
libopenblas_cblas.so with every argument."""

import ctypes
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

from deformable_detr import runtime
from kernels import blas

import mlx.core as mx
import numpy as np
import pytest

linux = pytest.mark.skipif(sys.platform != "linux", reason="the set-up is Linux's: elsewhere MLX has its own BLAS")
openblas = pytest.mark.skipif(
    not blas.openblas_libraries(),
    reason="scipy-openblas32 or kernels' libopenblas_cblas.so is not installed (Linux x86-64 only, "
    "built with the C++ extension)",
)
ROOT = Path(__file__).resolve().parents[1]

# -> the BLAS MLX runs, the warnings, and the page faults of a second 64 MiB buffer (the first freed)
PROGRAM = """
import ctypes, resource, sys, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    {imports}
    import kernels, mlx.core as mx
    mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]

def touched(size=2**26):  # malloc'ed, written, freed (as MLX does an activation)
    buffer = libc.malloc(size); ctypes.memset(buffer, 1, size); libc.free(buffer)

touched()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touched()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
print(kernels.blas.in_use(), len(caught), faults, sep="|")
for warning in caught:
    print(warning.category.__name__, warning.message, sep=": ")
"""


def run_python(source: str, **settings) -> str:
    """`source` run by a fresh Python in the checkout, this process's environment without the variables
    the set-up reads (but `settings`) -> what it printed."""
    ours = ("LD_PRELOAD", blas.settings.BLAS.name, blas.settings.BLAS.old, *runtime.MALLOC, runtime.ARENA_VARIABLE)
    environment = {k: v for k, v in os.environ.items() if k not in ours}
    done = subprocess.run(
        [sys.executable, "-c", source],
        capture_output=True,
        text=True,
        env={**environment, "PYTHONPATH": str(ROOT), **settings},
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def run_program(imports: str, **settings) -> tuple[str, int, int, list[str]]:
    head, *told = run_python(PROGRAM.format(imports=imports), **settings).splitlines()
    in_use, count, faults = head.split("|")
    return in_use, int(count), int(faults), told


@linux
@pytest.mark.parametrize("first", ["import deformable_detr", "import kernels"])
@pytest.mark.parametrize("choice", ["openblas", "mkl", "bundled"])
def test_importing_the_project_first_gives_mlx_the_chosen_blas(first, choice):
    chosen = blas.choice({"KERNELS_BLAS": choice})  # bundled where that one is not installed
    in_use, count, _, told = run_program(first, KERNELS_BLAS=choice)
    assert (in_use, count) == (chosen, 0), told


@linux
def test_importing_mlx_first_warns_once_naming_the_blas_and_the_fix():
    chosen = blas.choice({})  # the programs run without KERNELS_BLAS
    if chosen == "bundled":
        pytest.skip("no faster BLAS is installed here: MLX's own is the choice, nothing to warn about")
    in_use, count, _, told = run_program("import mlx.core\n    import deformable_detr")
    assert (in_use, count) == ("bundled", 1)
    assert told[0].startswith("RuntimeWarning: MLX was imported before kernels (or deformable_detr)")
    assert f"bundled reference BLAS, 25-100x slower than {chosen}" in told[0]
    preload = ":".join(str(library) for library in blas.libraries_of(chosen))
    assert told[0].endswith(
        f"import deformable_detr (or kernels) before mlx, or start Python with LD_PRELOAD={preload}"
    )

    # the fix it names works, and then nothing is said
    in_use, count, _, told = run_program("import mlx.core\n    import deformable_detr", LD_PRELOAD=preload)
    assert (in_use, count) == (chosen, 0), told


@linux
def test_glibc_keeps_freed_memory_once_the_package_is_imported():
    """A 64 MiB buffer freed and made again: glibc maps a buffer that large anew each time (a page fault
    per 4 KiB page: 16,384) unless told to keep freed memory in its heap, as importing the package does."""
    _, _, plain, _ = run_program("import mlx.core")
    _, _, kept, _ = run_program("import deformable_detr")
    assert plain >= 16_000
    assert kept < 1_000
    _, _, users, _ = run_program("import deformable_detr", MALLOC_MMAP_THRESHOLD_="1048576")
    assert users >= 16_000  # a user's own setting stays theirs


# -> how many heaps (arenas) glibc's malloc has after `threads` threads allocated at once
ARENAS_PROGRAM = """
import ctypes, tempfile, threading
{imports}
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]

def churn():  # ctypes lets the GIL go: the threads meet in malloc (long enough to meet on a loaded machine:
    for _ in range(20000):  # with 2,000 a CI run beside another test process saw 2 heaps, not more)
        libc.free(libc.malloc(4096))

threads = [threading.Thread(target=churn) for _ in range({threads})]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes, libc.fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
with tempfile.NamedTemporaryFile("r") as report:
    stream = libc.fopen(report.name.encode(), b"w")
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    print(report.read().count("<heap nr="))
"""


def arenas(imports: str, **settings) -> int:
    return int(run_python(ARENAS_PROGRAM.format(imports=imports, threads=2 * runtime.ARENAS + 2), **settings))


@linux
def test_freed_memory_is_kept_in_at_most_one_heap_a_core():
    """Each heap keeps its own freed memory, and glibc makes up to 8 a core (hundreds on a many-core
    server; runtime.py). After the package's import, twice as many threads at once as runtime.ARENAS (one
    a core, at least 2) share that many."""
    assert arenas("import mlx.core") > runtime.ARENAS  # glibc's own limit: 8 a core
    assert arenas("import deformable_detr") == runtime.ARENAS
    assert arenas("import deformable_detr", MALLOC_ARENA_MAX="1") == 1  # a user's own setting stays theirs


def test_auto_is_mkl_on_intel_and_openblas_elsewhere(monkeypatch):
    for vendor, want in [
        ("GenuineIntel", ["mkl", "openblas"]),
        ("AuthenticAMD", ["openblas", "mkl"]),
        ("", ["openblas", "mkl"]),
    ]:
        monkeypatch.setattr(blas, "cpu_vendor", lambda vendor=vendor: vendor)
        assert blas.preference({}) == want
        assert blas.preference({"KERNELS_BLAS": "auto"}) == want
        assert blas.preference({"KERNELS_BLAS": "mkl"}) == ["mkl"]
        assert blas.preference({"KERNELS_BLAS": "bundled"}) == []


@linux
def test_auto_takes_the_other_blas_where_the_first_is_missing(monkeypatch):
    monkeypatch.setattr(blas, "cpu_vendor", lambda: "GenuineIntel")
    monkeypatch.setattr(blas, "mkl_libraries", list)  # MKL is an extra: where it is not installed
    assert blas.choice({}) == ("openblas" if blas.openblas_libraries() else "bundled")
    assert blas.choice({"KERNELS_BLAS": "mkl"}) == "bundled"  # asked for, not here


@linux
def test_a_wrong_choice_is_one_warning_and_auto():
    in_use, count, _, told = run_program("import deformable_detr", KERNELS_BLAS="atlas")
    assert (in_use, count) == (blas.choice({}), 1)
    assert told == ["RuntimeWarning: KERNELS_BLAS='atlas': expected one of auto, openblas, mkl, bundled; using auto"]


@linux
def test_the_tests_run_on_the_chosen_blas():
    libraries = blas.libraries_of(blas.choice())
    if not libraries:
        pytest.skip(f"{blas.choice()} is not installed here: the tests run on MLX's bundled BLAS")
    maps = Path("/proc/self/maps").read_text()
    assert all(str(library.resolve()) in maps for library in libraries)
    assert blas.in_use() == blas.choice()
    with pytest.raises(RuntimeError, match="before the first import of mlx.core"):
        blas.load()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        blas.set_up()  # MLX is loaded, on the chosen BLAS: nothing to say


@openblas
def test_mlx_products_go_through_the_preloaded_library(tmp_path):
    """OpenBLAS replaced by a stand-in whose sgemm writes 42 everywhere: MLX's matmul then gives 42s,
    so its products do reach the library that kernels/blas.py loads."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in OpenBLAS")
    source = tmp_path / "stand_in.c"
    source.write_text(
        "void scipy_cblas_sgemm(int o, int ta, int tb, int m, int n, int k, float alpha, const float* a,"
        " int lda, const float* b, int ldb, float beta, float* c, int ldc) {"
        " for (int i = 0; i < m; ++i) for (int j = 0; j < n; ++j) c[i * ldc + j] = 42.0f; }\n"
    )
    stand_in = tmp_path / "libstand_in.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(stand_in), str(source)], check=True)
    shim = blas.openblas_libraries()[1]
    environment = {**os.environ, "LD_PRELOAD": f"{stand_in}:{shim}"}
    program = "import mlx.core as mx; print(float((mx.ones((3, 4)) @ mx.ones((4, 5))).sum()))"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=environment)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) == 42.0 * 15


@openblas
def test_the_shim_is_what_mlx_binds_to():
    if blas.in_use() != "openblas":
        pytest.skip(f"the tests run on {blas.in_use()} here: the shim is OpenBLAS's")
    shim = ctypes.CDLL(str(blas.openblas_libraries()[1]))
    address = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
    assert address == ctypes.cast(shim.cblas_sgemm, ctypes.c_void_p).value


@pytest.mark.parametrize("dtype", [mx.float32, mx.float64, mx.complex64])
def test_matrix_products_with_every_layout_and_scale(dtype):
    """Transposed and sliced operands (a transpose flag or a leading dimension other than the width to
    the BLAS), batches, and addmm's alpha and beta, against numpy in float64."""
    if dtype == mx.float64 and mx.default_device() != mx.cpu:
        pytest.skip("float64 is on MLX's CPU only")
    rng = np.random.default_rng(0)
    kind = np.complex128 if dtype == mx.complex64 else np.float64

    def draw(*shape):
        x = rng.standard_normal(shape)
        return (x + 1j * rng.standard_normal(shape) if kind == np.complex128 else x).astype(kind)

    a, b, c = draw(2, 37, 70), draw(2, 70, 23), draw(2, 37, 23)
    a_t, b_t = np.ascontiguousarray(a.transpose(0, 2, 1)), np.ascontiguousarray(b.transpose(0, 2, 1))
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype != mx.float64 else dict(rtol=1e-12, atol=1e-12)
    as_mx = lambda x: mx.array(x, dtype=dtype)  # noqa: E731
    cases = {
        "plain": (as_mx(a) @ as_mx(b), a @ b),
        "a transposed": (as_mx(a_t).transpose(0, 2, 1) @ as_mx(b), a @ b),
        "b transposed": (as_mx(a) @ as_mx(b_t).transpose(0, 2, 1), a @ b),
        "sliced": (as_mx(a)[:, 3:30, 5:60] @ as_mx(b)[:, 5:60, 2:21], a[:, 3:30, 5:60] @ b[:, 5:60, 2:21]),
    }
    for name, (got, want) in cases.items():
        np.testing.assert_allclose(np.array(got), want, **tolerance, err_msg=name)
    if dtype != mx.complex64:  # addmm is real here
        got = mx.addmm(as_mx(c), as_mx(a), as_mx(b), alpha=0.5, beta=2.0)
        np.testing.assert_allclose(np.array(got), 2.0 * c + 0.5 * (a @ b), **tolerance, err_msg="addmm")


@openblas
def test_the_description_names_the_kernels_openblas_runs():
    if blas.in_use() != "openblas":
        pytest.skip(f"the tests run on {blas.in_use()} here")
    description = blas.description()
    assert description.startswith("openblas (") and description.endswith(" kernels)")
    told = os.environ.get("OPENBLAS_CORETYPE")  # some machines set it; OpenBLAS then runs those kernels
    if told:
        assert description.lower() == f"openblas ({told.lower()} kernels)"
