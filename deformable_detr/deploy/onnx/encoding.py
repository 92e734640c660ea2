"""Per-level padding masks, the sine position encoding and the valid ratios, computed in the graph
from `pixel_mask` (the mask is an input; its index tables are constants of the canvas). Mirrors
backbone_base.resize_mask, position_encoding.py and DeformableTransformer.valid_ratios.

A level's mask here is `not_mask` (float, 1 on the image, 0 on padding), transformers' convention
and what the position encoding sums."""

import numpy as np

from ...models.backbone_base import nearest_indices
from ...models.position_encoding import PositionEmbeddingSine
from .builder import Graph


def level_mask(g: Graph, not_mask: str, canvas: tuple, hw: tuple) -> str:
    """(N, H, W) -> (N, h, w): nearest resize, as F.interpolate(mode="nearest"), by two Gathers."""
    rows = g.ints(np.array(nearest_indices(canvas[0], hw[0])), "mask_rows")
    cols = g.ints(np.array(nearest_indices(canvas[1], hw[1])), "mask_cols")
    return g.Gather(g.Gather(not_mask, rows, axis=1), cols, axis=2)


def dim_t(num_feats: int, temperature: float = 10000) -> np.ndarray:
    """temperature ** (2 * (i // 2) / num_feats), in float32 as sine_embedding computes it."""
    i = np.arange(num_feats, dtype=np.float32)
    return (np.float32(temperature) ** (2 * (i // 2) / np.float32(num_feats))).astype(np.float32)


def sine(g: Graph, positions: str, num_feats: int, temperature: float = 10000) -> str:
    """positions (..., 1) -> (..., num_feats): sin on even features, cos on odd ones, as
    position_encoding.sine_embedding."""
    angles = g.Div(positions, g.const(dim_t(num_feats, temperature), "dim_t"))
    odd = g.const(np.arange(num_feats) % 2 == 1, "odd_features", np.bool_)
    return g.Where(odd, g.Cos(angles), g.Sin(angles))


def position_embedding(g: Graph, mask: str, hw: tuple, encoding: PositionEmbeddingSine) -> str:
    """A level's (N, h, w) not_mask -> (N, h * w, 2 num_pos_feats): [y features, x features] of pixel
    positions (cumsum - offset) normalised by the unpadded extent, times the scale: the model's `encoding`'s
    (the authors' offset 0.5 and temperature 10000, DINO's 0 and 20)."""
    eps, tokens = 1e-6, hw[0] * hw[1]
    embedded = []
    for axis in (1, 2):
        cumulative = g.CumSum(mask, g.ints(axis, "axis"))
        extent = g.slice(cumulative, axis, hw[axis - 1] - 1, hw[axis - 1])
        positions = g.Sub(cumulative, g.scalar(encoding.offset)) if encoding.offset else cumulative
        normalised = g.Mul(g.Div(positions, g.Add(extent, g.scalar(eps))), g.scalar(encoding.scale))
        features = sine(g, g.reshape(normalised, (-1, tokens, 1)), encoding.num_pos_feats, encoding.temperature)
        embedded.append(features)
    return g.concat(embedded, -1)


def valid_ratios(g: Graph, mask: str, hw: tuple) -> tuple:
    """A level's (N, h, w) not_mask -> its unpadded width and height (N, 1, 2), in pixels of the
    level (valid_extent) and as fractions of the level (valid_ratios)."""
    valid_h = g.ReduceSum(g.slice(mask, 2, 0, 1), g.ints([1, 2], "axes"), keepdims=0)  # column 0
    valid_w = g.ReduceSum(g.slice(mask, 1, 0, 1), g.ints([1, 2], "axes"), keepdims=0)  # row 0
    extent = g.unsqueeze(g.Concat(g.unsqueeze(valid_w, [1]), g.unsqueeze(valid_h, [1]), axis=1), [1])
    return extent, g.Div(extent, g.const([hw[1], hw[0]], "level_wh"))


def flatten(g: Graph, x: str, channels: int, hw: tuple) -> str:
    """(N, C, h, w) -> (N, h * w, C): tokens in the MLX model's order (row-major, channels last)."""
    return g.transpose(g.reshape(x, (-1, channels, hw[0] * hw[1])), (0, 2, 1))
