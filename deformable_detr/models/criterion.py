"""`SetCriterion`: the authors' losses (sigmoid focal classification, L1 and GIoU boxes) on matched
predictions, for the last decoder layer, every auxiliary layer (`_0`.. suffixes) and the two-stage
encoder proposals (`_enc`); for each further query group the same for its queries as it assigns them: H-Deformable-
DETR's hybrid branch against the targets repeated k times (`_one2many`, weighted by lambda: their `train_hybrid`),
DINO's denoising copies against the targets they copy (`_dn`: its SetCriterion's dn losses)."""

import mlx.core as mx
import numpy as np

from .box_ops import box_cxcywh_to_xyxy, generalized_box_iou
from .matcher import FlatTargets, HungarianMatcher
from .query_groups import REPEATED, query_groups


def sigmoid_focal_loss(logits, targets, num_boxes, alpha: float = 0.25, gamma: float = 2, counted=None):
    """RetinaNet's focal loss, averaged over queries and summed over images, per target box; `counted` (Q,): the
    queries whose loss counts (the mean still over all Q)."""
    prob = mx.sigmoid(logits)
    ce = mx.maximum(logits, 0) - logits * targets + mx.log1p(mx.exp(-mx.abs(logits)))  # BCE with logits
    p_t = prob * targets + (1 - prob) * (1 - targets)
    loss = ce * (1 - p_t) ** gamma
    if alpha >= 0:
        loss = (alpha * targets + (1 - alpha) * (1 - targets)) * loss
    if counted is not None:
        loss = loss * counted[None, :, None]
    return loss.mean(1).sum() / num_boxes


