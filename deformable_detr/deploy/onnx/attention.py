"""Multi-scale deformable attention (ms_deform_attn.py) and the decoder's self-attention as ONNX,
every tensor of rank 5 or less.

The model's sampling locations are rank 6, (N, Q, heads, levels, points, 2); here each level is
sampled on its own, from (N, Q, heads, points, 2), so they never exist. The sampler
(`align_corners=False`, zeros outside, as the authors' core) is one of:

- "gather" (the default): the four bilinear taps of every point computed in the graph (Floor,
  Clip, Cast), read with one `Gather` on axis 0 of the values flattened to (N * heads * L, C) per
  level, and summed with their bilinear and attention weights by one MatMul. Gather is in every
  opset and every runtime; TensorRT 10.14 and 11.1 return corrupted logits for deformable attention
  written with GridSample (NVIDIA/TensorRT#4813: the workaround its users report is this sampler).
- "grid_sample": one `GridSample` (opset 16) per level, the authors' `ms_deform_attn_core_pytorch`.

In onnxruntime (CPU) both cost about the same: R50 at 800 x 1066, 10.4 s of CPU time on one thread
with gather, 9.6 s with grid_sample (docs/deploy_onnx.md).
"""

from dataclasses import dataclass

import numpy as np

from .builder import INT64, Graph

SAMPLERS = ("gather", "grid_sample")


@dataclass(frozen=True)
class Sizes:
    """What the attention's graph is built for: batch, heads, points, channels per head, and each
    level's (h, w) and first token in the flattened sequence of `length` tokens."""

    batch: int
    heads: int
    points: int
    channels: int
    levels: tuple  # ((h, w, start), ...)
    length: int
    sampler: str = "gather"


def sampling_locations(g: Graph, reference: str, ref_dims: int, offsets: str, level: int, sizes: Sizes) -> str:
    """reference (N, Q, levels, ref_dims) seen from each level, offsets (N, Q, heads, levels,
    points * 2) -> this level's locations (N, Q, heads, points, 2), x first, in [0, 1] inside it."""
    h, w, _ = sizes.levels[level]
    ref = g.unsqueeze(g.squeeze(g.slice(reference, 2, level, level + 1), [2]), [2, 3])  # (N, Q, 1, 1, ref_dims)
    level_offsets = g.reshape(g.slice(offsets, 3, level, level + 1), (sizes.batch, -1, sizes.heads, sizes.points, 2))
    if ref_dims == 2:
        return g.Add(ref, g.Div(level_offsets, g.const([w, h], "level_wh")))
    centre, size = g.split(ref, [2, 2], -1)
    return g.Add(centre, g.Mul(g.Mul(g.Div(level_offsets, g.scalar(sizes.points)), size), g.scalar(0.5)))


def gather_level(g: Graph, values: str, locations: str, weights: str, level: int, sizes: Sizes) -> str:
    """values (N * heads * L, C) (head-major), locations (N, Q, heads, P, 2), attention weights
    (N, Q, heads, P) -> (N, Q, heads, 1, C): the level's bilinear samples, weighted and summed."""
    h, w, start = sizes.levels[level]
    x, y = (g.squeeze(part, [4]) for part in g.split(locations, [1, 1], 4))
    # pixel coordinates (u * size - 0.5), bounded so that Floor and Cast stay defined for infinities
    x = g.Clip(g.Sub(g.Mul(x, g.scalar(w)), g.scalar(0.5)), g.scalar(-8.0), g.scalar(w + 8.0))
    y = g.Clip(g.Sub(g.Mul(y, g.scalar(h)), g.scalar(0.5)), g.scalar(-8.0), g.scalar(h + 8.0))
    x0, y0 = g.Floor(x), g.Floor(y)
    fx, fy = g.Sub(x, x0), g.Sub(y, y0)
    one = g.scalar(1.0)
    x1, y1, gx, gy = g.Add(x0, one), g.Add(y0, one), g.Sub(one, fx), g.Sub(one, fy)
    # the four taps side by side on the points axis: (x0, y0), (x1, y0), (x0, y1), (x1, y1)
    xs, ys = g.concat([x0, x1, x0, x1], -1), g.concat([y0, y0, y1, y1], -1)
    tap_weights = g.Mul(
        g.Mul(g.concat([gx, fx, gx, fx], -1), g.concat([gy, gy, fy, fy], -1)), g.concat([weights] * 4, -1)
    )
    inside = g.And(
        g.And(g.GreaterOrEqual(xs, g.scalar(0.0)), g.LessOrEqual(xs, g.scalar(w - 1.0))),
        g.And(g.GreaterOrEqual(ys, g.scalar(0.0)), g.LessOrEqual(ys, g.scalar(h - 1.0))),
    )
    tap_weights = g.Where(inside, tap_weights, g.scalar(0.0))  # (N, Q, heads, 4P); a tap outside reads zero
    column = g.Cast(g.Clip(xs, g.scalar(0.0), g.scalar(w - 1.0)), to=INT64)
    row = g.Cast(g.Clip(ys, g.scalar(0.0), g.scalar(h - 1.0)), to=INT64)
    first = (np.arange(sizes.batch)[:, None] * sizes.heads + np.arange(sizes.heads)) * sizes.length + start
    first = g.ints(first.reshape(sizes.batch, 1, sizes.heads, 1), "head_first")  # each (image, head)'s level
    sampled = g.Gather(values, g.Add(g.Add(g.Mul(row, g.ints(w)), column), first), axis=0)  # (N, Q, heads, 4P, C)
    return g.MatMul(g.unsqueeze(tap_weights, [3]), sampled)


