"""Run the fused Metal and CUDA kernels on the CPU, from the exact source MLX would compile.

`emulated(backend)` returns a copy of `kernels.metal.METAL` or `kernels.cuda.CUDA` whose kernel
constructor yields CPU stand-ins for MLX's kernel objects. When called, a stand-in:
1. gets the kernel's full source as MLX assembles it: for Metal, from MLX itself (MLX records a
   Metal kernel's generated source when exporting a function, also on machines without Metal);
   for CUDA, by `assemble_cuda`, a transcription of MLX's `build_kernel`
   (mlx/backend/cuda/custom_kernel.cpp), since MLX cannot assemble CUDA kernels without CUDA;
2. compiles it as C++ after `gpu_shim/metal.h` or `gpu_shim/cuda.h`, which map the built-ins
   (thread position, atomics, SIMD-group / warp reductions, vector and half types) to plain C++;
3. runs every thread of the launch grid (`gpu_shim/runtime.h`: warps as cooperative fibers) and
   returns the outputs as MLX arrays. Outputs without an init value start as NaN, so an element the
   kernel never writes shows.
"""

import atexit
import ctypes
import dataclasses
import hashlib
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import kernels.cuda
import kernels.metal

import mlx.core as mx
import numpy as np

SHIM = Path(__file__).parent / "gpu_shim"
BUILD = Path(tempfile.mkdtemp(prefix="gpu_shim_"))
atexit.register(shutil.rmtree, BUILD, ignore_errors=True)
MAX_NDIM = 10  # MLX's CUDA Shape / Strides length

CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.int32: "int32_t"}
NUMPY = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16, mx.int32: np.int32}
METAL_ATTRIBUTES = {
    "thread_position_in_grid": "uint3{uint(shim_thread), 0, 0}",
    "thread_position_in_threadgroup": "uint3{uint(shim_thread % shim::current.group), 0, 0}",
    "threadgroup_position_in_grid": "uint3{uint(shim_thread / shim::current.group), 0, 0}",
    "thread_index_in_simdgroup": "uint(shim_thread % shim::current.group % 32)",
    "threads_per_simdgroup": "uint(32)",
}


def emulated(backend):
    """`backend` with its kernels run on the CPU, and runnable here."""
    maker = _MetalKernel if backend.name == "metal" else _CudaKernel
    return dataclasses.replace(backend, make_kernel=maker, missing=lambda: None)


class _Kernel:
    def __init__(self, *, name, input_names, output_names, source, header, atomic_outputs):
        self.spec = dict(name=name, input_names=input_names, output_names=output_names, source=source, header=header)
        self.atomic_outputs = atomic_outputs

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value=None):
        assemble = dict(inputs=inputs, template=template, grid=grid, threadgroup=threadgroup)
        source, grid, threadgroup = self.assemble(**assemble, output_shapes=output_shapes, output_dtypes=output_dtypes)
        assert grid[1:] == (1, 1) and threadgroup[1:] == (1, 1), "the shim runs 1-D launches"
        library = _compile(self.shim, source, self.launcher(source))
        slots, keep = [], []
        for array, name in zip(inputs, self.spec["input_names"], strict=True):
            host = np.ascontiguousarray(np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array))
            keep.append(host)
            slots.append(host.ctypes.data)
            for values in self.shape_slots(name, array):
                keep.append(values)
                slots.append(values.ctypes.data)
        outputs = []
        for shape, dtype in zip(output_shapes, output_dtypes, strict=True):
            if init_value is not None:
                host = np.full(shape, init_value, dtype=NUMPY[dtype])
            else:  # NaN, so that elements the kernel never writes show
                host = np.full(shape, 0x7FC0 if dtype == mx.bfloat16 else np.nan, dtype=NUMPY[dtype])
            outputs.append(host)
            slots.append(host.ctypes.data)
        threads = self.threads(grid[0], threadgroup[0])
        pointers = (ctypes.c_void_p * len(slots))(*slots)
        if library.shim_launch(pointers, ctypes.c_long(threads), ctypes.c_long(min(threadgroup[0], grid[0]))):
            raise RuntimeError(f"{self.spec['name']}: {library.shim_error().decode()}")
        return [
            mx.array(o).view(mx.bfloat16) if d == mx.bfloat16 else mx.array(o)
            for o, d in zip(outputs, output_dtypes, strict=True)
        ]


