"""Box conversions and overlaps. Boxes are (..., 4): cx, cy, w, h or x0, y0, x1, y1."""

import mlx.core as mx


def box_cxcywh_to_xyxy(boxes: mx.array) -> mx.array:
    cx, cy, w, h = (boxes[..., i] for i in range(4))
    return mx.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], axis=-1)


def box_xyxy_to_cxcywh(boxes: mx.array) -> mx.array:
    x0, y0, x1, y1 = (boxes[..., i] for i in range(4))
    return mx.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], axis=-1)