class SetCriterion:
    """`criterion(outputs, targets)` -> dict of scalar losses with the authors' names; the training
    loss is `sum(losses[k] * weight_dict[k] for k in weight_dict)`. `class_error` and
    `cardinality_error` are logged only (no gradient). `groups`: the model's query groups (query_groups.py): the
    first's predictions are the outputs, each other's under its name, assigned to the targets as the group says and
    its losses named with its suffix and weighed by its weight. `class_agnostic_proposals`: the encoder's proposals
    matched as one class (the authors'), or by class (DINO's)."""

    def __init__(
        self,
        num_classes: int,
        matcher: HungarianMatcher,
        weight_dict: dict,
        focal_alpha: float = 0.25,
        groups: tuple = (),
        class_agnostic_proposals: bool = True,
    ):
        self.num_classes, self.matcher = num_classes, matcher
        self.weight_dict, self.focal_alpha = weight_dict, focal_alpha
        self.groups, self.class_agnostic_proposals = groups, class_agnostic_proposals

    def loss_labels(self, outputs, targets: FlatTargets, query, num_boxes, log=True, counted=None):
        """`counted`: None, or (Q,) 1 for the queries whose loss counts, 0 for those only there to fix the shape."""
        logits = outputs["pred_logits"]
        b, q, c = logits.shape
        onehot = mx.zeros((b * q * c,), dtype=logits.dtype)  # unmatched queries: all zeros (no object)
        if len(targets):
            labels = mx.array(targets.labels)
            matched = (mx.array(targets.image) * q + query) * c + labels
            onehot = onehot.at[matched].add(1)
        onehot = onehot.reshape(b, q, c)
        if counted is None:
            loss_ce = sigmoid_focal_loss(logits, onehot, num_boxes, self.focal_alpha, gamma=2) * q
        else:  # the same sum, over the counted queries alone
            loss_ce = sigmoid_focal_loss(logits, onehot, num_boxes, self.focal_alpha, 2, counted) * q
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

    def __call__(self, outputs: dict, targets: list[dict], num_boxes: float | None = None, denoising=None) -> dict:
        """`num_boxes`: the number of target boxes per process (the authors average it across
        processes); default: this batch's count. The losses are divided by it, at least 1 (the hybrid
        branch's by k times it, the denoising's by its copies times it). `denoising`: the DenoisingQueries the
        model was given (models/denoising.py), whose known assignment the denoising group's losses take.
        Nothing is evaluated: the matching is a lazy operation of the graph."""
        if num_boxes is None:
            num_boxes = float(sum(len(t["labels"]) for t in targets))
        losses = self.set_losses(outputs, targets, max(num_boxes, 1.0))
        for group in self.groups[1:]:
            if group.name not in outputs:
                continue
            if group.assignment == REPEATED:
                k = group.repeats
                repeated = [{"labels": np.tile(t["labels"], k), "boxes": np.tile(t["boxes"], (k, 1))} for t in targets]
                branch = self.set_losses(outputs[group.name], repeated, max(k * num_boxes, 1.0))
            else:  # KNOWN: each query the copy of a target
                branch = self.known_losses(outputs[group.name], denoising, max(num_boxes, 1.0))
            losses.update({f"{key}{group.loss_suffix}": value * group.loss_weight for key, value in branch.items()})
        return losses

    def set_losses(self, outputs: dict, targets: list[dict], num_boxes: float) -> dict:
        """The losses of one set of queries: its last layer, its aux layers and the encoder's proposals."""
        flat = FlatTargets(targets)
        last = {k: outputs[k] for k in ("pred_logits", "pred_boxes")}
        losses = self.get_losses(last, flat, num_boxes)
        for i, aux in enumerate(outputs.get("aux_outputs", [])):
            aux_losses = self.get_losses(aux, flat, num_boxes, log=False)
            losses.update({f"{k}_{i}": v for k, v in aux_losses.items()})
        if "enc_outputs" in outputs:  # the authors' proposals are class-agnostic: every target is class 0
            proposal_targets = FlatTargets(targets, self.class_agnostic_proposals)
            enc_losses = self.get_losses(outputs["enc_outputs"], proposal_targets, num_boxes, log=False)
            losses.update({f"{k}_enc": v for k, v in enc_losses.items()})
        return losses

    def known_losses(self, outputs: dict, denoising, num_boxes: float) -> dict:
        """DINO's denoising losses: every layer's positive copies against the targets they copy (their noised
        labels and boxes reconstructed), every counted query's class against none but its own target's; divided
        by the copies times the boxes (DINO's num_boxes * scalar)."""
        flat, query = denoising.assigned()
        query = mx.array(query)
        counted = mx.array(denoising.counted)
        num_boxes = num_boxes * max(denoising.copies, 1)  # no copies (no targets): every term 0, as DINO's
        losses = {}
        for i, layer in enumerate([*outputs.get("aux_outputs", []), outputs]):
            suffix = "" if i == len(outputs.get("aux_outputs", [])) else f"_{i}"
            layer_losses = self.loss_labels(layer, flat, query, num_boxes, log=False, counted=counted)
            layer_losses.update(self.loss_boxes(layer, flat, query, num_boxes))
            losses.update({f"{k}{suffix}": v for k, v in layer_losses.items()})
        return losses

    def total(self, losses: dict) -> mx.array:
        """The weighted sum that training minimises."""
        return sum(losses[k] * w for k, w in self.weight_dict.items() if k in losses)


def build_criterion(cfg) -> SetCriterion:
    """The criterion a config describes, with the authors' weight_dict (aux and _enc suffixes); each further query
    group's terms weighed as the detector's (its own weight is in them)."""
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
    groups = query_groups(cfg.model, cfg.loss)
    detector = dict(weight_dict)
    for group in groups[1:]:
        weight_dict.update({f"{k}{group.loss_suffix}": v for k, v in detector.items() if not k.endswith("_enc")})
    return SetCriterion(
        cfg.model.num_classes,
        matcher,
        weight_dict,
        cfg.loss.focal_alpha,
        groups,
        class_agnostic_proposals=cfg.model.architecture != "dino",
    )
