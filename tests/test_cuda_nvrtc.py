"""The fused CUDA kernels through NVIDIA's own compilers, without a GPU: every kernel instance the
dispatch can launch, in the source MLX assembles, compiled by NVRTC with the headers and options of
MLX's CUDA back-end (`cuda_toolchain`) for sm_80 (A100) and sm_90a (H100 / H200); then ptxas on
the PTX: no spills and no local memory, and registers that fit the launch's block. Then mutations
of the real text that NVRTC must reject."""

import functools
import importlib
import re
import tempfile
from collections import Counter
from pathlib import Path

import kernels.cuda
from kernels import fused

import mlx.core as mx
import pytest
from cuda_toolchain import (
    KERNEL_START,
    MLX_NVRTC_OPTIONS,
    REGISTERS_PER_BLOCK,
    NvrtcError,
    block_registers,
    fetch_mlx_cuda,
    find_toolkit,
    kernel_instances,
    nvrtc_compile,
    one_program,
    ptxas,
)

attention = importlib.import_module("kernels.ms_deform_attn")  # the module; `kernels.ms_deform_attn` is the op
sampling = importlib.import_module("kernels.grid_sample")

# MLX asks NVRTC for sm_<major><minor> with "a" from compute capability 9 (jit_module.cpp), as SASS;
# here PTX for compute_<arch>, then ptxas for sm_<arch>, which is the same pipeline in two steps.
ARCHS = ("80", "90a")


@pytest.fixture(scope="module")
def toolkit():
    found = find_toolkit()
    if isinstance(found, str):
        pytest.skip(found)
    return found


@pytest.fixture(scope="module")
def mlx_cuda(toolkit):
    with tempfile.TemporaryDirectory(prefix="mlx_cuda_") as directory:
        fetched = fetch_mlx_cuda(Path(directory))
        if isinstance(fetched, str):
            pytest.skip(fetched)
        yield fetched


@pytest.fixture(scope="module")
def instances():
    return kernel_instances()


@pytest.fixture(scope="module")
def compiled(toolkit, mlx_cuda, instances, tmp_path_factory):
    """`compiled(arch)`: every instance in one NVRTC program, and ptxas's report on it."""
    directory = tmp_path_factory.mktemp("nvrtc")

    @functools.cache
    def compile_all(arch):
        program = one_program(instances)
        (directory / "kernels.cu").write_text(program)
        try:
            result = nvrtc_compile(toolkit, mlx_cuda, program, [i.name for i in instances], arch, program="kernels.cu")
        except NvrtcError as error:
            version = ".".join(map(str, toolkit.version))
            pytest.fail(
                f"NVRTC {version} rejects the kernels for compute_{arch} ({directory / 'kernels.cu'}):\n{error}"
            )
        report, output = ptxas(toolkit, result.ptx, arch, directory)
        return result, report, output

    return compile_all


def test_cuda_nvrtc_sees_every_instance_the_dispatch_launches(instances):
    """Both ops, forward and backward, every layout, padding and align_corners, float16 / bfloat16 /
    float32 (float64 stays on the MLX-ops path, nearest and bicubic too)."""
    flags = 2 * len(attention.PADDING_MODES) * len(attention.VALUE_LAYOUTS) * len(attention.LOCATION_LAYOUTS)
    expected = {"ms_deform_attn_forward": 3 * flags, "ms_deform_attn_backward": 3 * flags}  # 3 dtypes, 2 align
    sampling_flags = 2 * len(sampling.PADDING_MODES)
    expected |= {"grid_sample_forward": 3 * sampling_flags, "grid_sample_backward": 3 * sampling_flags}
    assert Counter(i.kernel for i in instances) == expected
    for kernel in expected:
        dtypes = {dict(i.template)["T"] for i in instances if i.kernel == kernel}
        assert dtypes == {mx.float16, mx.bfloat16, mx.float32}, kernel
    assert len({i.function for i in instances}) == len(instances), "two instances share a kernel name"
    assert {i.block for i in instances} == {fused.THREADGROUP}


