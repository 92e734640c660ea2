"""NVIDIA's own compilers on the fused CUDA kernels, on a machine without a GPU.

MLX compiles a `mx.fast.cuda_kernel` with NVRTC (mlx/backend/cuda/jit_module.cpp): one program per
kernel, its device headers handed to NVRTC from memory, CCCL and the CUDA headers from the
`mlx-cuda-13` and `nvidia-*` wheels, `--device-as-default-execution-space`, and the device's
architecture. This module does the same without a device, for chosen architectures, stopping at
PTX, and runs `ptxas` on the PTX for its resource report:

- `Toolkit`: NVRTC (ctypes on `libnvrtc.so.13`), `ptxas` and the CUDA headers, from the pip wheels
  of the dev extra (`nvidia-cuda-nvrtc`, `nvidia-cuda-nvcc`, `nvidia-cuda-runtime`);
- `MlxCuda`: the headers MLX's CUDA back-end compiles custom kernels with, from the `mlx-cuda-13`
  wheel of the installed MLX version (downloaded, never installed: it replaces MLX's CPU library);
- `kernel_instances()`: every kernel instance the dispatch launches, recorded by driving the public
  ops through every choice they offer with a stand-in kernel constructor (as `gpu_emulator` does),
  each with the source MLX assembles for it (`gpu_emulator.assemble_cuda`).
"""

import ctypes
import dataclasses
import importlib
import importlib.util
import itertools
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import kernels
import kernels.cuda
from kernels import backends

import mlx.core as mx
from gpu_emulator import assemble_cuda

CUDA_MAJOR = 13  # site-packages/nvidia/cu13 and mlx-cuda-13, the toolkit MLX's Linux wheels pair with
# Where MLX's CUDA back-end starts the text of every custom kernel (custom_kernel.cpp, build_kernel).
KERNEL_START = "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
# The options of MLX's NVRTC call besides the architecture and include paths (jit_module.cpp).
MLX_NVRTC_OPTIONS = ["--device-as-default-execution-space"]
# MLX's device headers are embedded in libmlx.so by bin2h.cmake as NUL-terminated strings, the
# wheel ships only config.h as a file; each one the kernels include is told apart by a definition
# only it has.
EMBEDDED = {
    "mlx/backend/cuda/device/utils.cuh": b"using Shape = cuda::std::array<int32_t, MAX_NDIM>;",
    "mlx/backend/cuda/device/complex.cuh": b"using complex_t = cuda::std::complex<T>;",
    "mlx/backend/cuda/device/config.h": b"#define MAX_NDIM ",
}
REGISTERS_PER_BLOCK = 65536  # sm_80 and sm_90
REGISTER_UNIT = 256  # registers are given to a warp in units of 256 (sm_80 and sm_90)


class NvrtcError(Exception):
    pass


@dataclass(frozen=True)
class Toolkit:
    nvrtc: ctypes.CDLL
    ptxas: Path
    include: Path  # nvidia/cu13/include: cuda_fp16.h, cuda_bf16.h, cooperative_groups.h

    @property
    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        return major.value, minor.value


