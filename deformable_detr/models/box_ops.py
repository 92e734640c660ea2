"""Box conversions and overlaps. Boxes are (..., 4): cx, cy, w, h or x0, y0, x1, y1."""

import mlx.core as mx


def box_cxcywh_to_xyxy(boxes: mx.array) -> mx.array:
    cx, cy, w, h = (boxes[..., i] for i in range(4))
    return mx.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], axis=-1)


def generalized_box_iou(boxes1: mx.array, boxes2: mx.array) -> mx.array:
    """Generalized IoU of x0, y0, x1, y1 boxes, elementwise with broadcasting: pass
    (N, 1, 4) and (1, M, 4) for the (N, M) matrix, or two (N, 4) for matched pairs."""
    area1 = (boxes1[..., 2] - boxes1[..., 0]) * (boxes1[..., 3] - boxes1[..., 1])
    area2 = (boxes2[..., 2] - boxes2[..., 0]) * (boxes2[..., 3] - boxes2[..., 1])
    top_left = mx.maximum(boxes1[..., :2], boxes2[..., :2])
    inter_wh = mx.maximum(mx.minimum(boxes1[..., 2:], boxes2[..., 2:]) - top_left, 0)
    inter = inter_wh[..., 0] * inter_wh[..., 1]
    union = area1 + area2 - inter
    hull_wh = mx.maximum(mx.maximum(boxes1[..., 2:], boxes2[..., 2:]) - mx.minimum(boxes1[..., :2], boxes2[..., :2]), 0)
    hull = hull_wh[..., 0] * hull_wh[..., 1]
    return inter / union - (hull - union) / hull
