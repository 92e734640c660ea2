"""The C++ extension of `kernels` (kernels/native/: MLX operations for the CPU attention kernel and
Hungarian matching, and on Linux the library that gives MLX OpenBLAS's products), built by the
install with CMake against the MLX of the build environment.

Optional: where it cannot be built (no C++ compiler or CMake), the install goes on and `kernels`
uses its MLX-ops path and scipy (`kernels.available_backends()` tells). Everything else is in
pyproject.toml, which pins the MLX version the extension is built for and runs with.
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError


class CMakeExtension(Extension):
    """A module CMake builds from `source_dir`, and `companions`: plain shared libraries it builds beside
    the module, which go where the module goes (an editable install copies only the module itself)."""

    def __init__(self, name: str, source_dir: str, companions: tuple[str, ...] = ()):
        super().__init__(name, sources=[], optional=True)
        self.source_dir = str(Path(source_dir).resolve())
        self.companions = companions


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        output_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake",
            "-S",
            ext.source_dir,
            "-B",
            str(build_dir),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={output_dir}",
        ]
        build = ["cmake", "--build", str(build_dir), f"-j{os.cpu_count() or 1}"]
        try:
            subprocess.run(configure, check=True)
            subprocess.run(build, check=True)
        except (OSError, subprocess.CalledProcessError) as error:
            raise CompileError(f"{ext.name}: {error}") from error

    def copy_extensions_to_source(self):
        super().copy_extensions_to_source()  # here self.inplace is on: get_ext_fullpath is in the source tree
        for ext in self.extensions:
            built = Path(self.build_lib, self.get_ext_filename(ext.name)).parent
            for name in ext.companions:
                if (built / name).is_file():
                    self.copy_file(str(built / name), str(Path(self.get_ext_fullpath(ext.name)).parent / name))


# libopenblas_cblas.so: OpenBLAS's matrix products under the names MLX calls (Linux; runtime.py).
native = CMakeExtension("kernels._native", "kernels/native", companions=("libopenblas_cblas.so",))
setup(ext_modules=[native], cmdclass={"build_ext": CMakeBuild})
