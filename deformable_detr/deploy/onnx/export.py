"""`export --to onnx` (`Detector.export("onnx", ...)`): write the ONNX file of a model, then (with
onnxruntime) run it once and compare it with the MLX model before it is in place.

A check that fails leaves no file. Its image: random pixels at about 3/4 x 4/5 of the canvas (so
with padding on both sides), each image of a batch its own size."""

from pathlib import Path

import numpy as np
from mlx.utils import tree_flatten

from ...errors import CommandError, UsageError
from ...models import post_process
from ...weights.files import atomic_write

# Of the largest value (logits, boxes, scores): a wrong graph is off by far more; float32 rounding
# (folded batch norm, other summation orders) reached 4.7e-5 on R50 with random weights (the tests:
# 5e-7 on small models, asserted to 1e-4).
TOLERANCE = 1e-3


def require(module: str):
    try:
        return __import__(module)
    except ImportError:
        raise CommandError(f'exporting to ONNX needs the {module} package: pip install -e ".[onnx]"') from None


def check_options(cfg, weights: dict, canvas: tuple, batch: int, sampler: str):
    """What the exporter cannot do, in one line each."""
    from .attention import SAMPLERS
    from .backbone import level_sizes

    if min(canvas) < 1 or batch < 1:
        raise UsageError(f"--size {canvas[0]} {canvas[1]} --batch-size {batch}: each must be at least 1")
    if sampler not in SAMPLERS:
        raise UsageError(f"--sampler {sampler}: expected one of {', '.join(SAMPLERS)}")
    if cfg.hidden_dim % 32:
        raise UsageError(f"model.hidden_dim {cfg.hidden_dim}: the input projections' group norm needs a multiple of 32")
    tokens = sum(h * w for h, w in level_sizes(cfg, canvas))
    if cfg.two_stage and cfg.num_queries > tokens:
        raise UsageError(
            f"--size {canvas[0]} {canvas[1]}: two-stage takes the top {cfg.num_queries} of the encoder's proposals, "
            f"and this canvas gives {tokens}; export on a larger canvas"
        )
    if "class_embed.0.bias" not in weights:
        raise ValueError("the weights have no class_embed.0.bias")


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


def compare(path: Path, model, canvas: tuple, postprocess: bool) -> tuple:
    """Run the ONNX file in onnxruntime and the MLX `model` on the same random images. -> (their
    largest difference, relative to the largest value; what was compared, in words)."""
    import mlx.core as mx
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    images, mask = check_images(canvas, session.get_inputs()[0].shape[0])
    inputs = {"pixel_values": images.transpose(0, 3, 1, 2).copy(), "pixel_mask": (~mask).astype(np.int64)}
    outputs = model(mx.array(images), mx.array(mask))
    if postprocess:
        sizes = np.stack([(~mask).any(2).sum(1), (~mask).any(1).sum(1)], -1) * 2  # "original" images twice as large
        inputs["target_sizes"] = sizes.astype(np.int64)
        theirs = dict(zip(("scores", "labels", "boxes"), session.run(None, inputs), strict=True))
        ours = post_process(outputs, sizes.tolist())
        differences = [detection_difference(o, theirs, i) for i, o in enumerate(ours)]
        names = "scores and boxes"
    else:
        theirs = session.run(None, inputs)
        ours = [np.array(outputs["pred_logits"]), np.array(outputs["pred_boxes"])]
        differences = [relative_difference(o, t) for o, t in zip(ours, theirs, strict=True)]
        names = "logits and boxes"
    worst = max(differences)
    return worst, f"onnxruntime {onnxruntime.__version__}'s {names} within {worst:.1e} of the largest value of ours"


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


def export_onnx(model, cfg, dst: Path, size=None, batch_size: int = 1, postprocess=False, sampler="gather") -> str:
    """Write `dst` from the MLX `model` (in evaluation mode) of the config `cfg`; return a one-line
    summary. `size`: the canvas (H, W), default the config's val_size x max_size."""
    onnx = require("onnx")
    from .builder import OPSET
    from .detector import build_graph

    canvas, batch = tuple(size) if size else (cfg.data.val_size, cfg.data.max_size), batch_size
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    check_options(cfg.model, weights, canvas, batch, sampler)
    graph = build_graph(weights, cfg.model, canvas, batch, postprocess, sampler)
    with atomic_write(dst) as tmp:
        onnx.save(graph, str(tmp))
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            checked = 'not run: onnxruntime is not installed (pip install -e ".[onnx]")'
        else:
            worst, checked = compare(tmp, model, canvas, postprocess)
            if not worst <= TOLERANCE:
                raise CommandError(f"{dst}: {checked}, over {TOLERANCE:g}: the export is wrong, not written")
    outputs = "scores, labels, boxes" if postprocess else "logits, pred_boxes"
    return (
        f"wrote {dst}: {len(graph.graph.node)} nodes, opset {OPSET}, {sampler} sampler, canvas {canvas[0]} x "
        f"{canvas[1]}, batch {batch}, outputs {outputs}; {checked}"
    )
