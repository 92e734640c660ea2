"""The run-time set-up: a command run as a program re-executes itself once with MKL preloaded and the
malloc thresholds set; imported, it does not; the tests' own process has MKL loaded for MLX."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deformable_detr import runtime

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or runtime.mkl_runtime() is None,
    reason="MKL is installed on Linux x86-64 only (pyproject.toml); elsewhere there is nothing to set up",
)

PROGRAM = """
import os
from deformable_detr.cli import entry_point

@entry_point
def main(argv=None):
    print(os.environ.get("LD_PRELOAD", ""), os.environ.get("MALLOC_MMAP_THRESHOLD_", ""), sep="|")

main()
"""


def test_a_command_run_as_a_program_sets_up_its_process_once():
    environment = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_MMAP_THRESHOLD_")}
    environment.pop("DEFORMABLE_DETR_MKL", None)
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=environment, check=True)
    assert done.stdout.splitlines() == [f"{runtime.mkl_runtime()}|{16 * 2**30}"]  # main ran once, set up

    switched_off = {**environment, "DEFORMABLE_DETR_MKL": "0"}
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=switched_off, check=True)
    assert done.stdout.splitlines() == ["|"]


def test_an_imported_command_leaves_the_process_as_it_is():
    from deformable_detr.cli import entry_point

    @entry_point
    def main(argv=None):
        return os.getpid()

    assert main([]) == os.getpid()  # not re-executed: pytest goes on


def test_the_tests_run_on_mkl():
    maps = Path("/proc/self/maps").read_text()
    assert "libmkl_rt" in maps
    with pytest.raises(RuntimeError, match="before the first import of mlx.core"):
        runtime.load_mkl()
