"""What every exporter checks: the canvas and batch it is asked for (in one line each), and its own
file against the MLX model on random images before the file is in place (`differences`, run by each
exporter's `compare` with its own runtime).

Its images: random pixels at about 3/4 x 4/5 of the canvas (so with padding on both sides), each
image of a batch its own size. Two-stage queries whose proposals score within TOLERANCE of a neighbour's
(`swappable_queries`) are left out, as another runtime's rounding may rank them either way, and the summary
says how many were compared; post-processed detections are matched by what they are, not by their rank
(`detection_difference`)."""

from kernels import linear_assignment

import mlx.core as mx
import numpy as np

from ..errors import UsageError
from ..models import post_process
from ..models.backbones import maps_taken

# Of the largest value (logits, boxes, scores): a wrong export is off by far more; float32 rounding
# (folded batch norm, other summation orders) reached 4.7e-5 on R50 with random weights (the tests:
# 5e-7 on small models, asserted to 1e-4).
TOLERANCE = 1e-3


def detections_kept(m, top_k: int) -> int:
    """How many detections a post-processed export gives an image: the best `top_k` (query, class) pairs of the
    model section `m`'s, or every pair where there are fewer (as post_process)."""
    return min(top_k, m.num_queries * m.num_classes)


def kept_in_words(m, top_k: int) -> str:
    """What an export's summary says of its post-processing."""
    return f"it keeps an image's best {detections_kept(m, top_k)} (query, class) pairs (evaluation.top_k {top_k})"


