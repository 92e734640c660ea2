"""`BackboneBase`: what every backbone is to the detector (models/backbones.py names them), whatever its
body: images in, feature maps with their padding masks out, and the strides and channels of those maps,
from which the detector builds its input projections; `stages_returned`: which of a four-stage body's maps a
backbone of 1, 3 or 4 maps has it return. `resize_mask`: a padding mask at a map's size.

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


# A four-stage body's maps (ResNet's layer1..layer4, Swin's stages 0..3), finest first: their strides, and the
# stages whose maps a backbone of 1, 3 or 4 maps (models/backbones.maps_taken) has its body return. With one
# map the body still computes stages 1..3, as the authors' and HDETR's do (Swin's norm1 and norm2 are
# parameters of theirs), and the last is taken; with 4, stage 0 too (DINO's 5-scale, its return_interm_indices).
STAGE_STRIDES = (4, 8, 16, 32)
STAGES = {1: (1, 2, 3), 3: (1, 2, 3), 4: (0, 1, 2, 3)}


def stages_returned(maps: int) -> tuple[int, ...]:
    """The body's stages (0..3) whose maps a backbone of `maps` maps (1, 3 or 4) has its body return."""
    if maps not in STAGES:
        raise ValueError(f"a backbone returns 1, 3 or 4 maps, not {maps}")
    return STAGES[maps]


class BackboneBase(nn.Module):
    """A body (under `body`: the parameter paths `backbone.0.body...` that checkpoints use) that returns
    its feature maps, finest first, at `strides` with `body.num_channels` channels; this returns
    [(features (B, h, w, C), mask (B, h, w))] of its last `maps` (1: one feature level; 3: strides 8, 16, 32;
    4: and stride 4). The body has `activation_checkpointing` (recompute in the backward, recompute.py).
    A subclass builds its body and says which of it trains (`set_trainable`)."""

    STRIDES = STAGE_STRIDES[1:]  # 3 maps' (maps_taken's auto with more than one level): one input projection each

    def __init__(self, body: nn.Module, maps: int, strides: tuple[int, ...]):
        super().__init__()
        if len(strides) != len(body.num_channels) or not 1 <= maps <= len(strides):
            raise ValueError(f"{maps} maps of a body that returns {len(body.num_channels)}, at strides {strides}")
        self.body = body
        self.maps = maps
        self.strides = list(strides[-maps:])
        self.num_channels = body.num_channels[-maps:]

    def set_trainable(self, train: bool, freeze_stem_and_layer1: bool = True):
        """Which parameters train: none (`train` False), or the backbone's choice (optimizer.py)."""
        raise NotImplementedError

    def __call__(self, images: mx.array, mask: mx.array):
        features = self.body(images)[-self.maps :]
        return [(x, resize_mask(mask, x.shape[1], x.shape[2])) for x in features]
