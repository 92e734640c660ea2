"""Sine position encoding of a padded feature map, normalised to the unpadded extent."""

import math

import kernels

import mlx.core as mx
import mlx.nn as nn


class PositionEmbeddingSine(nn.Module):
    """(B, h, w) padding mask -> (B, h, w, 2 * num_pos_feats), channels [y features, x features].

    As the authors' (Deformable DETR's variant of DETR's): positions are pixel centres (cumsum - `offset`, 0.5)
    divided by the unpadded extent, times `scale`. DINO's (PositionEmbeddingSineHW): offset 0, temperature 20."""

    def __init__(
        self, num_pos_feats: int = 128, temperature: float = 10000, scale: float = 2 * math.pi, offset: float = 0.5
    ):
        super().__init__()
        self.num_pos_feats, self.temperature, self.scale, self.offset = num_pos_feats, temperature, scale, offset

    def __call__(self, mask: mx.array) -> mx.array:
        not_mask = (~mask).astype(mx.float32)
        y_embed = mx.cumsum(not_mask, axis=1)
        x_embed = mx.cumsum(not_mask, axis=2)
        eps = 1e-6
        y_embed = (y_embed - self.offset) / (y_embed[:, -1:, :] + eps) * self.scale
        x_embed = (x_embed - self.offset) / (x_embed[:, :, -1:] + eps) * self.scale
        return mx.concatenate(
            [
                sine_embedding(y_embed, self.num_pos_feats, self.temperature),
                sine_embedding(x_embed, self.num_pos_feats, self.temperature),
            ],
            axis=-1,
        )


def sine_embedding(positions: mx.array, num_feats: int, temperature: float) -> mx.array:
    """Each position p -> [sin(p / t_0), cos(p / t_0), sin(p / t_1), cos(p / t_1), ...] with
    t_i = temperature ** (2 * i / num_feats)."""
    # t_(2i) = t_(2i+1): one angle per pair, p / t_(2i), whose sine and cosine kernels.sin_cos takes
    # at once (the same bits as dividing by every t and taking sin of the even, cos of the odd)
    dim_t = mx.arange(num_feats // 2, dtype=mx.float32)
    dim_t = temperature ** (2 * dim_t / num_feats)
    angles = positions[..., None] / dim_t  # (..., num_feats / 2)
    return kernels.sin_cos(angles).reshape(*positions.shape, num_feats)