class _MetalKernel(_Kernel):
    shim = "metal.h"

    def assemble(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        """MLX's own assembly: export a call of the real `mx.fast.metal_kernel` and read the
        generated source, grid and threadgroup back from the exported CustomKernel."""
        real = mx.fast.metal_kernel(**self.spec, atomic_outputs=self.atomic_outputs)

        def call(*arrays):
            return real(
                inputs=list(arrays),
                template=template,
                grid=grid,
                threadgroup=threadgroup,
                output_shapes=output_shapes,
                output_dtypes=output_dtypes,
                init_value=0 if self.atomic_outputs else None,
            )

        path = BUILD / "export.mlxfn"
        mx.export_function(str(path), call, *[mx.zeros(a.shape, a.dtype) for a in inputs])
        data = path.read_bytes()
        at = data.index(b"CustomKernel") + len(b"CustomKernel")
        name, at = _string(data, at)
        source, at = _string(data, at)
        exported = struct.unpack_from("<6i", data, at)
        assert name.startswith("custom_kernel_") and "[[kernel]]" in source, "unexpected export format"
        assert exported == (*grid, *threadgroup), (exported, grid, threadgroup)
        return source, tuple(grid), tuple(threadgroup)

    def shape_slots(self, name, array):
        for suffix, dtype in (("_shape", np.int32), ("_strides", np.int64)):
            if f"{name}{suffix}" in self.spec["source"] and array.ndim > 0:
                values = array.shape if suffix == "_shape" else _row_strides(array.shape)
                yield np.array(values, dtype=dtype)
        if f"{name}_ndim" in self.spec["source"] and array.ndim > 0:
            yield np.array([array.ndim], dtype=np.int32)

    def launcher(self, source):
        name = re.search(r"\[\[kernel\]\] void (\w+)\(", source).group(1)
        instance = re.search(r"decltype\((\w+<[^;]*?>)\)", source)
        function = instance.group(1) if instance else name
        parameters = re.search(r"\[\[kernel\]\] void \w+\(\n(.*?)\) \{\n", source, re.S).group(1).split(",\n")
        arguments, slot = [], 0
        for parameter in parameters:
            declaration = re.sub(r"\s*\[\[[^\]]*\]\]\s*$", "", parameter).strip()
            kind, parameter_name = declaration.rsplit(" ", 1)
            if parameter_name in METAL_ATTRIBUTES:
                arguments.append(METAL_ATTRIBUTES[parameter_name])
                continue
            if "[[buffer(" not in parameter:
                raise ValueError(f"the shim has no Metal attribute {parameter_name!r}")
            if kind.endswith("&"):
                arguments.append(f"*reinterpret_cast<{kind[:-1]}*>(slots[{slot}])")
            else:
                arguments.append(f"reinterpret_cast<{kind}>(slots[{slot}])")
            slot += 1
        return function, arguments

    @staticmethod
    def threads(grid, threadgroup):
        return grid  # dispatchThreads: exactly the grid, the last threadgroup partial


class _CudaKernel(_Kernel):
    shim = "cuda.h"

    def assemble(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        return (
            assemble_cuda(inputs=inputs, template=template, output_dtypes=output_dtypes, **self.spec),
            grid,
            threadgroup,
        )

    def shape_slots(self, name, array):
        for suffix, dtype in (("_shape", np.int32), ("_strides", np.int64)):
            if f"{name}{suffix}" in self.spec["source"] and array.ndim > 0:
                values = np.zeros(MAX_NDIM, dtype=dtype)
                values[: array.ndim] = array.shape if suffix == "_shape" else _row_strides(array.shape)
                yield values
        if f"{name}_ndim" in self.spec["source"] and array.ndim > 0:
            yield np.array([array.ndim], dtype=np.int32)

    def launcher(self, source):
        name = re.search(r"__global__ void (\w+)\(", source).group(1)
        parameters = re.search(r"__global__ void \w+\(\n(.*?)\) \{\n", source, re.S).group(1).split(",\n")
        arguments = []
        for slot, parameter in enumerate(parameters):
            kind, _ = parameter.strip().rsplit(" ", 1)
            kind = kind.replace("const __grid_constant__ ", "")
            if kind.endswith("*"):
                arguments.append(f"reinterpret_cast<{kind}>(slots[{slot}])")
            elif kind in ("Shape", "Strides"):
                arguments.append(f"*reinterpret_cast<const {kind}*>(slots[{slot}])")
            else:
                arguments.append(f"*reinterpret_cast<const {kind}*>(slots[{slot}])")
        return f"mlx::core::cu::{name}", arguments

    @staticmethod
    def threads(grid, threadgroup):
        return -(-grid // threadgroup) * threadgroup  # whole blocks, as CUDA launches them


def assemble_cuda(*, name, input_names, output_names, source, header, inputs, template, output_dtypes):
    """MLX's `build_kernel` for `mx.fast.cuda_kernel` (mlx/backend/cuda/custom_kernel.cpp, MLX
    0.32), transcribed: MLX has no way to produce it on a machine without CUDA."""
    text = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
    text += header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    text += f"__global__ void custom_kernel_{name}{_template_hash(template)}(\n"
    for input_name, array in zip(input_names, inputs, strict=True):
        text += f"    const {CUDA_TYPES[array.dtype]}* {input_name},\n"
        if array.ndim > 0:
            if f"{input_name}_shape" in source:
                text += f"    const __grid_constant__ Shape {input_name}_shape,\n"
            if f"{input_name}_strides" in source:
                text += f"    const __grid_constant__ Strides {input_name}_strides,\n"
            if f"{input_name}_ndim" in source:
                text += f"    const __grid_constant__ int {input_name}_ndim,\n"
    for i, (output_name, dtype) in enumerate(zip(output_names, output_dtypes, strict=True)):
        text += f"    {CUDA_TYPES[dtype]}* {output_name}" + (",\n" if i < len(output_names) - 1 else ") {\n")
    if template:
        for template_name, value in template:
            if isinstance(value, bool):
                text += f"  constexpr bool {template_name} = {str(value).lower()};\n"
            elif isinstance(value, int):
                text += f"  constexpr int {template_name} = {value};\n"
            else:
                text += f"  using {template_name} = {CUDA_TYPES[value]};\n"
        text += "\n"
    return text + source + "\n}\n\n} // namespace mlx::core::cu\n"


def _template_hash(template):
    parts = []
    for _, value in template:
        if isinstance(value, bool):
            parts.append("_t" if value else "_f")
        elif isinstance(value, int):
            parts.append(f"_{value}")
        else:
            parts.append("_" + {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}[value])
    return "".join(parts)


def _row_strides(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def _string(data: bytes, at: int):
    (length,) = struct.unpack_from("<Q", data, at)
    at += 8
    return data[at : at + length].decode(), at + length


_libraries = {}


def _compile(shim: str, source: str, launcher) -> ctypes.CDLL:
    function, arguments = launcher
    text = (
        f'#include "{shim}"\n{source}\n'
        'extern "C" int shim_launch(void** slots, long threads, long group) {\n'
        f"  return shim::launch(threads, group, [&](long shim_thread) {{ {function}({', '.join(arguments)}); }});\n"
        "}\n"
    )
    key = hashlib.sha1(text.encode()).hexdigest()[:16]
    if key not in _libraries:
        cpp, library = BUILD / f"{key}.cpp", BUILD / f"{key}.so"
        cpp.write_text(text)
        command = [
            "g++",
            "-std=c++17",
            "-O1",
            "-shared",
            "-fPIC",
            "-Wno-attributes",
            f"-I{SHIM}",
            f"-I{SHIM / 'include'}",
        ]
        result = subprocess.run([*command, str(cpp), "-o", str(library)], capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"the kernel did not compile as C++ ({cpp}):\n{result.stderr[-4000:]}")
        _libraries[key] = ctypes.CDLL(str(library))
        _libraries[key].shim_error.restype = ctypes.c_char_p
    return _libraries[key]


METAL = emulated(kernels.metal.METAL)
CUDA = emulated(kernels.cuda.CUDA)