def conv_size(size: int, kernel: int, stride: int, padding: int, dilation: int = 1) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def level_sizes(cfg, canvas: tuple) -> list:
    """[(h, w)] of every feature level on the canvas: the backbone's maps taken (strides 8, 16, 32, 16 with DC5; 4
    before them with 4 maps), or the last only, then the extra levels' 3x3 stride-2 convolutions (each strided
    convolution rounds up)."""
    strides = [4, 8, 16, 16 if cfg.dilation else 32][-maps_taken(cfg) :]
    sizes = [tuple(-(-side // stride) for side in canvas) for stride in strides]
    while len(sizes) < cfg.num_feature_levels:
        sizes.append(tuple(conv_size(side, 3, 2, 1) for side in sizes[-1]))
    return sizes


def check_canvas(cfg, canvas: tuple, batch: int):
    """The canvas and batch size an exporter is asked for, refused in one line where they cannot be."""
    if min(canvas) < 1 or batch < 1:
        raise UsageError(f"--size {canvas[0]} {canvas[1]} --batch-size {batch}: each must be at least 1")
    tokens = sum(h * w for h, w in level_sizes(cfg, canvas))
    if cfg.two_stage and cfg.num_queries > tokens:
        raise UsageError(
            f"--size {canvas[0]} {canvas[1]}: two-stage takes the top {cfg.num_queries} of the encoder's proposals, "
            f"and this canvas gives {tokens}; export on a larger canvas"
        )


def check_images(canvas: tuple, batch: int, seed: int = 0) -> tuple:
    """-> (images (N, H, W, 3) normalised, zero on padding; mask (N, H, W) True on padding)."""
    rng = np.random.default_rng(seed)
    images = np.zeros((batch, *canvas, 3), np.float32)
    mask = np.ones((batch, *canvas), bool)
    for i in range(batch):
        h = max(1, round(canvas[0] * (0.75 - 0.1 * (i % 3))))
        w = max(1, round(canvas[1] * (0.8 - 0.15 * (i % 2))))
        images[i, :h, :w] = rng.standard_normal((h, w, 3))
        mask[i, :h, :w] = False
    return images, mask


def relative_difference(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / max(np.abs(ours).max(), 1e-12))


def swappable_queries(model, outputs: dict) -> np.ndarray:
    """(B, Q) True for the two-stage queries whose proposal another runtime may rank in another place: a neighbour
    in the model's ranking scores within TOLERANCE (of the largest score) of it, at another box. A query takes
    nothing of its proposal but the box (the authors' contents and positions are made from it; H-Deformable-DETR's
    and DINO's positions, their contents learnt by place), so proposals at one box (the padding's) swap harmlessly;
    float32's rounding in another runtime swaps near ties (DINO's 900 best of 91 classes' scores on random images:
    gaps of 1e-4 swapped). DINO's enc_outputs hold the chosen proposals only: the next one unseen, its last query
    counts as swappable."""
    batch, count = outputs["pred_logits"].shape[:2]
    swappable = np.zeros((batch, count), bool)
    if "enc_outputs" not in outputs:
        return swappable
    scores = np.array(model.transformer.proposal_score(outputs["enc_outputs"]["pred_logits"]))  # (B, proposals)
    order = np.argsort(-scores, axis=1, kind="stable")[:, : count + 1]  # the model's ranking, and the next
    scores = np.take_along_axis(scores, order, 1)
    boxes = np.take_along_axis(np.array(outputs["enc_outputs"]["pred_boxes"]), order[..., None], 1)
    near = np.abs(np.diff(scores, axis=1)) <= TOLERANCE * np.abs(scores).max()
    near &= np.abs(np.diff(boxes, axis=1)).max(-1) > 0  # (B, ranked - 1): the proposals ranked k and k + 1 may swap
    pairs = min(count, near.shape[1])
    swappable[:, 1:] |= near[:, : count - 1]
    swappable[:, :pairs] |= near[:, :pairs]
    if scores.shape[1] == count:
        swappable[:, -1] = True
    return swappable


def detection_difference(every_pair: dict, theirs: dict, image: int, swappable: np.ndarray) -> tuple:
    """`image`'s detections in a post-processed file (`theirs`: scores, labels, boxes by image) against ours
    (`every_pair`: post_process's every (query, class) pair of the image), each detection by what it is, not by its
    rank (near scores swap ranks between runtimes, near duplicates places): one to one (linear_assignment), each to a
    pair of ours of its label within TOLERANCE in score and box, or, at most as many as their pairs, to a `swappable`
    query's (swappable_queries: another runtime may have given it another proposal); every pair of ours but those,
    scored above the file's last detection by more than TOLERANCE, must be one of them. -> (the largest difference of
    the scores and of the boxes of the pairs matched, relative to the largest of ours, inf where a detection is
    unexplained or missing; the detections matched to pairs)."""
    scores, labels, boxes = (np.asarray(theirs[name][image]) for name in ("scores", "labels", "boxes"))
    pair_scores, pair_labels = np.array(every_pair["scores"]), np.array(every_pair["labels"])
    pair_boxes, queries = np.array(every_pair["boxes"]), np.array(every_pair["queries"])
    score_scale, box_scale = np.abs(pair_scores).max(), max(np.abs(pair_boxes).max(), 1e-12)
    candidate = (pair_scores >= scores.min() - TOLERANCE * score_scale) & ~swappable[queries]
    expected = (pair_scores > scores.min() + TOLERANCE * score_scale)[candidate]
    pair_scores, pair_labels, pair_boxes = pair_scores[candidate], pair_labels[candidate], pair_boxes[candidate]
    classes = len(every_pair["scores"]) // len(swappable)
    others = min(len(scores), int(swappable.sum()) * classes)  # detections a swappable query's pairs may explain
    if len(pair_scores) + others < len(scores):
        return float("inf"), 0
    score_gap = np.abs(pair_scores[:, None] - scores[None]) / score_scale  # (pairs, detections)
    box_gap = np.abs(pair_boxes[:, None] - boxes[None]).max(-1) / box_scale
    close = (pair_labels[:, None] == labels[None]) & (score_gap <= TOLERANCE) & (box_gap <= TOLERANCE)
    # cost: a pair expected in the file -1, any other 0, a swappable query's +1, nearer by up to 0.02; else 1000
    nearer = 0.01 * (score_gap + box_gap) / max(TOLERANCE, 1e-12)
    cost = np.where(close, nearer - expected[:, None], 1000.0)
    cost = np.concatenate([cost, np.ones((others, len(scores)))])
    matched = np.array(linear_assignment(mx.array(cost[None].astype(np.float32)), [len(scores)]))
    to_pair = matched < len(pair_scores)
    if (cost[matched, np.arange(len(scores))] >= 1000).any() or not np.isin(np.nonzero(expected)[0], matched).all():
        return float("inf"), int(to_pair.sum())
    rows, columns = matched[to_pair], np.nonzero(to_pair)[0]
    worst = max(score_gap[rows, columns].max(initial=0), box_gap[rows, columns].max(initial=0))
    return float(worst), len(rows)


def differences(model, canvas: tuple, batch: int, postprocess: bool, run, top_k: int = 100) -> tuple:
    """Run an exported file (`run`: its inputs, numpy arrays by name -> its outputs, a list) and the MLX
    `model` on the same random images (with `postprocess`, post_process's `top_k` detections). -> (their largest
    difference, relative to the largest value; what was compared, in words). Two-stage queries whose proposals
    another runtime may rank either way (swappable_queries) are not compared, and the words say how many were."""
    images, mask = check_images(canvas, batch)
    inputs = {"pixel_values": images.transpose(0, 3, 1, 2).copy(), "pixel_mask": (~mask).astype(np.int64)}
    outputs = model(mx.array(images), mx.array(mask))
    swappable = swappable_queries(model, outputs)
    why = f"the rest's proposals score within {TOLERANCE:g} of a neighbour's, which runtimes may rank either way"
    if postprocess:
        sizes = np.stack([(~mask).any(2).sum(1), (~mask).any(1).sum(1)], -1) * 2  # "original" images twice as large
        inputs["target_sizes"] = sizes.astype(np.int64)
        theirs = dict(zip(("scores", "labels", "boxes"), run(inputs), strict=True))
        every_pair = post_process(outputs, sizes.tolist(), int(np.prod(outputs["pred_logits"].shape[1:])))
        found = [detection_difference(o, theirs, i, swappable[i]) for i, o in enumerate(every_pair)]
        compared, detections = sum(n for _, n in found), theirs["scores"].size
        names = "scores and boxes" if compared == detections else f"scores and boxes of {compared} of {detections}"
        return max(worst for worst, _ in found), names + ("" if compared == detections else f" detections ({why})")
    clear = ~swappable
    ours = [np.array(outputs["pred_logits"]), np.array(outputs["pred_boxes"])]
    pairs = zip(ours, run(inputs), strict=True)
    worst = max(relative_difference(o[clear], t[clear]) for o, t in pairs) if clear.any() else float("inf")
    names = "logits and boxes" if clear.all() else f"logits and boxes of {clear.sum()} of {clear.size} queries ({why})"
    return worst, names
