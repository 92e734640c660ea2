"""`export --to mlx` (`Detector.export("mlx", ...)`): the detector's forward on a fixed canvas as an
MLX function file (`mx.export_function`, `.mlxfn`), which `mx.import_function` loads in Python,
`mlx::core::import_function` in C++ (examples/mlxfn/) and mlx-swift's `importFunction` in Swift,
with no code of this package.

The file holds the weights and the graph of MLX operations traced from the model itself, run in
`kernels.export_mode()`: there the attention core, softmax, layer norm and the backbone's
convolutions are MLX's own operations (the C++ primitives of `kernels._native`, the fused GPU
kernels and every `mx.custom_function` would not serialize), the numbers the same. Keyword inputs,
named and shaped as the ONNX file's: pixel_values (N, 3, H, W) float32 normalised, pixel_mask
(N, H, W) int64, 1 on the image -> (logits (N, Q, classes), pred_boxes (N, Q, 4) cx, cy, w, h in
[0, 1]); with `postprocess` also target_sizes (N, 2) int64 (height, width) -> (scores (N, K),
labels (N, K) int64, boxes (N, K, 4) x0, y0, x1, y1 in pixels), the top K = min(evaluation.top_k,
Q * classes) (100; DINO's configs 300, its num_select).
The file's metadata (`mx.import_function(path, return_metadata=True)`, C++ `.metadata()`) is JSON:
{"canvas": [H, W], "batch": N, "inputs": [...], "outputs": [...], "num_classes": C}.

Before the file is in place it is loaded in a separate Python process that imports only mlx, run on
random images (`deploy/check.py`) and compared with the model; a mismatch leaves no file."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import kernels

import mlx.core as mx
import numpy as np

from ..errors import CommandError, UsageError
from ..models import post_process
from ..weights.files import atomic_write
from .check import TOLERANCE, check_canvas, differences, kept_in_words

# Runs in its own process: argv = the file, its inputs (.safetensors), where to write its outputs.
# It imports only mlx, and says so, as a user's process without this package would.
RUN_FILE = """
import sys
import mlx.core as mx
function = mx.import_function(sys.argv[1])
outputs = function(**mx.load(sys.argv[2]))
mx.save_safetensors(sys.argv[3], {str(i): output for i, output in enumerate(outputs)})
ours = sorted(name for name in sys.modules if name.split(".")[0] in ("deformable_detr", "kernels"))
sys.exit(f"the check imported {ours}" if ours else 0)
"""

OUTPUTS = ("logits", "pred_boxes")
DETECTIONS = ("scores", "labels", "boxes")


def canvas_function(model, postprocess: bool, top_k: int = 100):
    """The function the file holds: keyword inputs as the ONNX file's, a tuple of outputs (with `postprocess`, an
    image's `top_k` best detections)."""

    def forward(pixel_values, pixel_mask, target_sizes=None):
        outputs = model(pixel_values.transpose(0, 2, 3, 1), pixel_mask == 0)
        if not postprocess:
            return outputs["pred_logits"], outputs["pred_boxes"]
        detections = post_process(outputs, target_sizes, top_k)
        scores, labels, boxes = (mx.stack([d[name] for d in detections]) for name in DETECTIONS)
        return scores, labels.astype(mx.int64), boxes  # int64 labels, as the ONNX graph's

    return forward


def example_inputs(canvas: tuple, batch: int, postprocess: bool) -> dict:
    """Zeros of the inputs' shapes and dtypes: what the export traces (the values do not matter)."""
    inputs = {
        "pixel_values": mx.zeros((batch, 3, *canvas), mx.float32),
        "pixel_mask": mx.zeros((batch, *canvas), mx.int64),
    }
    if postprocess:
        inputs["target_sizes"] = mx.zeros((batch, 2), mx.int64)
    return inputs


def metadata(canvas: tuple, batch: int, postprocess: bool, num_classes: int) -> str:
    """What a loader needs to know and cannot ask the file: its canvas, batch, inputs and outputs."""
    names = dict(
        inputs=list(example_inputs(canvas, batch, postprocess)),
        outputs=list(DETECTIONS if postprocess else OUTPUTS),
    )
    return json.dumps({"canvas": list(canvas), "batch": batch, **names, "num_classes": num_classes})


def run_file(path: Path, inputs: dict) -> list:
    """The outputs of the .mlxfn file on `inputs` (numpy), from a process with only mlx imported."""
    with tempfile.TemporaryDirectory() as directory:
        given, taken = Path(directory) / "inputs.safetensors", Path(directory) / "outputs.safetensors"
        mx.save_safetensors(str(given), {name: mx.array(value) for name, value in inputs.items()})
        command = [sys.executable, "-I", "-c", RUN_FILE, str(path), str(given), str(taken)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit status {done.returncode}"]
            raise CommandError(f"{path}: mx.import_function in a process of its own failed: {lines[-1]}")
        outputs = mx.load(str(taken))
        return [np.array(outputs[str(i)]) for i in range(len(outputs))]


def compare(path: Path, model, canvas: tuple, batch: int, postprocess: bool, top_k: int = 100) -> tuple:
    """The file (`run_file`) and the model on the same random images (`check.differences`)."""
    worst, names = differences(model, canvas, batch, postprocess, lambda inputs: run_file(path, inputs), top_k)
    where = "mx.import_function in a process with only mlx"
    return worst, f"{where}: its {names} within {worst:.1e} of the largest value of ours"


def export_mlx(model, cfg, dst: Path, size=None, batch_size: int = 1, postprocess: bool = False) -> str:
    """Write `dst` (an .mlxfn file) from the MLX `model` (in evaluation mode) of the config `cfg`;
    return a one-line summary. `size`: the canvas (H, W), default the config's val_size x max_size."""
    dst = Path(dst)
    canvas, batch = tuple(size) if size else (cfg.data.val_size, cfg.data.max_size), batch_size
    check_canvas(cfg.model, canvas, batch)
    if dst.suffix != ".mlxfn":
        raise UsageError(f"{dst}: an MLX function file's name ends in .mlxfn (MLX adds it to any other)")
    if model.training:
        raise ValueError("export_mlx: the model is in training mode; call model.eval() first")
    mx.eval(model.parameters())  # weights just loaded are lazy reads of their file (`Load` does not serialize)
    top_k = cfg.evaluation.top_k
    forward, inputs = canvas_function(model, postprocess, top_k), example_inputs(canvas, batch, postprocess)
    about = metadata(canvas, batch, postprocess, cfg.model.num_classes)
    with atomic_write(dst) as tmp:
        with kernels.export_mode():
            mx.export_function(str(tmp), forward, metadata=about, **inputs)
        worst, checked = compare(tmp, model, canvas, batch, postprocess, top_k)
        if not worst <= TOLERANCE:
            raise CommandError(f"{dst}: {checked}, over {TOLERANCE:g}: the export is wrong, not written")
        mib = tmp.stat().st_size / 2**20
    outputs = ", ".join(DETECTIONS if postprocess else OUTPUTS)
    kept = f"; {kept_in_words(cfg.model, top_k)}" if postprocess else ""
    return (
        f"wrote {dst}: {mib:.1f} MiB, MLX {mx.__version__}, canvas {canvas[0]} x {canvas[1]}, batch {batch}, "
        f"inputs {', '.join(inputs)}, outputs {outputs}; {checked}{kept}"
    )
