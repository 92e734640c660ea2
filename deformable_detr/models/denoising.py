"""DINO's contrastive denoising queries (its `prepare_for_cdn`, github.com/IDEA-Research/DINO models/dino/
dn_components.py), made in NumPy from a batch's targets, at a fixed count: 2 x dn_number queries whatever the
targets, so that no step brings a new shape (DINO's count follows the batch's largest target list).

As DINO lays them out: `copies` groups (dn_number // the most targets an image has), each a positive copy of every
target (its label changed at random with probability label_noise_ratio / 2, its corners moved by up to
box_noise_scale of its half size) and a negative one (moved by 1 to 2 times that), each copy padded to `width` (the
most targets an image has) queries; the positives are assigned to the targets they copy, the negatives to none.
A group's queries see each other and the detector's queries; the detector's queries do not see them (the model's
attention plan, query_groups.py). Beyond DINO's 2 x copies x width queries, the rest of the fixed count only fill
the shape: they see themselves alone and no loss counts them (`counted`).

The noise is an input (`draw_noise`, or the draws DINO's code made, in its order), so a test gives ours DINO's."""

from dataclasses import dataclass

import numpy as np

from .matcher import FlatTargets

DINO_EPS = 1e-3  # DINO's inverse_sigmoid (util/misc.py), not the authors' 1e-5


def inverse_sigmoid(x: np.ndarray, eps: float = DINO_EPS) -> np.ndarray:
    x = np.clip(x, 0, 1)
    return np.log(np.maximum(x, eps) / np.maximum(1 - x, eps)).astype(np.float32)


