"""The C++ extension of `kernels` (kernels/native/: MLX operations for the CPU attention kernel and
Hungarian matching), built by the install with CMake against the MLX of the build environment.

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
    def __init__(self, name: str, source_dir: str):
        super().__init__(name, sources=[], optional=True)
        self.source_dir = str(Path(source_dir).resolve())


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


setup(ext_modules=[CMakeExtension("kernels._native", "kernels/native")], cmdclass={"build_ext": CMakeBuild})