def find_toolkit() -> Toolkit | str:
    """NVRTC, ptxas and the CUDA headers from the nvidia-* wheels, or why they cannot be used."""
    install = (
        f"needs NVIDIA's runtime compiler, ptxas and CUDA headers for CUDA {CUDA_MAJOR} from PyPI "
        "(nvidia-cuda-nvrtc, nvidia-cuda-nvcc, nvidia-cuda-runtime; Linux wheels): "
        "pip install -e '.[dev]' installs the pinned versions"
    )
    if not sys.platform.startswith("linux"):
        return f"{install}; this is {sys.platform}"
    spec = importlib.util.find_spec("nvidia")
    roots = [Path(p) / f"cu{CUDA_MAJOR}" for p in (spec.submodule_search_locations if spec else [])]
    found = {}
    for what, relative in [
        ("nvidia-cuda-nvrtc", f"lib/libnvrtc.so.{CUDA_MAJOR}"),
        ("nvidia-cuda-nvcc", "bin/ptxas"),
        ("nvidia-cuda-runtime", "include/cuda_fp16.h"),
    ]:
        path = next((root / relative for root in roots if (root / relative).exists()), None)
        if path is None:
            return f"{install}; {what} is missing (no nvidia/cu{CUDA_MAJOR}/{relative})"
        found[what] = path
    library = found["nvidia-cuda-nvrtc"]
    # libnvrtc opens its builtins by soname; loaded first, that finds them outside the loader's path.
    ctypes.CDLL(str(library.parent / f"libnvrtc-builtins.so.{CUDA_MAJOR}.0"), mode=ctypes.RTLD_GLOBAL)
    nvrtc = ctypes.CDLL(str(library))
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    return Toolkit(nvrtc, found["nvidia-cuda-nvcc"], found["nvidia-cuda-runtime"].parent)


@dataclass(frozen=True)
class MlxCuda:
    version: str
    include: Path  # the wheel's mlx/include: MLX's bundled CCCL under cccl/, CUTLASS, MLX's C++ headers
    headers: dict[str, bytes]  # MLX's device headers by include name, as MLX hands them to NVRTC
    library: bytes  # libmlx.so


def fetch_mlx_cuda(directory: Path) -> MlxCuda | str:
    """The `mlx-cuda-13` wheel of the installed MLX version, downloaded into `directory` (not
    installed), its include tree extracted; or why not."""
    requirement = f"mlx-cuda-{CUDA_MAJOR}=={mx.__version__}"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(directory)]
    command += ["--timeout", "60", "--retries", "2"]  # offline: a skip within minutes, not pip's default wait
    try:
        result = subprocess.run([*command, requirement], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return f"needs the {requirement} wheel for MLX's CUDA headers, and `pip download` took over 10 minutes"
    wheels = list(directory.glob("mlx_cuda_*.whl"))
    if result.returncode or len(wheels) != 1:
        last = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:] or ["no output"]
        return f"needs the {requirement} wheel for MLX's CUDA headers; `pip download` failed (offline?): {last[0]}"
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extractall(directory, [n for n in wheel.namelist() if n.startswith("mlx/include/")])
        library = wheel.read("mlx/lib/libmlx.so")
    return MlxCuda(mx.__version__, directory / "mlx/include", embedded_headers(library), library)


def embedded_headers(library: bytes) -> dict[str, bytes]:
    """MLX's device headers as embedded in libmlx.so (bin2h.cmake writes "©" as two spaces)."""
    blobs = []
    for match in re.finditer(rb"\0// Copyright  +20\d\d Apple Inc\.", library):
        start = match.start() + 1
        blobs.append(library[start : library.index(b"\0", start)])
    headers = {}
    for name, marker in EMBEDDED.items():
        matches = [blob for blob in blobs if marker in blob]
        assert len(matches) == 1, f"{len(matches)} strings of libmlx.so look like {name} (by {marker!r})"
        headers[name] = matches[0]
    return headers


@dataclass(frozen=True)
class Instance:
    """One kernel as the dispatch launches it."""

    kernel: str  # the .body, e.g. "ms_deform_attn_forward"
    template: tuple
    source: str  # the full CUDA source as MLX assembles it
    block: int  # the launch's threadgroup: MLX launches min(threadgroup, grid) threads per block

    @property
    def function(self) -> str:
        return re.search(r"__global__ void (\w+)\(", self.source).group(1)

    @property
    def name(self) -> str:  # as MLX names it to NVRTC (custom_kernel.cpp)
        return f"mlx::core::cu::{self.function}"


def float_dtypes():
    """Every floating-point dtype of MLX; the dispatch decides which reach a kernel."""
    return [d for d in vars(mx).values() if isinstance(d, mx.Dtype) and mx.issubdtype(d, mx.floating)]


