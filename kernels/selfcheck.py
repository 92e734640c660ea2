"""Fused kernels that cannot fail a user: the first time a process would run a fused GPU kernel
instance (back-end, op, dtype, padding, align_corners, layouts) by the automatic choice, it runs it
on a small problem against the MLX-ops path, forward and backward. A kernel that does not compile,
raises, or gives other numbers is reported once in a warning and that instance takes the MLX-ops
path from then on (slower, the same numbers).

KERNELS_SELF_CHECK=0 skips the checks. A back-end named with `backend=` (or KERNELS_BACKEND, for
callers that cannot pass it, such as a model) is used as told, unchecked."""

import warnings

import mlx.core as mx
import numpy as np

from .settings import BACKEND, SELF_CHECK

TOLERANCE = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 5e-2}  # relative to each array's largest value
REPORT = "kernels/README.md#when-a-fused-kernel-fails-its-self-check"


class KernelSelfCheckWarning(RuntimeWarning):
    """A fused kernel failed its self-check; its instance runs on the MLX-ops path."""


_verdicts: dict = {}  # instance -> True (the kernel is used) or False (the MLX-ops path)


def enabled() -> bool:
    return SELF_CHECK.value()


def trusted(backend, op: str, dtype: mx.Dtype, options: dict, fused, reference, inputs) -> bool:
    """Whether this instance of `backend`'s kernel for `op` may run. `fused` and `reference`: the
    fused and the MLX-ops functions of the same arguments; `inputs()`: the small problem."""
    key = (backend, op, dtype, tuple(sorted(options.items())))
    if key not in _verdicts:
        problem = _problem(fused, reference, inputs, dtype) if enabled() else None
        if problem is not None:
            described = ", ".join([str(dtype).replace("mlx.core.", "")] + [f"{k} {v}" for k, v in options.items()])
            warnings.warn(
                f"kernels: the fused {backend.name} kernel of {op} ({described}) failed its self-check: {problem}. "
                f"This instance runs on the MLX-ops path from now on (slower, the same numbers). Please report it "
                f"with your MLX version ({mx.__version__}) and device ({REPORT}); {SELF_CHECK.name}=0 skips the "
                f"check, {BACKEND.name}={backend.name} forces the kernel.",
                KernelSelfCheckWarning,
                stacklevel=4,
            )
        _verdicts[key] = problem is None
    return _verdicts[key]


def _problem(fused, reference, inputs, dtype) -> str | None:
    """What differs between the fused and the reference function on the problem, forward and the
    gradient of every input, or None."""
    arguments = [a.astype(dtype) for a in inputs()]
    cotangent = mx.random.normal(reference(*arguments).shape, key=mx.random.key(1)).astype(dtype)
    results = {}
    for name, function in (("fused", fused), ("reference", reference)):
        try:
            outputs, gradients = mx.vjp(function, arguments, [cotangent])
            mx.eval(outputs, gradients)
        except Exception as error:  # noqa: BLE001  (a compiler's or a launch's error: what the check is for)
            if name == "reference":
                raise
            first_line = (str(error).strip().splitlines() or [""])[0]
            return f"it raised {type(error).__name__}: {first_line}"
        results[name] = [outputs[0], *gradients]
    parts = ["the output", *(f"the gradient of input {i}" for i in range(len(arguments)))]
    for part, got, expected in zip(parts, results["fused"], results["reference"], strict=True):
        got, expected = np.array(got.astype(mx.float32)), np.array(expected.astype(mx.float32))
        if not np.isfinite(got).all():
            return f"{part} has non-finite values"
        error = np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-6)
        if error > TOLERANCE.get(dtype, 1e-4):
            return f"{part} differs from the MLX-ops path's by {error:.2g} of its largest value"
    return None
