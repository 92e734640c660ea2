"""Argument checks shared by the kernels: every error names the argument, what it got and what it
expected."""

import mlx.core as mx


def fail(op: str, name: str, got, expected: str):
    got = tuple(got) if isinstance(got, (list, tuple)) else got
    raise ValueError(f"{op}: {name} has shape {got}; expected {expected}")


def check_choice(op: str, name: str, value, choices):
    if value not in choices:
        raise ValueError(f"{op}: unknown {name} {value!r}; expected one of {', '.join(map(repr, choices))}")


def check_rank(op: str, name: str, array: mx.array, rank: int, expected: str):
    if array.ndim != rank:
        fail(op, name, array.shape, f"{rank} dimensions {expected}")


def check_float(op: str, **arrays):
    for name, array in arrays.items():
        if not isinstance(array, mx.array):
            raise ValueError(f"{op}: {name} must be an mlx array, got {type(array).__name__}")
        if not mx.issubdtype(array.dtype, mx.floating):
            raise ValueError(f"{op}: {name} has dtype {array.dtype}; expected a floating-point dtype")


def compute_dtype(*arrays: mx.array) -> mx.Dtype:
    """float64 if any input is float64, else float32 (float16 / bfloat16 are computed in float32)."""
    return mx.float64 if any(a.dtype == mx.float64 for a in arrays) else mx.float32


def level_starts(shapes) -> list[int]:
    """Where each level of (H, W) `shapes` starts in the flattened sequence: the running sum of H * W."""
    starts = [0]
    for h, w in shapes[:-1]:
        starts.append(starts[-1] + h * w)
    return starts