def kernel_instances() -> list[Instance]:
    """Every kernel instance the dispatch can launch on CUDA: both ops, forward and backward, called
    through `backend=None` with every float dtype, mode, padding, align_corners and layout they
    accept, their kernel construction and launches recorded instead of run."""
    instances = {}

    class Recorder:
        def __init__(self, *, name, input_names, output_names, source, header, atomic_outputs):
            self.spec = dict(
                name=name, input_names=input_names, output_names=output_names, source=source, header=header
            )

        def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value=None):
            source = assemble_cuda(**self.spec, inputs=inputs, template=template, output_dtypes=output_dtypes)
            instances[source] = Instance(self.spec["name"], tuple(template), source, threadgroup[0])
            return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes, strict=True)]

    recording = dataclasses.replace(kernels.cuda.CUDA, make_kernel=Recorder, missing=lambda: None)
    attention = importlib.import_module("kernels.ms_deform_attn")
    sampling = importlib.import_module("kernels.grid_sample")
    saved, checking = backends.FUSED, os.environ.get("KERNELS_SELF_CHECK")
    backends.FUSED = {"cuda": recording}
    os.environ["KERNELS_SELF_CHECK"] = "0"  # the recorder returns zeros: it is no kernel to check
    try:
        shapes = ((3, 4), (2, 2))
        for dtype, align, padding, value_layout, locations_layout in itertools.product(
            float_dtypes(), (False, True), attention.PADDING_MODES, attention.VALUE_LAYOUTS, attention.LOCATION_LAYOUTS
        ):
            value = mx.zeros((1, 16, 2, 4) if value_layout == "BLNC" else (1, 2, 16, 4), dtype)
            locations = mx.zeros((1, 3, 2, 2, 1, 2) if locations_layout == "BQHLP2" else (1, 2, 3, 2, 2, 1), dtype)
            weights = mx.zeros((1, 3, 2, 2, 1), dtype)

            def attend(v, loc, w, align=align, padding=padding, vl=value_layout, ll=locations_layout):
                return kernels.ms_deform_attn(
                    v, shapes, None, loc, w, value_layout=vl, sampling_locations_layout=ll,
                    align_corners=align, padding_mode=padding,
                )  # fmt: skip

            mx.vjp(attend, [value, locations, weights], [mx.zeros((1, 3, 8), dtype)])
        for dtype, mode, align, padding in itertools.product(
            float_dtypes(), sampling.MODES, (False, True), sampling.PADDING_MODES
        ):
            image, grid = mx.zeros((1, 4, 4, 3), dtype), mx.zeros((1, 2, 2, 2), dtype)

            def sample(x, g, mode=mode, padding=padding, align=align):
                return kernels.grid_sample(x, g, mode, padding, align)

            mx.vjp(sample, [image, grid], [mx.zeros((1, 2, 2, 3), dtype)])
    finally:
        backends.FUSED = saved
        if checking is None:
            os.environ.pop("KERNELS_SELF_CHECK")
        else:
            os.environ["KERNELS_SELF_CHECK"] = checking
    return list(instances.values())


@dataclass
class Compiled:
    ptx: str
    log: str
    lowered: dict[str, str]  # kernel name -> mangled entry name


