"""Hungarian matching of predictions to targets (scipy's `linear_sum_assignment` on the CPU)."""

import mlx.core as mx
import numpy as np
from scipy.optimize import linear_sum_assignment

from .box_ops import box_cxcywh_to_xyxy, generalized_box_iou


class HungarianMatcher:
    """One-to-one assignment minimising cost_class * focal class cost + cost_bbox * L1 +
    cost_giou * (-GIoU), as the authors' `models/matcher.py`."""

    def __init__(
        self, cost_class: float = 2, cost_bbox: float = 5, cost_giou: float = 2, alpha: float = 0.25, gamma: float = 2.0
    ):
        if cost_class == 0 and cost_bbox == 0 and cost_giou == 0:
            raise ValueError("HungarianMatcher: all costs are 0")
        self.cost_class, self.cost_bbox, self.cost_giou = cost_class, cost_bbox, cost_giou
        self.alpha, self.gamma = alpha, gamma

    def __call__(self, outputs: dict, targets: list[dict]) -> list[tuple[np.ndarray, np.ndarray]]:
        """outputs: `pred_logits` (B, Q, C), `pred_boxes` (B, Q, 4); targets: per image `labels` (n,)
        and `boxes` (n, 4) cx, cy, w, h. Returns per image (query indices, target indices)."""
        logits = mx.stop_gradient(outputs["pred_logits"])
        boxes = mx.stop_gradient(outputs["pred_boxes"])
        b, q = logits.shape[:2]
        sizes = [len(t["labels"]) for t in targets]
        if sum(sizes) == 0:
            return [(np.zeros(0, np.int64), np.zeros(0, np.int64)) for _ in targets]
        labels = mx.array(np.concatenate([np.asarray(t["labels"]) for t in targets]).astype(np.int32))
        target_boxes = mx.concatenate([mx.array(np.asarray(t["boxes"], dtype=np.float32)) for t in targets])

        prob = mx.sigmoid(logits.reshape(b * q, -1))
        neg = (1 - self.alpha) * prob**self.gamma * -mx.log(1 - prob + 1e-8)
        pos = self.alpha * (1 - prob) ** self.gamma * -mx.log(prob + 1e-8)
        cost_class = (pos - neg)[:, labels]
        pred = boxes.reshape(b * q, 4)
        cost_bbox = mx.abs(pred[:, None] - target_boxes[None]).sum(-1)
        cost_giou = -generalized_box_iou(box_cxcywh_to_xyxy(pred)[:, None], box_cxcywh_to_xyxy(target_boxes)[None])
        cost = self.cost_bbox * cost_bbox + self.cost_class * cost_class + self.cost_giou * cost_giou
        cost = np.array(cost.reshape(b, q, -1))

        indices, start = [], 0
        for i, n in enumerate(sizes):
            rows, cols = linear_sum_assignment(cost[i, :, start : start + n])
            indices.append((rows.astype(np.int64), cols.astype(np.int64)))
            start += n
        return indices