def layout(targets: list[dict], dn_number: int) -> tuple[int, int]:
    """(copies, width): DINO's groups of a positive and a negative copy of every target, and each copy's queries
    per image (the most targets an image has); (0, 0) where no image has a target. An image's targets beyond
    dn_number are not copied (DINO's count would pass 2 x dn_number)."""
    most = min(max((len(t["labels"]) for t in targets), default=0), dn_number)
    if most == 0:
        return 0, 0
    return max(dn_number // most, 1), most


def noise_shapes(targets: list[dict], dn_number: int) -> int:
    """How many noised copies (positive and negative) of targets a batch draws: DINO's known_labels' length."""
    copies, width = layout(targets, dn_number)
    return 2 * copies * sum(min(len(t["labels"]), width) for t in targets)


def draw_noise(rng: np.random.Generator, targets, dn_number: int, num_classes: int, label_noise_ratio: float,
               box_noise_scale: float) -> dict:  # fmt: skip
    """DINO's draws for a batch, in its order, from `rng`: `label_p` (M,) uniform [0, 1) (a label is changed where
    it is under label_noise_ratio / 2), `new_label` (one a changed label, uniform in [0, num_classes)), `box_sign`
    (M, 4) of -1 or 1, `box_part` (M, 4) uniform [0, 1); M = noise_shapes(...). A draw DINO skips (a ratio or scale
    of 0) is absent."""
    m = noise_shapes(targets, dn_number)
    noise = {}
    if label_noise_ratio > 0:
        noise["label_p"] = rng.random(m, dtype=np.float32)
        chosen = int((noise["label_p"] < label_noise_ratio * 0.5).sum())
        noise["new_label"] = rng.integers(0, num_classes, chosen)
    if box_noise_scale > 0:
        noise["box_sign"] = (rng.integers(0, 2, (m, 4)) * 2 - 1).astype(np.float32)
        noise["box_part"] = rng.random((m, 4), dtype=np.float32)
    return noise


@dataclass
class DenoisingQueries:
    labels: np.ndarray  # (B, N) int32: each query's noised label, -1 where it holds none (its contents zero)
    positions: np.ndarray  # (B, N, 4) float32: its noised box, cx, cy, w, h in logit space (0 where none: DINO's)
    attention_mask: np.ndarray  # (N, N) float32 additive: 0 where a query may see another denoising query, -inf not
    counted: np.ndarray  # (N,) float32: 1 for DINO's queries, 0 for those that only fill the fixed count
    copies: int  # DINO's num_dn_group (0: no target in the batch)
    width: int  # each copy's queries (DINO's single_pad / 2... its per-copy padding: the most targets an image has)
    targets: list  # the batch's targets (labels, boxes), each image's cut to those copied

    def assigned(self) -> tuple[FlatTargets, np.ndarray]:
        """The known assignment: the positive copies' targets, flat, and the query of each (image by image, copy by
        copy, target by target: DINO's dn_pos_idx)."""
        repeated = [
            {"labels": np.tile(t["labels"], self.copies), "boxes": np.tile(t["boxes"], (self.copies, 1))}
            for t in self.targets
        ]
        queries = [
            (2 * self.width * np.arange(self.copies)[:, None] + np.arange(len(t["labels"]))[None]).reshape(-1)
            for t in self.targets
        ]
        query = np.concatenate(queries).astype(np.int32) if queries else np.zeros(0, np.int32)
        return FlatTargets(repeated), query


def denoising_queries(targets: list[dict], dn_number: int, noise: dict, label_noise_ratio: float,
                      box_noise_scale: float) -> DenoisingQueries:  # fmt: skip
    """The batch's denoising queries from its targets (per image `labels` (n,) int, `boxes` (n, 4) cx, cy, w, h
    normalised) and `noise` (draw_noise's, or DINO's draws)."""
    count, batch = 2 * dn_number, len(targets)
    copies, width = layout(targets, dn_number)
    kept = [
        {"labels": np.asarray(t["labels"], np.int64)[:width], "boxes": np.asarray(t["boxes"], np.float32)[:width]}
        for t in targets
    ]
    labels = np.full((batch, count), -1, np.int32)
    positions = np.zeros((batch, count, 4), np.float32)
    counted = np.zeros(count, np.float32)
    counted[: 2 * copies * width] = 1
    if copies:
        # DINO's known_* arrays: the batch's targets (image by image), repeated for each of the 2 x copies copies
        flat_labels = np.concatenate([t["labels"] for t in kept])
        flat_boxes = np.concatenate([t["boxes"] for t in kept]).reshape(-1, 4)
        image = np.concatenate([np.full(len(t["labels"]), i) for i, t in enumerate(kept)])
        within = np.concatenate([np.arange(len(t["labels"])) for t in kept])
        total = len(flat_labels)
        known_labels = np.tile(flat_labels, 2 * copies)
        known_boxes = np.tile(flat_boxes, (2 * copies, 1))
        if label_noise_ratio > 0:
            chosen = np.nonzero(noise["label_p"] < label_noise_ratio * 0.5)[0]
            known_labels[chosen] = noise["new_label"]
        if box_noise_scale > 0:
            negative = (np.arange(2 * copies)[:, None] % 2 == 1).repeat(total, 1).reshape(-1)
            corners = np.concatenate(
                [known_boxes[:, :2] - known_boxes[:, 2:] / 2, known_boxes[:, :2] + known_boxes[:, 2:] / 2], 1
            )
            half = np.concatenate([known_boxes[:, 2:] / 2, known_boxes[:, 2:] / 2], 1)
            part = noise["box_part"] + negative[:, None].astype(np.float32)
            part = part * noise["box_sign"]
            corners = np.clip(corners + part * half * np.float32(box_noise_scale), 0.0, 1.0)
            known_boxes = np.concatenate([(corners[:, :2] + corners[:, 2:]) / 2, corners[:, 2:] - corners[:, :2]], 1)
        copy = np.repeat(np.arange(2 * copies), total)
        query = copy * width + np.tile(within, 2 * copies)
        labels[np.tile(image, 2 * copies), query] = known_labels
        positions[np.tile(image, 2 * copies), query] = inverse_sigmoid(known_boxes.astype(np.float32))
    # who sees whom among the denoising queries: a group (a positive and a negative copy) its own; the filling
    # queries themselves alone
    group = np.arange(count) // (2 * width) if copies else np.arange(count)
    group = np.where(counted > 0, group, copies + np.arange(count))
    mask = np.where(group[:, None] == group[None, :], 0.0, -np.inf).astype(np.float32)
    return DenoisingQueries(labels, positions, mask, counted, copies, width, kept)
