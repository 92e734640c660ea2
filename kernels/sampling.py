"""Where a sample point reads its input, with what weight, and how that weight moves with the point.

Both `grid_sample` and `ms_deform_attn` reduce to the same plan: for each sample point, a small
set of *taps* (integer pixel positions), each with an interpolation weight and the derivatives of
that weight w.r.t. the point's pixel coordinates. The forward pass gathers and sums; the backward
pass scatter-adds the input gradient and reduces the coordinate gradient from the same taps, so
both passes agree by construction.

Conventions follow PyTorch's CPU `grid_sample` (aten/src/ATen/native/cpu/GridSamplerKernel.cpp):
- bilinear taps are `floor(x)` and `floor(x) + 1`, never `ceil(x)`: at an integer coordinate the
  weight derivative is the one-sided (right) slope, never zero by construction;
- when `border`/`reflection` padding clips a coordinate, the clip's gradient is 1 strictly inside
  (0, size - 1) and 0 on or outside the edges;
- a tap outside the input reads zero.
Non-finite coordinates read nothing: their taps are all outside, so they sample zeros and get a
zero gradient.
"""

from typing import NamedTuple

import mlx.core as mx

BICUBIC_A = -0.75  # PyTorch's (and OpenCV's) cubic convolution constant


class Taps(NamedTuple):
    """Per-point taps stacked on the last axis (size K: 1 nearest, 4 bilinear, 16 bicubic).

    `index` is the flat position `y * width + x` (int32, 0 where the tap is outside);
    `weight`, `dweight_dx`, `dweight_dy` are zero where the tap is outside.
    """

    index: mx.array
    weight: mx.array
    dweight_dx: mx.array
    dweight_dy: mx.array


def _sanitize(x: mx.array, size) -> mx.array:
    """Replace NaN by a far-outside coordinate and bound infinities, so that floor() and int casts
    stay defined. Every tap of a coordinate below -4 or above size + 3 is outside either way."""
    x = mx.where(mx.isnan(x), -8.0, x)
    return mx.minimum(mx.maximum(x, -8.0), size + 8.0).astype(x.dtype)


def clip_coordinates(x: mx.array, size):
    """Border padding: clip to [0, size - 1]. Returns (coordinate, d coordinate / d x)."""
    clipped = mx.minimum(mx.maximum(x, 0), size - 1).astype(x.dtype)
    inside = mx.logical_and(x > 0, x < size - 1)
    return clipped, inside.astype(x.dtype)


def reflect_coordinates(x: mx.array, size: int, align_corners: bool):
    """Reflection padding (about the edge pixels' centres, or their outer edges without
    align_corners), then a clip. Returns (coordinate, d coordinate / d x)."""
    twice_low, twice_high = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
    if twice_low == twice_high:  # a single pixel with align_corners: everything maps onto it
        return mx.zeros_like(x), mx.zeros_like(x)
    low = twice_low / 2
    span = (twice_high - twice_low) / 2
    shifted = x - low
    sign = mx.where(shifted < 0, -1.0, 1.0).astype(x.dtype)
    shifted = mx.abs(shifted)
    extra = mx.remainder(shifted, span)
    flips = mx.floor(shifted / span)
    even = mx.remainder(flips, 2) == 0
    reflected = mx.where(even, extra + low, span - extra + low).astype(x.dtype)
    clipped, clip_grad = clip_coordinates(reflected, size)
    return clipped, mx.where(even, sign, -sign).astype(x.dtype) * clip_grad


def pad_coordinates(x: mx.array, size, padding_mode: str, align_corners: bool):
    """Apply a padding mode to a pixel coordinate. Returns (coordinate, d coordinate / d x)."""
    if padding_mode == "zeros":
        return x, mx.ones_like(x)
    if padding_mode == "border":
        return clip_coordinates(x, size)
    return reflect_coordinates(x, size, align_corners)


def _tap(xi: mx.array, yi: mx.array, width, height):
    """Flat index and in-bounds mask of an integer-valued (float) tap position."""
    inside = (xi >= 0) & (xi <= width - 1) & (yi >= 0) & (yi <= height - 1)
    xc = mx.minimum(mx.maximum(xi, 0), width - 1).astype(mx.int32)
    yc = mx.minimum(mx.maximum(yi, 0), height - 1).astype(mx.int32)
    index = mx.where(inside, yc * width + xc, 0).astype(mx.int32)
    return index, inside


