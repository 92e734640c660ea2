"""The run-time set-up: a command run as a program re-executes itself once with the BLAS preloaded and
the malloc thresholds set; imported, it does not; the tests' own process has the BLAS loaded for MLX,
and MLX's matrix products reach OpenBLAS through kernels' libopenblas_cblas.so with every argument."""

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from deformable_detr import runtime

linux = pytest.mark.skipif(sys.platform != "linux", reason="the set-up is Linux's: elsewhere MLX has its own BLAS")
openblas = pytest.mark.skipif(
    not runtime.openblas_libraries(),
    reason="scipy-openblas32 or kernels' libopenblas_cblas.so is not installed (Linux x86-64 only, "
    "built with the C++ extension)",
)

PROGRAM = """
import os
from deformable_detr.cli import entry_point

@entry_point
def main(argv=None):
    names = ("LD_PRELOAD", "MALLOC_MMAP_THRESHOLD_", "OPENBLAS_THREAD_TIMEOUT")
    print(*(os.environ.get(name, "") for name in names), sep="|")

main()
"""


def run_program(**settings):
    environment = {
        k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_THREAD_TIMEOUT", *runtime.MALLOC)
    }
    environment.pop("DEFORMABLE_DETR_BLAS", None)
    return subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, env={**environment, **settings}
    )


@linux
@pytest.mark.parametrize("choice", ["openblas", "mkl", "bundled"])
def test_a_command_run_as_a_program_sets_up_its_process_once(choice):
    done = run_program(DEFORMABLE_DETR_BLAS=choice)
    assert done.returncode == 0, done.stderr
    chosen = {"DEFORMABLE_DETR_BLAS": choice}
    want = ":".join(str(library) for library in runtime.blas_libraries(chosen))
    timeout = "4" if runtime.blas_choice(chosen) == "openblas" else ""  # OpenBLAS's idle threads sleep soon
    assert done.stdout.splitlines() == [f"{want}|{16 * 2**30}|{timeout}"]  # main ran once, set up


def test_auto_is_mkl_on_intel_and_openblas_elsewhere(monkeypatch):
    for vendor, want in [
        ("GenuineIntel", ["mkl", "openblas"]),
        ("AuthenticAMD", ["openblas", "mkl"]),
        ("", ["openblas", "mkl"]),
    ]:
        monkeypatch.setattr(runtime, "cpu_vendor", lambda vendor=vendor: vendor)
        assert runtime.blas_preference({}) == want
        assert runtime.blas_preference({"DEFORMABLE_DETR_BLAS": "auto"}) == want
        assert runtime.blas_preference({"DEFORMABLE_DETR_BLAS": "mkl"}) == ["mkl"]
        assert runtime.blas_preference({"DEFORMABLE_DETR_BLAS": "bundled"}) == []


@linux
def test_auto_takes_the_other_blas_where_the_first_is_missing(monkeypatch):
    monkeypatch.setattr(runtime, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(runtime, "openblas_libraries", list)
    assert runtime.blas_choice({}) == ("mkl" if runtime.mkl_libraries() else "bundled")
    assert runtime.blas_choice({"DEFORMABLE_DETR_BLAS": "openblas"}) == "bundled"  # asked for, not here


@linux
def test_a_wrong_choice_is_one_line():
    done = run_program(DEFORMABLE_DETR_BLAS="atlas")
    assert done.returncode == 1
    assert done.stderr.strip() == "error: DEFORMABLE_DETR_BLAS='atlas': expected one of auto, openblas, mkl, bundled"


def test_an_imported_command_leaves_the_process_as_it_is():
    from deformable_detr.cli import entry_point

    @entry_point
    def main(argv=None):
        return os.getpid()

    assert main([]) == os.getpid()  # not re-executed: pytest goes on


@linux
def test_the_tests_run_on_the_chosen_blas():
    libraries = runtime.blas_libraries()
    if not libraries:
        pytest.skip(f"{runtime.blas_choice()} is not installed here: the tests run on MLX's bundled BLAS")
    maps = Path("/proc/self/maps").read_text()
    assert all(str(library.resolve()) in maps for library in libraries)
    assert runtime.blas_in_use() == runtime.blas_choice()
    with pytest.raises(RuntimeError, match="before the first import of mlx.core"):
        runtime.load_blas()


@openblas
def test_mlx_products_go_through_the_preloaded_library(tmp_path):
    """OpenBLAS replaced by a stand-in whose sgemm writes 42 everywhere: MLX's matmul then gives 42s,
    so its products do reach the library that runtime.py preloads."""
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
    shim = runtime.openblas_libraries()[1]
    environment = {**os.environ, "LD_PRELOAD": f"{stand_in}:{shim}"}
    program = "import mlx.core as mx; print(float((mx.ones((3, 4)) @ mx.ones((4, 5))).sum()))"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=environment)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) == 42.0 * 15


@openblas
def test_the_shim_is_what_mlx_binds_to():
    shim = ctypes.CDLL(str(runtime.openblas_libraries()[1]))
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
    if runtime.blas_in_use() != "openblas":
        pytest.skip(f"the tests run on {runtime.blas_in_use()} here")
    description = runtime.blas_description()
    assert description.startswith("openblas (") and description.endswith(" kernels)")
    told = os.environ.get("OPENBLAS_CORETYPE")  # some machines set it; OpenBLAS then runs those kernels
    if told:
        assert description.lower() == f"openblas ({told.lower()} kernels)"
