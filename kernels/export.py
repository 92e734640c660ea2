"""`export_mode()`: within it, every op of this package computes with MLX's own operations, the ones
`mx.export_function` can write to a `.mlxfn` file.

Outside it the ops may run as C++ primitives of `kernels._native` (and the `mx.contiguous` before
them), fused GPU kernels, or `mx.custom_function`s with hand-written VJPs; none of those serializes
("[export_function] Unable to serialize primitive CustomTransforms", "... Contiguous"). Within it:
`native.for_float32` and `backends.select` answer None (the MLX-ops path, as on a machine without
the extension or a GPU), and a function made by `custom_function` below runs its forward as plain
MLX ops, without the custom VJP. The forward's numbers are the same either way (the C++ and fused
kernels are checked against the MLX-ops path); only differentiation would differ, and an exported
file is not differentiated.

    with kernels.export_mode():
        mx.export_function("model.mlxfn", forward, *example_inputs)
"""

from contextlib import contextmanager
from contextvars import ContextVar
from functools import wraps

import mlx.core as mx

_exporting = ContextVar("kernels_export_mode", default=False)


@contextmanager
def export_mode():
    """Plain MLX ops for every op of `kernels` (and of callers that ask `exporting()`) while inside."""
    token = _exporting.set(True)
    try:
        yield
    finally:
        _exporting.reset(token)


def exporting() -> bool:
    """Inside `export_mode()`: only operations that `mx.export_function` serializes."""
    return _exporting.get()


def custom_function(forward):
    """`mx.custom_function(forward)`, whose `vjp`, `jvp` and `vmap` decorators register as usual, except
    that inside `export_mode()` a call runs `forward` itself (its MLX ops serialize; the custom
    transforms would not)."""
    custom = mx.custom_function(forward)

    @wraps(forward)
    def call(*args, **kwargs):
        return forward(*args, **kwargs) if exporting() else custom(*args, **kwargs)

    call.vjp, call.jvp, call.vmap = custom.vjp, custom.jvp, custom.vmap
    return call