def _stack(indices, masks, weights, dxs, dys) -> Taps:
    mask = mx.stack(masks, axis=-1)
    zero = mx.array(0, dtype=weights[0].dtype)
    return Taps(
        index=mx.stack(indices, axis=-1),
        weight=mx.where(mask, mx.stack(weights, axis=-1), zero),
        dweight_dx=mx.where(mask, mx.stack(dxs, axis=-1), zero),
        dweight_dy=mx.where(mask, mx.stack(dys, axis=-1), zero),
    )


def bilinear_taps(x: mx.array, y: mx.array, width, height) -> Taps:
    """Four taps at floor(x) + {0, 1}, floor(y) + {0, 1}. `x`, `y` are pixel coordinates (already
    padded); `width`, `height` are ints or arrays broadcasting against them."""
    x = _sanitize(x, width)
    y = _sanitize(y, height)
    x0, y0 = mx.floor(x), mx.floor(y)
    fx, fy = x - x0, y - y0
    gx, gy = 1 - fx, 1 - fy
    indices, masks, weights, dxs, dys = [], [], [], [], []
    for dy, wy, dwy in ((0, gy, -1.0), (1, fy, 1.0)):
        for dx, wx, dwx in ((0, gx, -1.0), (1, fx, 1.0)):
            index, inside = _tap(x0 + dx, y0 + dy, width, height)
            indices.append(index)
            masks.append(inside)
            weights.append(wx * wy)
            dxs.append(dwx * wy)
            dys.append(wx * dwy)
    return _stack(indices, masks, weights, dxs, dys)


def nearest_taps(x: mx.array, y: mx.array, width, height) -> Taps:
    """One tap at the nearest pixel, ties to even (as `nearbyint`); its weight does not move."""
    x = _sanitize(x, width)
    y = _sanitize(y, height)
    index, inside = _tap(mx.round(x), mx.round(y), width, height)
    one = mx.ones_like(x)
    zero = mx.zeros_like(x)
    return _stack([index], [inside], [one], [zero], [zero])


def _cubic_coefficients(t: mx.array):
    """Cubic convolution weights of the taps at -1, 0, 1, 2 for a fraction t, and their
    derivatives w.r.t. t."""
    a = BICUBIC_A

    def near(s):  # |s| <= 1
        return ((a + 2) * s - (a + 3)) * s * s + 1

    def far(s):  # 1 < |s| < 2
        return ((a * s - 5 * a) * s + 8 * a) * s - 4 * a

    def d_near(s):
        return (3 * (a + 2) * s - 2 * (a + 3)) * s

    def d_far(s):
        return (3 * a * s - 10 * a) * s + 8 * a

    weights = [far(t + 1), near(t), near(1 - t), far(2 - t)]
    slopes = [d_far(t + 1), d_near(t), -d_near(1 - t), -d_far(2 - t)]
    return weights, slopes


def bicubic_taps(x: mx.array, y: mx.array, width, height, padding_mode: str, align_corners: bool) -> Taps:
    """Sixteen taps at floor(x) + {-1..2}, floor(y) + {-1..2}. Unlike bilinear, the padding mode
    moves each tap, not the point (as PyTorch does), so it carries no coordinate gradient."""
    x = _sanitize(x, width)
    y = _sanitize(y, height)
    x0, y0 = mx.floor(x), mx.floor(y)
    cx, dcx = _cubic_coefficients(x - x0)
    cy, dcy = _cubic_coefficients(y - y0)
    indices, masks, weights, dxs, dys = [], [], [], [], []
    for j in range(4):
        yj, _ = pad_coordinates(y0 + (j - 1), height, padding_mode, align_corners)
        for i in range(4):
            xi, _ = pad_coordinates(x0 + (i - 1), width, padding_mode, align_corners)
            index, inside = _tap(xi, yj, width, height)
            indices.append(index)
            masks.append(inside)
            weights.append(cx[i] * cy[j])
            dxs.append(dcx[i] * cy[j])
            dys.append(cx[i] * dcy[j])
    return _stack(indices, masks, weights, dxs, dys)
