"""An R50 training step with `kernels.masked_scale` and `kernels.scale_where_positive` (dropout, dropout
after a ReLU, and the ReLUs' gradients, in one pass on every core) against MLX's where, maximum and
multiply in their place (one thread and one pass each), alternating in one process.

    python bench/step_ops.py [--size 512x683] [--repeats 3] [--output bench/results/step_ops_cpu.txt]

configs/r50.yaml's training step at micro-batch 2 on seeded random images (bench/model.py's setup),
dropout on. The two sides' losses and gradients are compared bit for bit.
"""

import os
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import deformable_detr  # noqa: E402, F401  (first: it loads the BLAS MLX then calls, and sets glibc's malloc)
import kernels  # noqa: E402
from deformable_detr.cli import ArgumentParser, entry_point  # noqa: E402
from deformable_detr.models import recompute  # noqa: E402
from deformable_detr.training.trainer import seed_step  # noqa: E402

import mlx.core as mx  # noqa: E402
from common import cpu_model, image_sizes, report  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from model import ours_setup  # noqa: E402


def mlx_masked_scale(x, keep, scale, relu=False):
    return mx.where(keep, (mx.maximum(x, 0) if relu else x) * scale, mx.array(0, x.dtype))


def mlx_scale_where_positive(x, output, scale=1.0):
    return mx.where(output > 0, x if scale == 1 else x * scale, mx.array(0, x.dtype))


def step_times(size, repeats) -> tuple[dict, bool]:
    """side -> step seconds, the sides alternating; and whether their losses and gradients agree bit for bit."""
    names = {name: getattr(kernels, name) for name in kernels.__all__}
    mlx_ops = {"masked_scale": mlx_masked_scale, "scale_where_positive": mlx_scale_where_positive}
    sides = {"ours": kernels, "MLX's ops": types.SimpleNamespace(**{**names, **mlx_ops})}
    cfg, _, trainer, images, mask, targets = ours_setup("train", size)
    x, m, boxes = mx.array(images), mx.array(mask), trainer.num_boxes(targets)
    times, results = {side: [] for side in sides}, {}
    for round_ in range(repeats + 1):  # the first round warms up
        for side, namespace in sides.items():
            recompute.kernels = namespace
            seed_step(cfg.seed, 0)  # the same dropout masks on both sides
            start = time.perf_counter()
            (total, _), grads = trainer.loss_and_grad(x, m, targets, boxes)
            mx.eval(total, grads)
            if round_:
                times[side].append(time.perf_counter() - start)
            results[side] = [total] + [g for _, g in tree_flatten(grads)]
    recompute.kernels = kernels
    ours, theirs = results["ours"], results["MLX's ops"]
    same = len(ours) == len(theirs) and all(mx.array_equal(a, b).item() for a, b in zip(ours, theirs, strict=True))
    return times, same


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=image_sizes, default="512x683", help="HxW of the images")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (each runs both sides)")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "step_ops_cpu.txt")
    args = parser.parse_args(argv)
    size = args.size[0]
    lines = [
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU: {cpu_model(count=True)}; "
        f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"mlx {mx.__version__}, BLAS {kernels.blas.description()}, threads {kernels.cpu.threads()}",
        "",
    ]
    times, same = step_times(size, args.repeats)
    ours, theirs = (statistics.median(times[side]) for side in ("ours", "MLX's ops"))
    lines.append(f"R50 training step, micro-batch 2, {size[0]}x{size[1]} ({args.repeats} alternating rounds, median):")
    for side, seconds in (("ours", ours), ("MLX's ops", theirs)):
        lines.append(f"- {side}: {seconds:.3f} s (each round: {', '.join(f'{t:.2f}' for t in times[side])})")
    lines.append(f"- ratio MLX's ops / ours: {theirs / ours:.2f}; loss and gradients bit for bit the same: {same}")
    lines.append(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    report(lines, args.output)


if __name__ == "__main__":
    main()
