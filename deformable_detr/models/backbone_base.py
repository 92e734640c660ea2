"""`BackboneBase`: what every backbone is to the detector (models/backbones.py names them), whatever its
body: images in, feature maps with their padding masks out, and the strides and channels of those maps,
from which the detector builds its input projections. `resize_mask`: a padding mask at a map's size.

Channels-last: images (B, H, W, 3), features (B, h, w, C), masks (B, h, w) True on padding."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def resize_mask(mask: mx.array, height: int, width: int) -> mx.array:
    """Nearest resize of a (B, H, W) bool mask, as `F.interpolate(mode="nearest")`."""
    rows = nearest_indices(mask.shape[1], height)
    cols = nearest_indices(mask.shape[2], width)
    return mask[:, rows][:, :, cols]


def nearest_indices(size_in: int, size_out: int) -> mx.array:
    scale = np.float32(size_in) / np.float32(size_out)
    index = np.floor(np.arange(size_out, dtype=np.float32) * scale).astype(np.int32)
    return mx.array(np.minimum(index, size_in - 1))


class BackboneBase(nn.Module):
    """A body (under `body`: the parameter paths `backbone.0.body...` that checkpoints use) that returns
    its feature maps, finest first, at `strides` (default STRIDES) with `body.num_channels` channels; this
    returns [(features (B, h, w, C), mask (B, h, w))] of each, or of the last only (`return_interm_layers=False`:
    one feature level). The body has `activation_checkpointing` (recompute in the backward, recompute.py).
    A subclass builds its body and says which of it trains (`set_trainable`)."""

    STRIDES = (8, 16, 32)  # the body's maps, finest first: one input projection each (models/deformable_detr.py)

    def __init__(self, body: nn.Module, return_interm_layers: bool, strides: tuple[int, ...] | None = None):
        super().__init__()
        self.body = body
        self.return_interm_layers = return_interm_layers
        strides = list(strides or self.STRIDES)
        self.strides = strides if return_interm_layers else strides[-1:]
        self.num_channels = body.num_channels if return_interm_layers else body.num_channels[-1:]

    def set_trainable(self, train: bool, freeze_stem_and_layer1: bool = True):
        """Which parameters train: none (`train` False), or the backbone's choice (optimizer.py)."""
        raise NotImplementedError

    def __call__(self, images: mx.array, mask: mx.array):
        features = self.body(images)
        if not self.return_interm_layers:
            features = features[-1:]
        return [(x, resize_mask(mask, x.shape[1], x.shape[2])) for x in features]
