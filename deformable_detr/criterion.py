"""`SetCriterion`: the authors' losses (sigmoid focal classification, L1 and GIoU boxes) on matched
predictions, for the last decoder layer, every auxiliary layer (`_0`.. suffixes) and the two-stage
encoder proposals (`_enc`)."""

import mlx.core as mx
import numpy as np

from .box_ops import box_cxcywh_to_xyxy, generalized_box_iou
from .matcher import HungarianMatcher


def sigmoid_focal_loss(logits, targets, num_boxes, alpha: float = 0.25, gamma: float = 2):
    """RetinaNet's focal loss, averaged over queries and summed over images, per target box."""
    prob = mx.sigmoid(logits)
    ce = mx.maximum(logits, 0) - logits * targets + mx.log1p(mx.exp(-mx.abs(logits)))  # BCE with logits
    p_t = prob * targets + (1 - prob) * (1 - targets)
    loss = ce * (1 - p_t) ** gamma
    if alpha >= 0:
        loss = (alpha * targets + (1 - alpha) * (1 - targets)) * loss
    return loss.mean(1).sum() / num_boxes


class SetCriterion:
    """`criterion(outputs, targets)` -> dict of scalar losses with the authors' names; the training
    loss is `sum(losses[k] * weight_dict[k] for k in weight_dict)`. `class_error` and
    `cardinality_error` are logged only (no gradient)."""

    def __init__(self, num_classes: int, matcher: HungarianMatcher, weight_dict: dict, focal_alpha: float = 0.25):
        self.num_classes, self.matcher = num_classes, matcher
        self.weight_dict, self.focal_alpha = weight_dict, focal_alpha

    def loss_labels(self, outputs, targets, indices, num_boxes, log=True):
        logits = outputs["pred_logits"]
        batch, query = _source_index(indices)
        matched_labels = np.concatenate(
            [np.asarray(t["labels"])[j] for t, (_, j) in zip(targets, indices, strict=True)]
        )
        onehot = np.zeros(logits.shape, dtype=np.float32)
        onehot[batch, query, matched_labels] = 1  # unmatched queries: all zeros (no object)
        loss_ce = sigmoid_focal_loss(logits, mx.array(onehot), num_boxes, self.focal_alpha, gamma=2) * logits.shape[1]
        losses = {"loss_ce": loss_ce}
        if log:
            if len(batch):
                predicted = mx.argmax(mx.stop_gradient(logits)[mx.array(batch), mx.array(query)], axis=-1)
                accuracy = (predicted == mx.array(matched_labels.astype(np.int32))).astype(mx.float32).mean() * 100
            else:
                accuracy = mx.array(100.0)
            losses["class_error"] = 100 - accuracy
        return losses

    def loss_cardinality(self, outputs, targets, indices, num_boxes):
        """Mean absolute error between the number of queries whose best class is not the last one
        (the authors' definition) and the number of targets."""
        logits = mx.stop_gradient(outputs["pred_logits"])
        predicted = (mx.argmax(logits, -1) != logits.shape[-1] - 1).sum(1).astype(mx.float32)
        counts = mx.array([len(t["labels"]) for t in targets], dtype=mx.float32)
        return {"cardinality_error": mx.abs(predicted - counts).mean()}

    def loss_boxes(self, outputs, targets, indices, num_boxes):
        batch, query = _source_index(indices)
        if len(batch) == 0:
            zero = (outputs["pred_boxes"] * 0).sum()
            return {"loss_bbox": zero, "loss_giou": zero}
        pred = outputs["pred_boxes"][mx.array(batch), mx.array(query)]
        target = mx.array(
            np.concatenate(
                [np.asarray(t["boxes"], dtype=np.float32)[j] for t, (_, j) in zip(targets, indices, strict=True)]
            )
        )
        loss_bbox = mx.abs(pred - target).sum() / num_boxes
        loss_giou = (1 - generalized_box_iou(box_cxcywh_to_xyxy(pred), box_cxcywh_to_xyxy(target))).sum() / num_boxes
        return {"loss_bbox": loss_bbox, "loss_giou": loss_giou}

    def get_losses(self, outputs, targets, indices, num_boxes, log=True):
        losses = self.loss_labels(outputs, targets, indices, num_boxes, log)
        losses.update(self.loss_cardinality(outputs, targets, indices, num_boxes))
        losses.update(self.loss_boxes(outputs, targets, indices, num_boxes))
        return losses

    def __call__(self, outputs: dict, targets: list[dict], num_boxes: float | None = None) -> dict:
        """`num_boxes`: the number of target boxes per process to normalise by (the authors average it
        across processes); default: this batch's count, at least 1."""
        if num_boxes is None:
            num_boxes = max(float(sum(len(t["labels"]) for t in targets)), 1.0)
        last = {k: outputs[k] for k in ("pred_logits", "pred_boxes")}
        losses = self.get_losses(last, targets, self.matcher(last, targets), num_boxes)
        for i, aux in enumerate(outputs.get("aux_outputs", [])):
            aux_losses = self.get_losses(aux, targets, self.matcher(aux, targets), num_boxes, log=False)
            losses.update({f"{k}_{i}": v for k, v in aux_losses.items()})
        if "enc_outputs" in outputs:  # proposals are class-agnostic: every target is class 0
            binary = [{"labels": np.zeros_like(np.asarray(t["labels"])), "boxes": t["boxes"]} for t in targets]
            enc = outputs["enc_outputs"]
            enc_losses = self.get_losses(enc, binary, self.matcher(enc, binary), num_boxes, log=False)
            losses.update({f"{k}_enc": v for k, v in enc_losses.items()})
        return losses

    def total(self, losses: dict) -> mx.array:
        """The weighted sum that training minimises."""
        return sum(losses[k] * w for k, w in self.weight_dict.items() if k in losses)


def _source_index(indices):
    batch = np.concatenate([np.full(len(src), i, dtype=np.int64) for i, (src, _) in enumerate(indices)])
    query = np.concatenate([src for src, _ in indices])
    return batch.astype(np.int32), query.astype(np.int32)


def build_criterion(cfg) -> SetCriterion:
    """The criterion a config describes, with the authors' weight_dict (aux and _enc suffixes)."""
    matcher = HungarianMatcher(
        cfg.matcher.set_cost_class, cfg.matcher.set_cost_bbox, cfg.matcher.set_cost_giou, alpha=cfg.loss.focal_alpha
    )
    base = {
        "loss_ce": cfg.loss.cls_loss_coef,
        "loss_bbox": cfg.loss.bbox_loss_coef,
        "loss_giou": cfg.loss.giou_loss_coef,
    }
    weight_dict = dict(base)
    if cfg.model.aux_loss:
        for i in range(cfg.model.dec_layers - 1):
            weight_dict.update({f"{k}_{i}": v for k, v in base.items()})
        weight_dict.update({f"{k}_enc": v for k, v in base.items()})
    return SetCriterion(cfg.model.num_classes, matcher, weight_dict, cfg.loss.focal_alpha)
