"""Recomputation in the backward (`train.activation_checkpointing`, the field's name for it): a layer's
intermediates are recomputed in the backward instead of kept from the forward, trading compute for
memory. (Not to be confused with checkpoint files, `weights/checkpoint.py`.)

A recomputation must draw the same dropout masks as the forward, or the gradient is that of another
network. So each checkpointable unit takes one key from MLX's generator, and the `Dropout` layers
inside it draw their masks from that key (in order), whether checkpointing is on or not: the same
masks, and the same gradients, either way.

`mx.checkpoint` is not used: MLX evaluates the parameters' gradients, the step's outputs, last, so
each layer's recomputation (which they need) stayed alive until the end of the backward (measured:
6 checkpointed encoder layers of the R50 model at 512 x 683 kept 2.4 GiB, as many as without
checkpointing; with the ordering below, 1.0 GiB).

What the backward keeps without recomputation is made smaller too: `relu`, `channel_affine` (the
backbone's frozen batch norms) and `Dropout` after a ReLU take their gradients from their outputs (as
PyTorch's ReLU does), so their inputs are freed after the forward (an encoder layer's FFN keeps one
(L, 1024) activation, not two and a mask)."""

from contextlib import contextmanager
from functools import cache

import kernels

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

_keys: list[list[mx.array]] = []  # the key of each unit being run, innermost last


@contextmanager
def _drawing_from(key):
    _keys.append([key])
    try:
        yield
    finally:
        _keys.pop()


def _next_key():
    if not _keys or _keys[-1][0] is None:
        return None  # outside a unit: MLX's generator
    key, sub = mx.random.split(_keys[-1][0])
    _keys[-1][0] = key
    return sub


def _fresh_key() -> mx.array:
    """A key (two uint32) drawn from MLX's generator."""
    return mx.random.randint(0, 2**31 - 1, (2,)).astype(mx.uint32)


@mx.custom_function
def relu(x):
    """max(x, 0), whose backward reads its output, not its input."""
    return kernels.relu(x)


@relu.vjp
def _relu_vjp(primals, cotangent, output):
    return (kernels.scale_where_positive(cotangent, output),)


def _relu(x, training: bool):
    """`relu` in training; outside it plain `kernels.relu`, which may compute in its input's buffer
    (`relu` holds its input until it is evaluated: R50 inference at 800 x 1066 peaked 9% higher)."""
    return relu(x) if training else kernels.relu(x)


def channel_affine(x, scale, shift, residual=None, relu: bool = False):
    """`kernels.channel_affine` (a frozen batch norm, + residual, ReLU) whose backward reads its output
    and the scale, not x: the forward in one pass on every core (where MLX's ops made three on one),
    the input gradient (g where the output is positive) * scale in one more."""
    return _channel_affine(relu)(x, scale, shift, *([] if residual is None else [residual]))


@cache
def _channel_affine(relu: bool):
    @mx.custom_function
    def affine(x, scale, shift, *residual):
        return kernels.channel_affine(x, scale, shift, residual[0] if residual else None, relu)

    @affine.vjp
    def affine_vjp(primals, cotangent, output):
        x, scale, shift, *residual = primals
        g = kernels.scale_where_positive(cotangent, output) if relu else cotangent
        channel_rows = (-1, x.shape[-1])
        # the scale's and shift's gradients read x: built for MLX's autodiff, which drops them unevaluated
        # where the batch norm is frozen (always, in FrozenBatchNorm2d), so x is not kept for them
        grads = (
            kernels.channel_affine(g, scale, mx.zeros_like(shift)),
            (g * x).reshape(channel_rows).sum(0),
            g.reshape(channel_rows).sum(0),
        )
        return grads + ((g,) if residual else ())

    return affine


@cache
def _dropped_relu(scale: float):
    """where(keep, relu(x) * scale, 0) for a kept-mask `keep`: the gradient is `scale` where the
    output is positive and 0 elsewhere (dropped, or x <= 0), so only the output is kept."""

    @mx.custom_function
    def dropped(x, keep):
        return kernels.masked_scale(x, keep, scale, relu=True)

    @dropped.vjp
    def dropped_vjp(primals, cotangent, output):
        return kernels.scale_where_positive(cotangent, output, scale), mx.zeros_like(primals[1])

    return dropped


class Dropout(nn.Module):
    """`nn.Dropout` whose masks come from the key of the unit it runs in (see `checkpointed`).

    The mask is `kernels.bernoulli16`: 16 random bits per element compared with round((1 - p) *
    65536), scaled by the inverse of that kept fraction (p = 0.1 keeps 0.899994 instead of 0.9).
    `mx.random.bernoulli` made dropout a quarter of an encoder layer's forward on the CPU (298 ms for
    a (2, 7320, 1024) activation; 167 ms with 16 bits of MLX's words; the C++ mask: 4 ms for (14620,
    1024) against 33 ms)."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p

    @property
    def active(self) -> bool:
        """Whether it drops anything: in training, with p > 0."""
        return self.training and self.p > 0

    def __call__(self, x, after_relu: bool = False):
        """dropout(x), or with `after_relu` dropout(relu(x)) as one op that keeps only its output."""
        if not self.training or self.p == 0:
            return _relu(x, self.training) if after_relu else x
        threshold = round((1 - self.p) * 65536)
        scale = 65536 / threshold
        key = _next_key()
        keep = kernels.bernoulli16(_fresh_key() if key is None else key, threshold, x.shape)
        if after_relu:
            return _dropped_relu(scale)(x, keep)
        return kernels.masked_scale(x, keep, scale)


def _uses_dropout(modules) -> bool:
    return any(
        isinstance(m, Dropout) and m.training and m.p > 0 for module in modules for _, m in module.named_modules()
    )


def checkpointed(modules: list[nn.Module], fn, *arrays, enabled: bool = True):
    """fn(*arrays) -> array, where fn uses the parameters of `modules`. With `enabled` (and in training
    mode) only its inputs and output are kept for the backward, which recomputes the rest. Every array
    that needs a gradient must come in `arrays` (or be a parameter of `modules`): anything else fn
    reads is a constant to the recomputation."""
    key = _fresh_key() if _uses_dropout(modules) else None

    if not enabled or not all(m.training for m in modules):
        with _drawing_from(key):
            return fn(*arrays)

    trainable = tree_flatten([m.trainable_parameters() for m in modules])
    names, values = [name for name, _ in trainable], [value for _, value in trainable]  # none: a frozen part

    def pure(*inputs):
        if names:
            params = tree_unflatten(list(zip(names, inputs[: len(names)], strict=True)))
            for module, module_params in zip(modules, params, strict=True):
                module.update(module_params)
        with _drawing_from(key):
            return fn(*inputs[len(names) :])

    @mx.custom_function
    def recomputed(*inputs):
        return pure(*inputs)

    @recomputed.vjp
    def recomputed_vjp(primals, cotangent, output):
        # Recompute once the cotangent exists, not as soon as the inputs do (nothing orders it otherwise).
        primals = mx.depends(list(primals), [cotangent])
        _, grads = mx.vjp(pure, primals, [cotangent])
        # And make the gradients passed on wait for the parameters' gradients: those are outputs of
        # the step, which MLX would otherwise evaluate last, keeping every recomputation alive till then.
        passed_on = mx.depends(grads[len(names) :], grads[: len(names)]) if names else grads
        return (*grads[: len(names)], *passed_on)

    return recomputed(*values, *arrays)
