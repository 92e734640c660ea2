"""An R50 training step in float32 and in bfloat16 (`train.precision`) on this machine: time and
peak memory, each precision in its own process.

    python bench/precision.py [--size 800x1066] [--repeats 1] [--steps 1] [--output bench/results/precision_cpu.txt]

`configs/r50.yaml` (its activation checkpointing `auto`: off where the step fits), one micro-batch of
2 synthetic images of `--size` with three boxes each, random weights (seeded: the same for both, and the same dropout
masks); the median of `--repeats` steps after a warm-up
step. Memory: MLX's peak (`mx.get_peak_memory`, arrays only) and the process's peak RSS. The
measured processes set themselves up as every process that imports deformable_detr (runtime.py).
`--steps N`: then N more steps on the same batch, each step's loss in both precisions, and the largest
relative difference of bfloat16's trajectory from float32's.
"""

import argparse
import json
import os
import resource
import sys
from pathlib import Path

from deformable_detr.errors import entry_point

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_parser, cpu_model, measured, median_time, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def measure(precision: str, size: tuple[int, int], repeats: int, steps: int = 0) -> dict:
    from deformable_detr import build_model, load_config
    from deformable_detr.training.trainer import Trainer, seed_step

    import mlx.core as mx
    import numpy as np

    cfg = load_config(
        ROOT / "configs" / "r50.yaml",
        [f"train.precision={precision}", "schedule.batch_size=2", "schedule.micro_batch_size=2"],
    )
    mx.random.seed(0)  # the same weights, and dropout masks, for both precisions
    trainer = Trainer.from_config(build_model(cfg), cfg, [size[::-1]])  # (width, height)
    rng = np.random.default_rng(0)
    images = rng.standard_normal((2, *size, 3)).astype(np.float32)
    mask = np.zeros((2, *size), bool)
    boxes = np.array([[0.3, 0.3, 0.2, 0.2], [0.7, 0.6, 0.3, 0.2], [0.5, 0.5, 0.6, 0.5]], np.float32)
    targets = [{"labels": np.array([1, 17, 62]), "boxes": boxes} for _ in range(2)]
    losses = []

    def step():
        seed_step(cfg.seed, 0)
        losses.append(trainer.step([(images, mask, targets)])[0]["loss"])

    seconds = median_time(step, repeats)
    trajectory = []
    for index in range(steps):
        seed_step(cfg.seed, index + 1)
        trajectory.append(trainer.step([(images, mask, targets)])[0]["loss"])
    return {
        "trajectory": trajectory,
        "seconds": seconds,
        "mlx_peak_mib": mx.get_peak_memory() / 2**20,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "first_loss": losses[0],
        "mlx": mx.__version__,
    }


@entry_point
def main(argv=None):
    parser = bench_parser(__doc__, "800x1066", "precision_cpu.txt", 1)
    parser.add_argument("--steps", type=int, default=0, help="then this many steps: the loss trajectories")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    size = args.size[0]
    if args.measure:
        print(json.dumps(measure(args.measure, size, args.repeats, args.steps)))
        return

    import kernels

    results = {}
    for precision in ("float32", "bfloat16"):
        command = [sys.executable, __file__, "--measure", precision, "--size", f"{size[0]}x{size[1]}"]
        command += ["--repeats", str(args.repeats), "--steps", str(args.steps)]
        results[precision] = measured(command, dict(os.environ), f"the {precision} step")
        print(precision, results[precision], flush=True)
    base = results["float32"]
    lines = [
        f"R50 training step (configs/r50.yaml, activation checkpointing auto), micro-batch 2 x {size[0]} x {size[1]}, "
        f"median of {args.repeats} after a warm-up; mlx {base['mlx']}, {cpu_model()} (bfloat16 instructions: "
        f"{', '.join(kernels.onednn.bfloat16_instructions()) or 'none'}), BLAS {kernels.blas.choice()}, "
        f"convolutions and linears on {kernels.onednn.describe()}",
        "",
        "| precision | step (s) | time vs float32 | MLX peak MiB | peak RSS MiB | first-step loss |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for precision, r in results.items():
        lines.append(
            f"| {precision} | {r['seconds']:.2f} | {r['seconds'] / base['seconds']:.2f} | {r['mlx_peak_mib']:.0f} "
            f"| {r['peak_rss_mib']:.0f} | {r['first_loss']:.4f} |"
        )
    narrow, wide = results["bfloat16"], results["float32"]
    lines += ["", f"first-step loss: bfloat16 {narrow['first_loss'] / base['first_loss'] - 1:+.3%} from float32"]
    if args.steps:
        differences = [n / w - 1 for n, w in zip(narrow["trajectory"], wide["trajectory"], strict=True)]
        worst = max(range(len(differences)), key=lambda i: abs(differences[i]))
        lines += [
            f"the {args.steps} steps after on the same batch, bfloat16 from float32: largest relative difference "
            f"{differences[worst]:+.3%} (step {worst + 1})",
            "",
            "| step | float32 loss | bfloat16 loss | difference |",
            "| ---: | ---: | ---: | ---: |",
            *(
                f"| {i + 1} | {w:.4f} | {n:.4f} | {d:+.3%} |"
                for i, (w, n, d) in enumerate(zip(wide["trajectory"], narrow["trajectory"], differences, strict=True))
            ),
        ]
    report(lines, args.output)


if __name__ == "__main__":
    main()
