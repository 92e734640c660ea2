"""The C++ extension of `kernels` (kernels/native/: MLX operations for the CPU attention kernel and
Hungarian matching, and on Linux the library that gives MLX OpenBLAS's products), built by the
install with CMake against the MLX of the build environment; beside it, where oneDNN's CMake package is
in the build environment (the `onednn-devel-cpu-gomp` wheel, x86-64 Linux), `kernels._onednn`
(kernels/onednn.py).

Optional: where it cannot be built (no C++ compiler or CMake), the install goes on and `kernels`
uses its MLX-ops path and scipy (`kernels.available_backends()` tells). Everything else is in
pyproject.toml, which pins the MLX version the extension is built for and runs with.

Reuse instead of a rebuild: an editable install (`pip install -e .`) copies the extension and its
companion library into the source tree (kernels/_native*.so, kernels/libopenblas_cblas.so) and writes
kernels/_native.stamp beside them (gitignored): everything the build read, as `_build_inputs` gathers it
(a SHA-256 of every file under kernels/native/ with its path, but for the loader
kernels/native/__init__.py, which CMake does not read, and of this file; the versions of MLX, its
library package and nanobind in the build environment; the Python version, its ABI and platform as the
extension suffix names them; the build type; the compiler's version line and the environment variables
CMake reads), and a SHA-256 of each file the build made. A later build whose inputs are the same, where
those files are still there with those digests, copies them to where setuptools expects the build output
instead of running CMake (about a minute less). This is safe: the digest covers every file the build
reads (contents, not modification times, so a `touch`, a checkout or a copy that keeps times neither
forces nor hides a change), and MLX's C++ ABI, nanobind's and Python's change only with their versions,
which the stamp holds. Anything else builds as before: a clean tree (a clone, `pip wheel .` there), a
changed source or setup.py, another MLX or nanobind, Python or compiler. To force a build, delete
kernels/_native.stamp.
"""

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

BUILD_TYPE = "Release"
ONEDNN_DEVEL = "onednn-devel-cpu-gomp"
# Environment variables CMake reads when it configures: they can change what it builds.
CMAKE_ENVIRONMENT = (
    "CXX",
    "CXXFLAGS",
    "CPPFLAGS",
    "LDFLAGS",
    "CMAKE_GENERATOR",
    "CMAKE_TOOLCHAIN_FILE",
    "CMAKE_OSX_ARCHITECTURES",
    "MACOSX_DEPLOYMENT_TARGET",
    "SDKROOT",
)


class CMakeExtension(Extension):
    """A module CMake builds from `source_dir`, and `companions`: plain shared libraries it builds beside
    the module, which go where the module goes (an editable install copies only the module itself)."""

    def __init__(self, name: str, source_dir: str, companions: tuple[str, ...] = ()):
        super().__init__(name, sources=[], optional=True)
        self.source_dir = str(Path(source_dir).resolve())
        self.companions = companions


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _onednn_cmake_dir() -> str | None:
    """The folder of dnnl-config.cmake of the build environment's onednn-devel-cpu-gomp wheel (its data
    files go to the environment's lib/cmake/dnnl, where CMake does not look by itself), or None."""
    try:
        distribution = metadata.distribution(ONEDNN_DEVEL)
    except metadata.PackageNotFoundError:
        return None
    for file in distribution.files or ():
        if file.name == "dnnl-config.cmake":
            return str(Path(distribution.locate_file(file)).resolve().parent)
    return None


