"""What H-Deformable-DETR's recipe costs against the authors' two-stage model, R50, in one run: the training step
(512 x 683, batch 2: its time and MLX's peak memory) and inference (800 x 1066, batch 1).

    python bench/hdetr_cost.py [--repeats 3] [--output bench/results/hdetr_cost_cpu.txt]

Rows (random weights: the cost does not depend on them):
  authors' two-stage      configs/r50_two_stage.yaml (FFN 1024, dropout 0.1)
  HDETR tricks            configs/hdetr_r50_12ep.yaml without the hybrid branch (num_queries_one2many=0)
  HDETR hybrid            configs/hdetr_r50_12ep.yaml (300 + 1,500 decoder queries in training)
  HDETR, FFN 1024         inference only: hdetr_r50_12ep with the authors' FFN, to name the FFN's share
Training steps: median of --repeats after one warm-up, synthetic images with two boxes each, activation
checkpointing off; inference: median of --repeats forward passes after one warm-up, float32.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels  # noqa: E402, F401  (before mlx: the BLAS)
from deformable_detr import build_model, load_config  # noqa: E402
from deformable_detr.training.trainer import Trainer  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from common import cpu_model, load_average, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAIN_ROWS = {
    "authors' two-stage": ("r50_two_stage", []),
    "HDETR tricks": ("hdetr_r50_12ep", ["model.num_queries_one2many=0"]),
    "HDETR hybrid": ("hdetr_r50_12ep", []),
}
INFERENCE_ROWS = {
    "authors' two-stage": ("r50_two_stage", []),
    "HDETR (FFN 2048)": ("hdetr_r50_12ep", []),
    "HDETR, FFN 1024": ("hdetr_r50_12ep", ["model.dim_feedforward=1024"]),
}


def train_step(config: str, overrides: list, repeats: int) -> tuple[float, float]:
    """-> (median seconds a step, MLX's peak GiB over the measured steps)."""
    seconds, peak = train_steps(config, overrides, repeats)
    return statistics.median(seconds), peak


def train_steps(config: str, overrides: list, repeats: int) -> tuple[list[float], float]:
    """-> (each measured step's seconds, MLX's peak GiB over them): `repeats` steps after one warm-up."""
    batch = [
        "schedule.batch_size=2",
        "schedule.micro_batch_size=2",
        "train.activation_checkpointing=false",
        "model.num_classes=91",
    ]
    cfg = load_config(config, batch + overrides)
    mx.random.seed(0)
    trainer = Trainer.from_config(build_model(cfg), cfg, [(683, 512)])
    rng = np.random.default_rng(0)
    images = rng.standard_normal((2, 512, 683, 3)).astype(np.float32)
    mask = np.zeros((2, 512, 683), bool)
    boxes = np.array([[0.3, 0.3, 0.2, 0.2], [0.6, 0.6, 0.3, 0.4]], np.float32)
    targets = [{"labels": np.array([1, 18]), "boxes": boxes} for _ in range(2)]
    trainer.step([(images, mask, targets)])  # warm-up (and the first step's checks)
    mx.reset_peak_memory()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        trainer.step([(images, mask, targets)])
        seconds.append(time.perf_counter() - started)
    return seconds, mx.get_peak_memory() / 2**30


def inference(config: str, overrides: list, repeats: int) -> float:
    cfg = load_config(config, ["model.num_classes=91"] + overrides)
    mx.random.seed(0)
    model = build_model(cfg)
    model.eval()
    images = mx.array(np.random.default_rng(0).standard_normal((1, 800, 1066, 3)).astype(np.float32))
    mask = mx.zeros((1, 800, 1066), dtype=mx.bool_)
    mx.eval(model(images, mask))
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        mx.eval(model(images, mask))
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "hdetr_cost_cpu.txt")
    args = parser.parse_args()
    lines = [
        __doc__.split("\n\n")[0],
        f"CPU: {cpu_model()}; load average before: {load_average()}; {time.strftime('%Y-%m-%d')}",
        "",
        f"{'training step, 512 x 683, batch 2':<36} {'s':>6} {'x':>6} {'peak GiB':>9}",
    ]
    base = None
    for name, (config, overrides) in TRAIN_ROWS.items():
        seconds, peak = train_step(config, overrides, args.repeats)
        base = base or seconds
        lines.append(f"{name:<36} {seconds:>6.2f} {seconds / base:>6.2f} {peak:>9.2f}")
        print(lines[-1], flush=True)
    lines += ["", f"{'inference, 800 x 1066, batch 1':<36} {'s':>6} {'x':>6}"]
    base = None
    for name, (config, overrides) in INFERENCE_ROWS.items():
        seconds = inference(config, overrides, args.repeats)
        base = base or seconds
        lines.append(f"{name:<36} {seconds:>6.2f} {seconds / base:>6.2f}")
        print(lines[-1], flush=True)
    report(lines, args.output)


if __name__ == "__main__":
    main()
