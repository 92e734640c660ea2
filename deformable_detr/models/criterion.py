"""`SetCriterion`: the authors' losses (sigmoid focal classification, L1 and GIoU boxes) on matched
predictions, for the last decoder layer, every auxiliary layer (`_0`.. suffixes) and the two-stage
encoder proposals (`_enc`); with H-Deformable-DETR's hybrid branch, the same for its queries against the
targets repeated k times (`_one2many`, weighted by lambda: their `train_hybrid`)."""

import mlx.core as mx
import numpy as np

from .box_ops import box_cxcywh_to_xyxy, generalized_box_iou
from .matcher import FlatTargets, HungarianMatcher


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

    def __init__(
        self,
        num_classes: int,
        matcher: HungarianMatcher,
        weight_dict: dict,
        focal_alpha: float = 0.25,
        k_one2many: int = 6,
        lambda_one2many: float = 1.0,
    ):
        self.num_classes, self.matcher = num_classes, matcher
        self.weight_dict, self.focal_alpha = weight_dict, focal_alpha
        self.k_one2many, self.lambda_one2many = k_one2many, lambda_one2many

    def loss_labels(self, outputs, targets: FlatTargets, query, num_boxes, log=True):
        logits = outputs["pred_logits"]
        b, q, c = logits.shape
        onehot = mx.zeros((b * q * c,), dtype=logits.dtype)  # unmatched queries: all zeros (no object)
        if len(targets):
            labels = mx.array(targets.labels)
            matched = (mx.array(targets.image) * q + query) * c + labels
            onehot = onehot.at[matched].add(1)
        loss_ce = sigmoid_focal_loss(logits, onehot.reshape(b, q, c), num_boxes, self.focal_alpha, gamma=2) * q
        losses = {"loss_ce": loss_ce}
        if log:
            if len(targets):
                predicted = mx.argmax(mx.stop_gradient(logits)[mx.array(targets.image), query], axis=-1)
                accuracy = (predicted == labels).astype(mx.float32).mean() * 100
            else:
                accuracy = mx.array(100.0)
            losses["class_error"] = 100 - accuracy
        return losses

    def loss_cardinality(self, outputs, targets: FlatTargets, query, num_boxes):
        """Mean absolute error between the number of queries whose best class is not the last one
        (the authors' definition) and the number of targets."""
        logits = mx.stop_gradient(outputs["pred_logits"])
        predicted = (mx.argmax(logits, -1) != logits.shape[-1] - 1).sum(1).astype(mx.float32)
        counts = mx.array(targets.sizes, dtype=mx.float32)
        return {"cardinality_error": mx.abs(predicted - counts).mean()}

    def loss_boxes(self, outputs, targets: FlatTargets, query, num_boxes):
        if len(targets) == 0:
            zero = (outputs["pred_boxes"] * 0).sum()
            return {"loss_bbox": zero, "loss_giou": zero}
        pred = outputs["pred_boxes"][mx.array(targets.image), query]
        loss_bbox = mx.abs(pred - targets.boxes).sum() / num_boxes
        giou = generalized_box_iou(box_cxcywh_to_xyxy(pred), box_cxcywh_to_xyxy(targets.boxes))
        return {"loss_bbox": loss_bbox, "loss_giou": (1 - giou).sum() / num_boxes}

    def get_losses(self, outputs, targets: FlatTargets, num_boxes, log=True):
        """The losses of one set of predictions, matched to `targets` first."""
        query = self.matcher(outputs, targets) if len(targets) else None  # (T,): the query of each target
        losses = self.loss_labels(outputs, targets, query, num_boxes, log)
        losses.update(self.loss_cardinality(outputs, targets, query, num_boxes))
        losses.update(self.loss_boxes(outputs, targets, query, num_boxes))
        return losses

    def __call__(self, outputs: dict, targets: list[dict], num_boxes: float | None = None) -> dict:
        """`num_boxes`: the number of target boxes per process (the authors average it across
        processes); default: this batch's count. The losses are divided by it, at least 1 (the hybrid
        branch's by k times it). Nothing is evaluated: the matching is a lazy operation of the graph."""
        if num_boxes is None:
            num_boxes = float(sum(len(t["labels"]) for t in targets))
        losses = self.set_losses(outputs, targets, max(num_boxes, 1.0))
        if "one2many" in outputs:
            k = self.k_one2many
            repeated = [{"labels": np.tile(t["labels"], k), "boxes": np.tile(t["boxes"], (k, 1))} for t in targets]
            branch = self.set_losses(outputs["one2many"], repeated, max(k * num_boxes, 1.0))
            losses.update({f"{key}_one2many": value * self.lambda_one2many for key, value in branch.items()})
        return losses

    def set_losses(self, outputs: dict, targets: list[dict], num_boxes: float) -> dict:
        """The losses of one set of queries: its last layer, its aux layers and the encoder's proposals."""
        flat = FlatTargets(targets)
        last = {k: outputs[k] for k in ("pred_logits", "pred_boxes")}
        losses = self.get_losses(last, flat, num_boxes)
        for i, aux in enumerate(outputs.get("aux_outputs", [])):
            aux_losses = self.get_losses(aux, flat, num_boxes, log=False)
            losses.update({f"{k}_{i}": v for k, v in aux_losses.items()})
        if "enc_outputs" in outputs:  # proposals are class-agnostic: every target is class 0
            enc_losses = self.get_losses(outputs["enc_outputs"], FlatTargets(targets, True), num_boxes, log=False)
            losses.update({f"{k}_enc": v for k, v in enc_losses.items()})
        return losses

    def total(self, losses: dict) -> mx.array:
        """The weighted sum that training minimises."""
        return sum(losses[k] * w for k, w in self.weight_dict.items() if k in losses)


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
    if cfg.model.num_queries_one2many:  # the branch's terms, as weighted as the others (lambda is in them)
        weight_dict.update({f"{k}_one2many": v for k, v in weight_dict.items() if not k.endswith("_enc")})
    loss = cfg.loss
    return SetCriterion(
        cfg.model.num_classes, matcher, weight_dict, loss.focal_alpha, loss.k_one2many, loss.lambda_one2many
    )