def _compiler() -> str | None:
    """The first line of `--version` of the C++ compiler CMake would take (CXX, else c++)."""
    try:
        done = subprocess.run([os.environ.get("CXX") or "c++", "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.splitlines() or [""])[0] if done.returncode == 0 else None


def _build_inputs(ext: CMakeExtension) -> dict:
    """Everything a build of `ext` reads, as the stamp compares it (see the module's docstring)."""
    source_dir = Path(ext.source_dir)
    loader = source_dir / "__init__.py"  # Python that loads the extension: CMake does not read it
    sources = {
        path.relative_to(source_dir).as_posix(): _sha256(path)
        for path in sorted(source_dir.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc" and path != loader
    }
    return {
        "sources": sources,
        "setup.py": _sha256(Path(__file__).resolve()),
        "versions": {
            name: _version(name)
            for name in ("mlx", "mlx-cpu", "mlx-metal", "mlx-cuda", "nanobind", ONEDNN_DEVEL, "onednn-cpu-gomp")
        },
        "python": [sys.version, sys.implementation.cache_tag, sysconfig.get_config_var("EXT_SUFFIX")],
        "platform": [sys.platform, platform.machine(), sysconfig.get_platform()],
        "build_type": BUILD_TYPE,
        "compiler": _compiler(),
        "environment": {name: os.environ[name] for name in CMAKE_ENVIRONMENT if name in os.environ},
    }


class CMakeBuild(build_ext):
    def _source_package_dir(self, ext) -> Path:
        """The folder of the source tree that an editable install copies `ext` into."""
        package = ".".join(self.get_ext_fullname(ext.name).split(".")[:-1])
        return Path(self.get_finalized_command("build_py").get_package_dir(package)).resolve()

    def _stamp_path(self, ext) -> Path:
        return self._source_package_dir(ext) / (ext.name.split(".")[-1] + ".stamp")

    def _reusable(self, ext, inputs: dict) -> dict | None:
        """The files {name: digest} of a build with these inputs that sit in the source tree, or None."""
        try:
            stamp = json.loads(self._stamp_path(ext).read_text())
            outputs = stamp["outputs"]
            if stamp["inputs"] != inputs or Path(self.get_ext_filename(ext.name)).name not in outputs:
                return None
            folder = self._source_package_dir(ext)
            return outputs if all(_sha256(folder / name) == digest for name, digest in outputs.items()) else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def build_extension(self, ext):
        output_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        inputs = _build_inputs(ext)
        self._inputs = {**getattr(self, "_inputs", {}), ext.name: inputs}
        reusable = self._reusable(ext, inputs)
        if reusable is not None:
            output_dir.mkdir(parents=True, exist_ok=True)
            for name in reusable:
                shutil.copy2(self._source_package_dir(ext) / name, output_dir / name)
            print(f"{ext.name}: reusing the build in {self._source_package_dir(ext)} (its stamp matches)")
            return
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake",
            "-S",
            ext.source_dir,
            "-B",
            str(build_dir),
            f"-DCMAKE_BUILD_TYPE={BUILD_TYPE}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={output_dir}",
        ]
        if _onednn_cmake_dir() is not None:
            configure.append(f"-Ddnnl_DIR={_onednn_cmake_dir()}")
        build = ["cmake", "--build", str(build_dir), f"-j{os.cpu_count() or 1}"]
        try:
            subprocess.run(configure, check=True)
            subprocess.run(build, check=True)
        except (OSError, subprocess.CalledProcessError) as error:
            # No stamp for a failed build, and the last one's goes: CMake may have made some of the files
            # (the module, not a companion that failed to compile), and a stamp naming them would let the
            # next install reuse them beside the source tree's stale companion.
            self._failed = {*getattr(self, "_failed", set()), ext.name}
            self._stamp_path(ext).unlink(missing_ok=True)
            raise CompileError(f"{ext.name}: {error}") from error

    def copy_extensions_to_source(self):
        super().copy_extensions_to_source()  # here self.inplace is on: get_ext_fullpath is in the source tree
        for ext in self.extensions:
            built = Path(self.build_lib, self.get_ext_filename(ext.name)).parent
            module = Path(self.get_ext_filename(ext.name)).name
            if not (built / module).is_file() or ext.name in getattr(self, "_failed", ()):
                continue  # not built (optional): the source tree's files stay as they were, unstamped
            target = Path(self.get_ext_fullpath(ext.name)).parent
            for name in ext.companions:
                if (built / name).is_file():
                    self.copy_file(str(built / name), str(target / name))
            # The stamp, last: it names only files now in the source tree, with their digests.
            outputs = {name: _sha256(target / name) for name in (module, *ext.companions) if (built / name).is_file()}
            inputs = getattr(self, "_inputs", {}).get(ext.name) or _build_inputs(ext)
            self._stamp_path(ext).write_text(json.dumps({"inputs": inputs, "outputs": outputs}, indent=1) + "\n")


# libopenblas_cblas.so: OpenBLAS's matrix products under the names MLX calls (Linux; runtime.py);
# _onednn: convolutions and products on oneDNN (kernels/onednn.py), where its CMake package is found.
ONEDNN_MODULE = "_onednn" + sysconfig.get_config_var("EXT_SUFFIX")
native = CMakeExtension("kernels._native", "kernels/native", companions=("libopenblas_cblas.so", ONEDNN_MODULE))
setup(ext_modules=[native], cmdclass={"build_ext": CMakeBuild})
