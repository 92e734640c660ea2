"""`export --to onnx` (`Detector.export("onnx", ...)`): write the ONNX file of a model, then (with
onnxruntime) run it once and compare it with the MLX model before it is in place.

A check that fails leaves no file; its images and tolerance: `deploy/check.py`."""

from pathlib import Path

import numpy as np
from mlx.utils import tree_flatten

from ...errors import CommandError, UsageError, install_hint, optional
from ...models.backbones import backbone_family
from ...models.combinations import check_model
from ...weights.files import atomic_write
from ..check import TOLERANCE, check_canvas, differences, kept_in_words


def require(module: str):
    return optional(module, "onnx", "exporting to ONNX")


def check_options(cfg, weights: dict, canvas: tuple, batch: int, sampler: str):
    """What the exporter cannot do, in one line each."""
    from .attention import SAMPLERS

    check_canvas(cfg, canvas, batch)
    if sampler not in SAMPLERS:
        raise UsageError(f"--sampler {sampler}: expected one of {', '.join(SAMPLERS)}")
    check_model(cfg)  # the model's own rules (the input projections' groups among them), stated once
    if "class_embed.0.bias" not in weights:
        raise ValueError("the weights have no class_embed.0.bias")
    if backbone_family(cfg.backbone) != "resnet":
        raise UsageError(
            f"model.backbone {cfg.backbone}: the ONNX graph has a ResNet backbone only; --to mlx exports any backbone"
        )


def compare(path: Path, model, canvas: tuple, postprocess: bool, top_k: int = 100) -> tuple:
    """The ONNX file in onnxruntime and the MLX `model` on the same random images (`check.differences`)."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    batch = session.get_inputs()[0].shape[0]
    worst, names = differences(model, canvas, batch, postprocess, lambda inputs: session.run(None, inputs), top_k)
    return worst, f"onnxruntime {onnxruntime.__version__}'s {names} within {worst:.1e} of the largest value of ours"


def export_onnx(model, cfg, dst: Path, size=None, batch_size: int = 1, postprocess=False, sampler="gather") -> str:
    """Write `dst` from the MLX `model` (in evaluation mode) of the config `cfg`; return a one-line
    summary. `size`: the canvas (H, W), default the config's val_size x max_size; with `postprocess`, an image's
    evaluation.top_k best detections."""
    onnx = require("onnx")
    from .builder import OPSET
    from .detector import build_graph

    canvas, batch = tuple(size) if size else (cfg.data.val_size, cfg.data.max_size), batch_size
    top_k = cfg.evaluation.top_k
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    check_options(cfg.model, weights, canvas, batch, sampler)
    graph = build_graph(weights, cfg.model, canvas, batch, postprocess, sampler, top_k)
    with atomic_write(dst) as tmp:
        onnx.save(graph, str(tmp))
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            checked = f"not run: onnxruntime is not installed ({install_hint('onnx')})"
        else:
            worst, checked = compare(tmp, model, canvas, postprocess, top_k)
            if not worst <= TOLERANCE:
                raise CommandError(f"{dst}: {checked}, over {TOLERANCE:g}: the export is wrong, not written")
    outputs = "scores, labels, boxes" if postprocess else "logits, pred_boxes"
    kept = f"; {kept_in_words(cfg.model, top_k)}" if postprocess else ""
    return (
        f"wrote {dst}: {len(graph.graph.node)} nodes, opset {OPSET}, {sampler} sampler, canvas {canvas[0]} x "
        f"{canvas[1]}, batch {batch}, outputs {outputs}; {checked}{kept}"
    )
