"""What every exporter checks: the canvas and batch it is asked for (in one line each), and its own
file against the MLX model on random images before the file is in place (`differences`, run by each
exporter's `compare` with its own runtime).

Its images: random pixels at about 3/4 x 4/5 of the canvas (so with padding on both sides), each
image of a batch its own size."""

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


def detection_difference(ours: dict, theirs: dict, image: int) -> float:
    """Scores compared everywhere; labels and boxes where the ranking is unambiguous (a score
    within TOLERANCE of a neighbour's may swap places between the two runtimes)."""
    scores = np.array(ours["scores"])
    worst = relative_difference(scores, theirs["scores"][image])
    gaps = np.abs(np.diff(scores)) > TOLERANCE * np.abs(scores).max()
    clear = np.concatenate([[True], gaps]) & np.concatenate([gaps, [True]])
    if not np.array_equal(np.array(ours["labels"])[clear], theirs["labels"][image][clear]):
        return float("inf")
    return max(worst, relative_difference(np.array(ours["boxes"])[clear], theirs["boxes"][image][clear]))


def differences(model, canvas: tuple, batch: int, postprocess: bool, run, top_k: int = 100) -> tuple:
    """Run an exported file (`run`: its inputs, numpy arrays by name -> its outputs, a list) and the MLX
    `model` on the same random images (with `postprocess`, post_process's `top_k` detections). -> (their largest
    difference, relative to the largest value; what was compared, in words)."""
    images, mask = check_images(canvas, batch)
    inputs = {"pixel_values": images.transpose(0, 3, 1, 2).copy(), "pixel_mask": (~mask).astype(np.int64)}
    outputs = model(mx.array(images), mx.array(mask))
    if postprocess:
        sizes = np.stack([(~mask).any(2).sum(1), (~mask).any(1).sum(1)], -1) * 2  # "original" images twice as large
        inputs["target_sizes"] = sizes.astype(np.int64)
        theirs = dict(zip(("scores", "labels", "boxes"), run(inputs), strict=True))
        ours = post_process(outputs, sizes.tolist(), top_k)
        return max(detection_difference(o, theirs, i) for i, o in enumerate(ours)), "scores and boxes"
    ours = [np.array(outputs["pred_logits"]), np.array(outputs["pred_boxes"])]
    worst = max(relative_difference(o, t) for o, t in zip(ours, run(inputs), strict=True))
    return worst, "logits and boxes"
