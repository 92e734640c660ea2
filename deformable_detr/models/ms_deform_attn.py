"""`MSDeformAttn`: the authors' multi-scale deformable attention module, on `kernels.ms_deform_attn`.

This is the only place the model's attention core is called; `kernels.softmax` (MLX's softmax, on
every CPU core) serves here and in the decoder's self-attention."""

import math

import kernels

import mlx.core as mx
import mlx.nn as nn

from .linear import Linear
from .precision import to, widened


class MSDeformAttn(nn.Module):
    """Each query attends to `n_points` sampled points per head and level around its reference point.

    Parameter names and initialisation follow the authors' `models/ops/modules/ms_deform_attn.py`.
    A `recorder` (attention_points.recording) is handed each call's sampling locations and weights.
    """

    recorder = None

    def __init__(self, d_model: int = 256, n_levels: int = 4, n_heads: int = 8, n_points: int = 4):
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"MSDeformAttn: d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.d_model, self.n_levels, self.n_heads, self.n_points = d_model, n_levels, n_heads, n_points
        self.sampling_offsets = Linear(d_model, n_heads * n_levels * n_points * 2)
        self.attention_weights = Linear(d_model, n_heads * n_levels * n_points)
        self.value_proj = Linear(d_model, d_model)
        self.output_proj = Linear(d_model, d_model)
        self.reset_parameters()

    def reset_parameters(self):
        # Offsets start as a ring of n_points at distances 1..n_points pixels in n_heads directions.
        thetas = mx.arange(self.n_heads, dtype=mx.float32) * (2.0 * math.pi / self.n_heads)
        grid = mx.stack([mx.cos(thetas), mx.sin(thetas)], -1)
        grid = grid / mx.abs(grid).max(-1, keepdims=True)  # (n_heads, 2), on the unit square
        scale = mx.arange(1, self.n_points + 1, dtype=mx.float32).reshape(1, 1, -1, 1)
        grid = mx.broadcast_to(grid.reshape(self.n_heads, 1, 1, 2), (self.n_heads, self.n_levels, self.n_points, 2))
        self.sampling_offsets.weight = mx.zeros_like(self.sampling_offsets.weight)
        self.sampling_offsets.bias = (grid * scale).reshape(-1)
        self.attention_weights.weight = mx.zeros_like(self.attention_weights.weight)
        self.attention_weights.bias = mx.zeros_like(self.attention_weights.bias)
        glorot = nn.init.glorot_uniform()
        for linear in (self.value_proj, self.output_proj):
            linear.weight = glorot(linear.weight)
            linear.bias = mx.zeros_like(linear.bias)

    def __call__(
        self,
        query,
        reference_points,
        input_flatten,
        spatial_shapes,
        level_start_index=None,
        padding_mask=None,
        residual=None,
    ):
        """query (B, Q, d), reference_points (B, Q, n_levels, 2) as (x, y) or (B, Q, n_levels, 4) as
        (cx, cy, w, h), all in [0, 1]; input_flatten (B, L, d) with L = sum(H * W) over
        spatial_shapes ((H, W) per level); padding_mask (B, L) True on padding. -> (B, Q, d), + `residual`
        (B, Q, d) where given: the layer's residual addition as output_proj's post-op."""
        b, q, _ = query.shape
        length = input_flatten.shape[1]
        heads, levels, points = self.n_heads, self.n_levels, self.n_points
        value = self.value_proj(input_flatten)
        if padding_mask is not None:
            # where(mask, 0, value): one pass on every CPU core each way, the mask read per token as it lies (MLX's
            # select and its gradient made four on one thread; masked_scale wanted the mask copied out per element)
            value = kernels.masked_rows(value, mx.logical_not(padding_mask)[..., None])
        value = value.reshape(b, length, heads, self.d_model // heads)
        # the sampling locations in float32 (bfloat16 would round them to 1/256 of a level's side)
        offsets = widened(self.sampling_offsets(query)).reshape(b, q, heads, levels, points, 2)
        weights = self.attention_weights(query).reshape(b, q, heads, levels * points)
        weights = kernels.softmax(weights).reshape(b, q, heads, levels, points)  # mx.softmax, faster on the CPU
        if reference_points.shape[-1] == 2:
            # reference + offsets / (w, h) of the level, on rows of levels x points x 2: MLX's broadcasts in
            # their natural shapes ran its strided loop over pairs (35 ms at 800 x 1066 against 9 ms)
            normalizer = mx.array([[w, h] for h, w in spatial_shapes], dtype=offsets.dtype)  # (levels, 2)
            divisor = mx.broadcast_to(normalizer[:, None, :], (levels, points, 2)).reshape(-1)
            centres = mx.broadcast_to(reference_points[:, :, :, None, :], (b, q, levels, points, 2))
            steps = offsets.reshape(b, q, heads, -1) / divisor
            locations = (centres.reshape(b, q, 1, -1) + steps).reshape(offsets.shape)
        elif reference_points.shape[-1] == 4:
            centre, size = reference_points[:, :, None, :, None, :2], reference_points[:, :, None, :, None, 2:]
            locations = centre + offsets / points * size * 0.5
        else:
            raise ValueError(
                f"MSDeformAttn: reference_points has shape {tuple(reference_points.shape)}; "
                f"expected (B, Q, {levels}, 2) or (B, Q, {levels}, 4)"
            )
        if self.recorder is not None:
            self.recorder(locations, weights, reference_points, spatial_shapes, padding_mask)
        out = kernels.ms_deform_attn(value, spatial_shapes, level_start_index, locations, weights)  # in float32
        return self.output_proj(to(out, value.dtype), residual=residual)