def grid_sample_level(g: Graph, value: str, locations: str, weights: str, level: int, sizes: Sizes) -> str:
    """value (N, L, heads, C), locations (N, Q, heads, P, 2), attention weights (N, Q, heads, P) ->
    (N * heads, C, Q): the level's samples by GridSample, weighted and summed over the points."""
    (h, w, start), n_heads = sizes.levels[level], sizes.batch * sizes.heads
    level_value = g.transpose(g.slice(value, 1, start, start + h * w), (0, 2, 3, 1))  # (N, heads, C, hw)
    level_value = g.reshape(level_value, (n_heads, sizes.channels, h, w))
    grid = g.Sub(g.Mul(locations, g.scalar(2.0)), g.scalar(1.0))
    grid = g.reshape(g.transpose(grid, (0, 2, 1, 3, 4)), (n_heads, -1, sizes.points, 2))
    sampled = g.GridSample(level_value, grid, mode="bilinear", padding_mode="zeros", align_corners=0)
    weights = g.reshape(g.transpose(weights, (0, 2, 1, 3)), (n_heads, 1, -1, sizes.points))
    return g.ReduceSum(g.Mul(sampled, weights), g.ints([3], "axes"), keepdims=0)


def deformable_attention(
    g: Graph, prefix: str, query: str, reference: str, ref_dims: int, source: str, not_mask: str, sizes: Sizes
) -> str:
    """MSDeformAttn: query (N, Q, d), reference (N, Q, levels, 2|4), source (N, L, d), not_mask
    (N, L, 1) 1 on the image -> (N, Q, d)."""
    heads, levels, points, sampler = sizes.heads, len(sizes.levels), sizes.points, sizes.sampler
    value = g.Mul(g.linear(source, f"{prefix}.value_proj"), not_mask)  # zero on padding
    value = g.reshape(value, (sizes.batch, sizes.length, heads, sizes.channels))
    offsets = g.reshape(g.linear(query, f"{prefix}.sampling_offsets"), (sizes.batch, -1, heads, levels, points * 2))
    weights = g.Softmax(
        g.reshape(g.linear(query, f"{prefix}.attention_weights"), (sizes.batch, -1, heads, levels * points)),
        axis=-1,
    )
    weights = g.reshape(weights, (sizes.batch, -1, heads, levels, points))
    if sampler == "gather":
        values = g.reshape(g.transpose(value, (0, 2, 1, 3)), (-1, sizes.channels))  # (N * heads * L, C)
    sampled = []
    for level in range(levels):
        locations = sampling_locations(g, reference, ref_dims, offsets, level, sizes)
        level_weights = g.squeeze(g.slice(weights, 3, level, level + 1), [3])
        if sampler == "gather":
            sampled.append(gather_level(g, values, locations, level_weights, level, sizes))
        else:
            sampled.append(grid_sample_level(g, value, locations, level_weights, level, sizes))
    out = g.sum(sampled)
    if sampler == "gather":  # (N, Q, heads, 1, C)
        out = g.reshape(out, (sizes.batch, -1, heads * sizes.channels))
    else:  # (N * heads, C, Q)
        out = g.transpose(g.reshape(out, (sizes.batch, heads * sizes.channels, -1)), (0, 2, 1))
    return g.linear(out, f"{prefix}.output_proj")


def self_attention(g: Graph, prefix: str, query_key: str, value: str, d_model: int, heads: int, batch: int) -> str:
    """The decoder's torch.nn.MultiheadAttention (in_proj_weight: q, k, v stacked): (N, Q, d) -> (N, Q, d)."""
    weight, bias = g.weight(f"{prefix}.in_proj_weight"), g.weight(f"{prefix}.in_proj_bias")
    head_dim = d_model // heads

    def project(x, part):
        rows = slice(part * d_model, (part + 1) * d_model)
        projected = g.Add(
            g.MatMul(x, g.const(weight[rows].T, f"{prefix}.in_proj_{part}")),
            g.const(bias[rows], f"{prefix}.in_bias_{part}"),
        )
        return g.transpose(g.reshape(projected, (batch, -1, heads, head_dim)), (0, 2, 1, 3))

    q, k, v = project(query_key, 0), project(query_key, 1), project(value, 2)
    scores = g.MatMul(g.Mul(q, g.scalar(head_dim**-0.5)), g.transpose(k, (0, 1, 3, 2)))
    out = g.MatMul(g.Softmax(scores, axis=-1), v)  # (N, heads, Q, head_dim)
    out = g.reshape(g.transpose(out, (0, 2, 1, 3)), (batch, -1, d_model))
    return g.linear(out, f"{prefix}.out_proj")
