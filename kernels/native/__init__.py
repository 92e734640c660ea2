"""The C++ extension `kernels._native`, built from the sources beside this file by the package's install: MLX
operations (C++ `Primitive`s with their VJPs) that evaluate on MLX's CPU stream. Unlike a host call,
they stay lazy: a function that uses them can be differentiated, checkpointed and `mx.compile`d
without evaluating anything inside.

It is compiled against one MLX release (MLX's C++ ABI changes between releases; pyproject.toml pins
the version for the build and at run time); loaded under another, it is refused and `kernels` falls
back to MLX ops and scipy, with `missing()` saying why.
"""

import importlib
from functools import cache

import mlx.core as mx

from ..export import exporting
from ..settings import ATTENTION_ISA

# Right from a wheel and from a checkout alike: `kernels` sits below deformable_detr and does not ask
# which it runs from (deformable_detr.errors.install_hint does), and `pip install -e .` works only in a checkout.
REBUILD = "reinstalling the package builds it (in a source checkout: pip install -e .)"


@cache
def _load():
    try:
        module = importlib.import_module("kernels._native")
    except ImportError as error:
        return None, f"the C++ extension kernels._native is not built ({error}): {REBUILD}"
    if other_mlx(module):
        return None, other_mlx(module)
    module.set_attention_isa(ATTENTION_ISA.value())  # before its first use: its C++ reads no environment
    return module, None


def other_mlx(module) -> str | None:
    """Why an extension (kernels._native, kernels._onednn) built against another MLX than this one cannot be used
    (MLX's C++ ABI changes between releases), or None: the one check both make."""
    if module.mlx_version == mx.__version__:
        return None
    built = f"{module.__name__} was built against MLX {module.mlx_version}"
    return f"{built}, and MLX {mx.__version__} is installed: {REBUILD}"


def module():
    """The extension module, or None where it cannot be used (`missing()` says why)."""
    return _load()[0]


def missing() -> str | None:
    return _load()[1]


def for_float32(*arrays):
    """The extension where its float32 CPU operations can take `arrays` (built, the default device
    the CPU, every array float32, not in `export_mode()`), or None: then the caller computes with MLX's
    own operations."""
    return _for(arrays, (mx.float32,))


def for_float32_or_bfloat16(*arrays):
    """The extension where its CPU operations that read float32 or bfloat16 (bfloat16 computed in float32,
    rounded back as MLX's bfloat16 operations round) can take `arrays`: as `for_float32`, each array
    float32 or bfloat16. Whether an operation needs them of one dtype, its caller asks."""
    return _for(arrays, (mx.float32, mx.bfloat16))


def _for(arrays, dtypes):
    extension = module()
    if extension is None or exporting() or mx.default_device().type != mx.cpu:
        return None
    if any(a.dtype not in dtypes for a in arrays):
        return None
    return extension
