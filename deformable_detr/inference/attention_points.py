"""Where the model looks: the sampling points and attention weights of a deformable attention layer,
recorded on request and brought into the pixels of the original images (the paper's Figure 6).

Nothing is recorded unless `recording` is in effect: `MSDeformAttn` checks one attribute per call.

The model's locations are fractions of each level's padded feature map; divided by the level's
valid ratio they become fractions of the image itself, the frame the predicted boxes are in, and
multiplied by the original width and height, pixels."""

import contextlib
from dataclasses import dataclass

import numpy as np

from ..models.deformable_transformer import DeformableTransformer


@dataclass
class Sampled:
    """One call of `MSDeformAttn`: locations (B, Q, heads, levels, points, 2) x, y in [0, 1] of each
    level's padded map, weights (B, Q, heads, levels, points) after the softmax, reference points
    (B, Q, levels, 2 | 4) as given to the layer, the levels' (H, W) and the padding mask (B, L)."""

    locations: object
    weights: object
    reference_points: object
    spatial_shapes: tuple
    padding_mask: object


class Recorder:
    def __init__(self):
        self.calls: list[Sampled] = []

    def __call__(self, *fields):
        self.calls.append(Sampled(*fields))


def layer_index(layers: list, index: int, what: str) -> int:
    if not -len(layers) <= index < len(layers):
        raise ValueError(f"{what} layer {index} is out of range: the model has {len(layers)} (0 to {len(layers) - 1})")
    return index % len(layers)


@contextlib.contextmanager
def recording(model, decoder_layer: int | None = -1, encoder_layer: int | None = None):
    """Within the block, the model's calls of the chosen decoder layer's cross-attention and encoder
    layer's self-attention (None: not recorded) are kept: yields {"decoder": Recorder, "encoder": ...}."""
    recorders, modules = {}, []
    transformer = model.transformer
    for part, index, attribute in (("decoder", decoder_layer, "cross_attn"), ("encoder", encoder_layer, "self_attn")):
        if index is None:
            continue
        layers = getattr(transformer, part).layers
        module = getattr(layers[layer_index(layers, index, part)], attribute)
        recorders[part] = module.recorder = Recorder()
        modules.append(module)
    try:
        yield recorders
    finally:
        for module in modules:
            module.recorder = None


def valid_ratios(sampled: Sampled) -> np.ndarray:
    """(B, levels, 2): the unpadded fraction of each level's width and height, as the model computes it."""
    if sampled.padding_mask is None:
        return np.ones((sampled.locations.shape[0], len(sampled.spatial_shapes), 2), np.float32)
    b, ratios, start = sampled.padding_mask.shape[0], [], 0
    for h, w in sampled.spatial_shapes:
        mask = sampled.padding_mask[:, start : start + h * w].reshape(b, h, w)
        ratios.append(np.array(DeformableTransformer.valid_ratios(mask)))
        start += h * w
    return np.stack(ratios, 1)


def in_pixels(sampled: Sampled, image: int, width: int, height: int, queries=None) -> dict:
    """Image `image` of the batch, whose original size is `width` x `height`: the chosen queries' (all
    by default) "points" (Q, heads, levels, points, 2) and "reference" (Q, 2) x, y in pixels,
    "weights" (Q, heads, levels, points), and for box references "box" (Q, 4) x0, y0, x1, y1."""
    queries = slice(None) if queries is None else np.asarray(queries)
    ratios = valid_ratios(sampled)[image]  # (levels, 2)
    size = np.array([width, height], np.float32)
    points = np.array(sampled.locations[image])[queries] / ratios[None, None, :, None, :] * size
    reference = np.array(sampled.reference_points[image])[queries][:, 0]  # every level's is the same point
    result = {
        "points": points,
        "weights": np.array(sampled.weights[image])[queries],
        "reference": reference[:, :2] / ratios[0] * size,
    }
    if reference.shape[-1] == 4:
        centre, extent = reference[:, :2] / ratios[0] * size, reference[:, 2:] / ratios[0] * size
        result["box"] = np.concatenate([centre - extent / 2, centre + extent / 2], -1)
    return result


def encoder_queries(sampled: Sampled, image: int, x: float, y: float, width: int, height: int) -> list[int]:
    """The encoder's query at pixel (x, y) of the original image on each level: the index, into the
    flattened levels, of the unpadded cell that covers it."""
    if not (0 <= x < width and 0 <= y < height):
        raise ValueError(f"pixel ({x:g}, {y:g}) is outside the image ({width} x {height} pixels)")
    ratios, indices, start = valid_ratios(sampled)[image], [], 0
    for (h, w), (ratio_w, ratio_h) in zip(sampled.spatial_shapes, ratios, strict=True):
        valid_w, valid_h = round(float(ratio_w) * w), round(float(ratio_h) * h)
        column = min(int(x / width * valid_w), valid_w - 1)
        row = min(int(y / height * valid_h), valid_h - 1)
        indices.append(start + row * w + column)
        start += h * w
    return indices
