"""`gelu`: torch's `nn.GELU()` (the exact one, x * Phi(x)), fast on the CPU, with its gradient.

MLX's Linux build evaluates `mx.erf` (and `mx.exp`) one element at a time through libm (kernels/softmax.py
says why): `nn.gelu` took 540 ms for the (1, 200, 267, 384) activation of a Swin-T block at 800 x 1066, and
about half of the whole backbone's forward. Here erf is the rational approximation that Eigen and XLA use
for float32 (x * P(x^2) / Q(x^2) on [-4, 4], +-1 beyond: within 1e-7 of erf), nothing but multiplications,
additions and one division, fused by `mx.compile` into one pass: 70-90 ms for the same activation. Its
results differ from torch's CPU GELU by at most 1.5e-6 (a few float32 roundings; torch's own erf is another
approximation), its gradient by 1e-5. The backward is the derivative of the same rational function, also
one compiled pass (MLX differentiating `nn.gelu` goes through `mx.exp`). In `kernels.export_mode()` it is
`nn.gelu`: an exported file holds plain MLX operations.
"""

import math
from functools import partial

import kernels

import mlx.core as mx
import mlx.nn as nn

from .precision import to, widened

# erf(u) ~ u * P(u^2) / Q(u^2) for |u| <= 4 (Eigen's generic_fast_erf_float, XLA's ErfImpl32)
NUMERATOR = (
    -1.60960333262415e-02,
    -2.95459980854025e-03,
    -7.34990630326855e-04,
    -5.69250639462346e-05,
    -2.10102402082508e-06,
    2.77068142495902e-08,
    -2.72614225801306e-10,
)
DENOMINATOR = (
    -1.42647390514189e-02,
    -7.37332916720468e-03,
    -1.68282697438203e-03,
    -2.13374055278905e-04,
    -1.45660718464996e-05,
)
CLAMP = 4.0  # erf(4) = 1 - 1.5e-8: 1 in float32
SQRT_HALF = 1 / math.sqrt(2)


def _polynomial(coefficients, z):
    value = coefficients[-1]
    for c in reversed(coefficients[:-1]):
        value = value * z + c
    return value


def _derivative(coefficients):
    return tuple((i + 1) * c for i, c in enumerate(coefficients[1:]))


@partial(mx.compile, shapeless=True)
def _forward(x):
    u = mx.clip(x * SQRT_HALF, -CLAMP, CLAMP)
    z = u * u
    return 0.5 * x * (1 + u * _polynomial(NUMERATOR, z) / _polynomial(DENOMINATOR, z))


@partial(mx.compile, shapeless=True)
def _backward(x, cotangent):
    """cotangent * d/dx (x * (1 + erf(x / sqrt 2)) / 2), erf' the derivative of the same P / Q."""
    u = x * SQRT_HALF
    inside = mx.abs(u) < CLAMP
    u = mx.clip(u, -CLAMP, CLAMP)
    z = u * u
    p, reciprocal = _polynomial(NUMERATOR, z), 1 / _polynomial(DENOMINATOR, z)
    dp, dq = _polynomial(_derivative(NUMERATOR), z), _polynomial(_derivative(DENOMINATOR), z)
    erf = u * p * reciprocal
    # d/du (u p(u^2) / q(u^2)) = (p + 2 z p') / q - 2 z p q' / q^2
    slope = ((p + 2 * z * dp) - 2 * z * p * dq * reciprocal) * reciprocal
    return cotangent * (0.5 * (1 + erf) + (0.5 * SQRT_HALF) * x * mx.where(inside, slope, 0.0))


@mx.custom_function
def _gelu(x):
    return _forward(x)


@_gelu.vjp
def _gelu_vjp(x, cotangent, output):  # one input: `x` is the array itself, not a tuple
    return _backward(x, cotangent)


def gelu(x: mx.array) -> mx.array:
    """x * Phi(x), computed in float32 (the result in x's dtype)."""
    if kernels.exporting():
        return nn.gelu(x)
    return to(_gelu(widened(x)), x.dtype)
