"""`ms_deform_attn` on the CPU in C++ (kernels/fused/ms_deform_attn_cpu.cpp: the arithmetic of
`fused/sampling.h`, threads over the (batch, query) rows), built by the package's install as
`kernels._cpu` and called through ctypes.

MLX's own CPU gather and scatter run on one thread and pass through memory several times per
sample point; this kernel reads each tap's row once per pass on every core. It is a host call: it
evaluates its inputs (a synchronisation point, as `mx.eval`) and copies its outputs into new MLX
arrays, so it does not run inside `mx.compile` (use backend="mlx" there). float32 inside; float16
and bfloat16 are converted at the boundary.
"""

import ctypes
import importlib.util
import os
from dataclasses import dataclass
from functools import cache

import mlx.core as mx
import numpy as np

from .checks import level_starts

PADDINGS = ("zeros", "border")


@dataclass(frozen=True)
class CpuBackend:
    name: str = "cpu"

    @staticmethod
    def missing() -> str | None:
        if _library() is None:
            return (
                "the C++ extension kernels._cpu is not built (`pip install -e .` builds it; it needs a C++17 compiler)"
            )
        if mx.default_device().type != mx.cpu:
            return f"the default device is {mx.default_device()}, and this kernel runs on the CPU"
        return None

    @staticmethod
    def ms_deform_attn_core(shapes, align_corners, padding_mode, value_layout, locations_layout):
        return ms_deform_attn_core(shapes, align_corners, padding_mode, value_layout, locations_layout)


CPU = CpuBackend()


def threads() -> int:
    """All the cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@cache
def _library():
    spec = importlib.util.find_spec("kernels._cpu")
    if spec is None or spec.origin is None:
        return None
    library = ctypes.CDLL(spec.origin)
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    library.ms_deform_attn_forward.argtypes = [pointer] * 7 + [integer, pointer]
    library.ms_deform_attn_backward.argtypes = [pointer] * 7 + [integer] + [pointer] * 4
    return library


def _host(array: mx.array) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(array.astype(mx.float32)))


def _address(array: np.ndarray):
    return array.ctypes.data


@cache
def ms_deform_attn_core(shapes: tuple, align_corners: bool, padding_mode: str, value_layout: str, locations_layout):
    """A `custom_function` of (value, sampling_locations, attention_weights) in the given layouts."""
    library = _library()
    spatial_shapes = np.array(shapes, dtype=np.int32)
    starts = np.array(level_starts(shapes), dtype=np.int32)
    flags = np.array(
        [value_layout == "BNLC", locations_layout == "B2QHLP", align_corners, PADDINGS.index(padding_mode)],
        dtype=np.int32,
    )

    def dims(value, weights):
        b, q, heads, levels, points = weights.shape
        length = value.shape[2] if value_layout == "BNLC" else value.shape[1]
        return np.array([b, length, heads, value.shape[3], q, levels, points], dtype=np.int32)

    def common(value, locations, weights):
        arrays = [_host(value), spatial_shapes, starts, _host(locations), _host(weights), dims(value, weights), flags]
        return arrays, [_address(a) for a in arrays]

    @mx.custom_function
    def attend(value, locations, weights):
        b, q, heads = weights.shape[:3]
        arrays, addresses = common(value, locations, weights)
        output = np.empty((b, q, heads * value.shape[3]), dtype=np.float32)
        library.ms_deform_attn_forward(*addresses, threads(), _address(output))
        return mx.array(output).astype(value.dtype)

    @attend.vjp
    def attend_vjp(primals, cotangent, output):
        value, locations, weights = primals
        arrays, addresses = common(value, locations, weights)
        grads = [np.zeros(value.shape, np.float32), np.empty(locations.shape, np.float32)]
        grads.append(np.empty(weights.shape, np.float32))
        upstream = _host(cotangent)
        library.ms_deform_attn_backward(*addresses, threads(), _address(upstream), *(_address(g) for g in grads))
        return tuple(mx.array(g).astype(p.dtype) for g, p in zip(grads, primals, strict=True))

    return attend
