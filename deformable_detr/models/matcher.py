"""Hungarian matching of predictions to targets, as the authors' `models/matcher.py`, computed as a
lazy MLX operation (`kernels.linear_assignment`) so that the loss needs no host synchronisation."""

from kernels import linear_assignment

import mlx.core as mx
import numpy as np

from .box_ops import box_cxcywh_to_xyxy, generalized_box_iou


class HungarianMatcher:
    """One-to-one assignment minimising cost_class * focal class cost + cost_bbox * L1 +
    cost_giou * (-GIoU)."""

    def __init__(
        self, cost_class: float = 2, cost_bbox: float = 5, cost_giou: float = 2, alpha: float = 0.25, gamma: float = 2.0
    ):
        if cost_class == 0 and cost_bbox == 0 and cost_giou == 0:
            raise ValueError("HungarianMatcher: all costs are 0")
        self.cost_class, self.cost_bbox, self.cost_giou = cost_class, cost_bbox, cost_giou
        self.alpha, self.gamma = alpha, gamma

    def __call__(self, outputs: dict, targets: "FlatTargets") -> mx.array:
        """outputs: `pred_logits` (B, Q, C), `pred_boxes` (B, Q, 4). Returns (T,) int32: the query
        matched to each target of the batch (targets in the order of `targets`)."""
        logits = mx.stop_gradient(outputs["pred_logits"])
        boxes = mx.stop_gradient(outputs["pred_boxes"])
        b, q = logits.shape[:2]
        prob = mx.sigmoid(logits.reshape(b * q, -1))
        neg = (1 - self.alpha) * prob**self.gamma * -mx.log(1 - prob + 1e-8)
        pos = self.alpha * (1 - prob) ** self.gamma * -mx.log(prob + 1e-8)
        cost_class = (pos - neg)[:, mx.array(targets.labels)]
        pred = boxes.reshape(b * q, 4)
        cost_bbox = mx.abs(pred[:, None] - targets.boxes[None]).sum(-1)
        cost_giou = -generalized_box_iou(box_cxcywh_to_xyxy(pred)[:, None], box_cxcywh_to_xyxy(targets.boxes)[None])
        cost = self.cost_bbox * cost_bbox + self.cost_class * cost_class + self.cost_giou * cost_giou
        return linear_assignment(cost.reshape(b, q, -1), targets.sizes)  # (B, Q, T) -> (T,)


class FlatTargets:
    """A batch's targets (per image `labels` (n,), `boxes` (n, 4) cx, cy, w, h) in one run:
    `labels` and `image` (T,) int32 numpy, `boxes` (T, 4) MLX, `sizes` per image."""

    def __init__(self, targets: list[dict], class_agnostic: bool = False):
        self.sizes = [len(t["labels"]) for t in targets]
        labels = [np.asarray(t["labels"], dtype=np.int32).reshape(-1) for t in targets]
        self.labels = np.concatenate(labels) if labels else np.zeros(0, np.int32)
        if class_agnostic:
            self.labels = np.zeros_like(self.labels)
        self.image = np.repeat(np.arange(len(targets), dtype=np.int32), self.sizes)
        boxes = [np.asarray(t["boxes"], dtype=np.float32).reshape(-1, 4) for t in targets]
        self.boxes = mx.array(np.concatenate(boxes) if boxes else np.zeros((0, 4), np.float32))

    def __len__(self) -> int:
        return len(self.labels)