def test_cuda_nvrtc_compiles_the_source_mlx_assembles(mlx_cuda, instances):
    """`gpu_emulator.assemble_cuda` is a transcription of MLX's `build_kernel`: its fixed text is
    the installed MLX version's own (strings of the wheel's libmlx.so), as is the NVRTC option
    added here; every MLX header the kernels include is one MLX hands to NVRTC."""

    def in_library(text):
        return b"\0" + text.encode() + b"\0" in mlx_cuda.library

    source = instances[0].source
    includes = source[: source.index(kernels.cuda.PROLOGUE)]
    assert in_library(includes), f"MLX {mlx_cuda.version} starts its kernels otherwise than {includes!r}"
    assert in_library(KERNEL_START)
    for argument in ("    const __grid_constant__ Shape ", "    const __grid_constant__ Strides "):
        assert in_library(argument)
    for option in MLX_NVRTC_OPTIONS:
        assert in_library(option), f"MLX {mlx_cuda.version} no longer passes {option} to NVRTC"

    needed, pending = set(), set()
    for instance in instances:
        pending |= set(re.findall(r'#include "(mlx/[^"]+)"', instance.source))
    while pending:
        name = pending.pop()
        needed.add(name)
        assert name in mlx_cuda.headers, f"the kernels include {name}, which cuda_toolchain.EMBEDDED lacks"
        pending |= set(re.findall(r'#include "(mlx/[^"]+)"', mlx_cuda.headers[name].decode())) - needed
    assert needed == set(mlx_cuda.headers)
    # config.h is also in the wheel as a file: the embedded text is read back exactly.
    shipped = (mlx_cuda.include / "mlx/backend/cuda/device/config.h").read_bytes()
    assert mlx_cuda.headers["mlx/backend/cuda/device/config.h"] == shipped.replace("©".encode(), b"  ")


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_kernels_compile_with_nvrtc(arch, compiled, instances):
    """NVRTC accepts every instance without a warning; ptxas gives each no spill and no stack
    frame (local memory), and few enough registers for its block: at 256 threads any count up to
    ptxas's 255 fits, so this holds the line for a larger block (1024 threads: 64 registers)."""
    result, report, output = compiled(arch)
    assert result.log.strip() == "", f"NVRTC warns for compute_{arch}:\n{result.log}"
    assert "warning" not in output, output
    problems = []
    for instance in instances:
        resources = report.get(result.lowered[instance.name])
        if resources is None:
            problems.append(f"{instance.function}: not in ptxas's report")
            continue
        if resources.spill_stores or resources.spill_loads or resources.stack:
            problems.append(f"{instance.function}: {resources}")
        if block_registers(resources.registers, instance.block) > REGISTERS_PER_BLOCK:
            problems.append(f"{instance.function}: {resources.registers} registers x {instance.block} threads")
    assert not problems, f"sm_{arch}:\n" + "\n".join(problems)
    assert len(report) == len(instances)


def test_cuda_nvrtc_one_program_per_kernel_as_mlx_gives_the_same_code(compiled, instances, toolkit, mlx_cuda, tmp_path):
    """MLX compiles each kernel as its own program; the instance with the most registers, compiled
    so, uses what it does in the shared program."""
    result, report, _ = compiled("80")
    heaviest = max(instances, key=lambda i: report[result.lowered[i.name]].registers)
    alone = nvrtc_compile(toolkit, mlx_cuda, heaviest.source, [heaviest.name], "80")
    alone_report, _ = ptxas(toolkit, alone.ptx, "80", tmp_path)
    assert alone_report == {result.lowered[heaviest.name]: report[result.lowered[heaviest.name]]}


# (what, the real text, its mutation, NVRTC's error). The last two pass the CUDA shim tests of
# test_fused_kernels: the shim's half types have no operators of their own, so a half times a float
# is float arithmetic there (cuda_bf16.h also has a bfloat16 operator*), and its std is the host's.
MUTATIONS = [
    ("undeclared identifier", "slope_x = lane_sum(slope_x);", "slope_x = warp_sum(slope_x);",
     'identifier "warp_sum" is undefined'),
    ("no such overload", "__shfl_xor_sync(0xffffffffu, x, offset)", "__shfl_xor_sync(0xffffffffu, &x, offset)",
     'no instance of overloaded function "__shfl_xor_sync" matches the argument list'),
    ("a bfloat16 read without float()", "const float s = float(value[at]) * g;", "const float s = value[at] * g;",
     'more than one operator "*" matches these operands'),
    ("a host-only function", "const float x0 = floor(x);", "const float x0 = std::floor(x);",
     'namespace "std" has no member "floor"'),
]  # fmt: skip


@pytest.mark.parametrize("what,text,mutation,error", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_cuda_nvrtc_rejects_a_mutated_kernel(what, text, mutation, error, toolkit, mlx_cuda, instances):
    """The bfloat16 ms_deform_attn backward (prologue, sampling.h and its body) with one mutation:
    NVRTC fails, at the mutated line."""
    (instance,) = [
        i for i in instances
        if i.kernel == "ms_deform_attn_backward" and dict(i.template)["T"] == mx.bfloat16 and i.template[1:] == (
            ("ALIGN_CORNERS", False), ("PADDING", 0), ("VALUE_BNLC", False), ("LOCATIONS_B2QHLP", False)
        )
    ]  # fmt: skip
    assert instance.source.count(text) == 1, f"the kernels no longer read {text!r}: update this mutation"
    mutated = instance.source.replace(text, mutation)
    line = mutated[: mutated.index(mutation)].count("\n") + 1
    with pytest.raises(NvrtcError) as rejected:
        nvrtc_compile(toolkit, mlx_cuda, mutated, [instance.name], "80")
    assert f"kernel.cu({line}): error: {error}" in str(rejected.value), str(rejected.value)
