"""`adamw_update(parameter, gradient, m, v, factors, beta1, beta2, eps)`: one step of
`mlx.optimizers.AdamW` (bias correction on) for one parameter, its gradient first multiplied by a scale
(gradient clipping's factor), -> (parameter, m, v) new, the same numbers.

`factors` (4,) float32: [1 - lr * weight_decay, lr / (1 - beta1^step), rsqrt(1 - beta2^step), the
gradient's scale], as the optimizer computes them from its state (`adamw_factors`), so that a learning
rate or step count held in an array stays lazy.

On the CPU, for float32, it is the C++ operation of `kernels._native`: MLX's operations in their order
and rounding, in one pass on every core, where MLX makes about twelve passes of one thread each (an R50
training step's optimizer: 0.25 s of 5.7 on 2 cores, all on MLX's one stream thread). Elsewhere, for
other dtypes and in `export_mode()`, MLX's ops. Not differentiable (an optimizer's update)."""

import mlx.core as mx

from . import native
from .cpu import threads


def adamw_factors(learning_rate: mx.array, weight_decay: float, beta1: float, beta2: float, step, scale=None):
    """[1 - lr * weight_decay, lr / (1 - beta1^step), rsqrt(1 - beta2^step), scale] in float32, each as
    mlx.optimizers.AdamW computes it (scale: 1 where None)."""
    lr = learning_rate.astype(mx.float32)
    decay = 1 - lr * weight_decay
    c1 = (lr / (1 - beta1**step)).astype(mx.float32)
    c2 = mx.rsqrt(1 - beta2**step).astype(mx.float32)
    scale = mx.array(1.0, mx.float32) if scale is None else mx.array(scale).astype(mx.float32)
    return mx.stack([decay, c1, c2, scale])


def adamw_update(parameter, gradient, m, v, factors, beta1: float, beta2: float, eps: float):
    extension = native.for_float32(parameter, gradient, m, v, factors)
    if extension is None or not (parameter.shape == gradient.shape == m.shape == v.shape):
        return with_mlx_ops(parameter, gradient, m, v, factors, beta1, beta2, eps)
    new = extension.adamw_update(parameter, gradient, m, v, factors, beta1, 1 - beta1, beta2, 1 - beta2, eps, threads())
    return tuple(new)


def with_mlx_ops(parameter, gradient, m, v, factors, beta1: float, beta2: float, eps: float):
    """The same in MLX's ops, as mlx.optimizers.AdamW (after clip_grad_norm's scaling) writes them."""
    decay, c1, c2, scale = (factors[i].astype(gradient.dtype) for i in range(4))
    gradient = (gradient * scale).astype(gradient.dtype)
    parameter = parameter * decay
    m = beta1 * m + (1 - beta1) * gradient
    v = beta2 * v + (1 - beta2) * mx.square(gradient)
    return parameter - (c1 * m) / (mx.sqrt(v) * c2 + eps), m, v