def nvrtc_compile(toolkit: Toolkit, mlx_cuda: MlxCuda, source: str, names, arch: str, program="kernel.cu"):
    """NVRTC as MLX calls it (jit_module.cpp: in-memory device headers, include paths, options,
    name expressions), to PTX for `compute_<arch>`. Raises NvrtcError with NVRTC's log."""
    nvrtc = toolkit.nvrtc
    include_names = list(mlx_cuda.headers)
    headers = (ctypes.c_char_p * len(include_names))(*[mlx_cuda.headers[n] for n in include_names])
    names_array = (ctypes.c_char_p * len(include_names))(*[n.encode() for n in include_names])
    options = [
        *MLX_NVRTC_OPTIONS,
        f"--gpu-architecture=compute_{arch}",
        f"--include-path={mlx_cuda.include}",
        f"--include-path={mlx_cuda.include / 'cccl'}",
        f"--include-path={toolkit.include}",
    ]
    program_handle = ctypes.c_void_p()

    def check(result):
        if result:
            raise NvrtcError(nvrtc.nvrtcGetErrorString(result).decode())

    check(
        nvrtc.nvrtcCreateProgram(
            ctypes.byref(program_handle), source.encode(), program.encode(), len(include_names), headers, names_array
        )
    )
    try:
        for name in names:
            check(nvrtc.nvrtcAddNameExpression(program_handle, name.encode()))
        encoded = [o.encode() for o in options]
        result = nvrtc.nvrtcCompileProgram(program_handle, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded))
        size = ctypes.c_size_t()
        check(nvrtc.nvrtcGetProgramLogSize(program_handle, ctypes.byref(size)))
        log = ctypes.create_string_buffer(size.value)
        check(nvrtc.nvrtcGetProgramLog(program_handle, log))
        if result:
            raise NvrtcError(f"{nvrtc.nvrtcGetErrorString(result).decode()}\n{log.value.decode()}")
        check(nvrtc.nvrtcGetPTXSize(program_handle, ctypes.byref(size)))
        ptx = ctypes.create_string_buffer(size.value)
        check(nvrtc.nvrtcGetPTX(program_handle, ptx))
        lowered = {}
        for name in names:
            mangled = ctypes.c_char_p()
            check(nvrtc.nvrtcGetLoweredName(program_handle, name.encode(), ctypes.byref(mangled)))
            lowered[name] = mangled.value.decode()
        return Compiled(ptx.value.decode(), log.value.decode(), lowered)
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program_handle))


def one_program(instances: list[Instance]) -> str:
    """Every instance in one translation unit. MLX's text of each is the same prefix (its includes,
    the prologue, sampling.h) and then the kernel in its own namespace block, each kernel with its
    own name: the prefix once and every kernel after it holds each instance's exact text, and
    compiles once instead of once per instance."""
    prefixes = {i.source[: i.source.index(KERNEL_START)] for i in instances}
    assert len(prefixes) == 1, "the instances' sources differ before their kernels"
    (prefix,) = prefixes
    return prefix + "".join(i.source[len(prefix) :] for i in instances)


def block_registers(registers: int, threads: int) -> int:
    """The registers a block of `threads` takes, as the GPU allocates them."""
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    return -(-threads // 32) * per_warp


@dataclass(frozen=True)
class Resources:
    registers: int
    stack: int  # bytes of local memory per thread (an array indexed at run time, or spills)
    spill_stores: int
    spill_loads: int


def ptxas(toolkit: Toolkit, ptx: str, arch: str, directory: Path) -> tuple[dict[str, Resources], str]:
    """ptxas -v for sm_<arch>: the resources of each entry function (by mangled name) and its output."""
    source = directory / f"kernels_{arch}.ptx"
    source.write_text(ptx)
    command = [str(toolkit.ptxas), "-v", f"-arch=sm_{arch}", str(source), "-o", str(source.with_suffix(".cubin"))]
    result = subprocess.run(command, capture_output=True, text=True)
    output = result.stdout + result.stderr
    if result.returncode:
        raise RuntimeError(f"ptxas failed for sm_{arch}:\n{output[-4000:]}")
    report, function, numbers = {}, None, {}
    for line in output.splitlines():
        if entry := re.search(r"Compiling entry function '(\w+)'", line):
            function, numbers = entry.group(1), {}
        elif frame := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            numbers.update(zip(("stack", "spill_stores", "spill_loads"), map(int, frame.groups()), strict=True))
        elif used := re.search(r"Used (\d+) registers", line):
            report[function] = Resources(registers=int(used.group(1)), **numbers)
    return report, output
