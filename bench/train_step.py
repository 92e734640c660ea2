"""Time one training step of a config's model on each BLAS MLX can run on here, in one run.

    python bench/train_step.py [--config configs/shapes.yaml] [--steps 5] [--size 128]
                               [--blas bundled,openblas,mkl] [--output FILE]

Each side runs in its own process (a BLAS can only be chosen before MLX loads), set up as every
process that imports deformable_detr (runtime.py: glibc's malloc keeping freed memory, the BLAS) with
KERNELS_BLAS set to the side: MLX's bundled reference BLAS, OpenBLAS (scipy-openblas32) or
MKL (the `mkl` extra); a side whose BLAS is not installed is left out. Synthetic images (the config's
batch where it is at most 8, the quick start's; else 2; size x size), two boxes each; median of
--steps steps after one warm-up."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from deformable_detr.config import load_config
from deformable_detr.errors import ArgumentParser, entry_point

ROOT = Path(__file__).resolve().parents[1]


def measure(config: str, steps: int, size: int) -> dict:
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from deformable_detr import build_model, load_config
    from deformable_detr.training.trainer import Trainer

    cfg = load_config(config)
    batch = cfg.schedule.batch_size if cfg.schedule.batch_size <= 8 else 2  # the quick start's 8; R50's micro-batch 2
    cfg = load_config(config, [f"schedule.batch_size={batch}", f"schedule.micro_batch_size={batch}"])
    model = build_model(cfg)
    trainer = Trainer.from_config(model, cfg, [(size, size)])
    rng = np.random.default_rng(0)
    images = rng.standard_normal((batch, size, size, 3)).astype(np.float32)
    mask = np.zeros((batch, size, size), bool)
    targets = [
        {"labels": np.array([1, 2]), "boxes": np.array([[0.3, 0.3, 0.2, 0.2], [0.7, 0.6, 0.3, 0.2]], np.float32)}
        for _ in range(batch)
    ]
    trainer.step([(images, mask, targets)])
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.step([(images, mask, targets)])
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "batch": batch}


def blas_sides(text: str) -> list[str]:
    sides = text.split(",")
    for side in sides:
        if side not in ("bundled", "openblas", "mkl"):
            raise argparse.ArgumentTypeError(f"{side!r}: expected bundled, openblas or mkl")
    return sides


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/shapes.yaml")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument(
        "--blas",
        type=blas_sides,
        default="bundled,openblas,mkl",
        help="the sides, comma-separated, of bundled, openblas, mkl",
    )
    parser.add_argument("--output", type=Path)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    load_config(args.config)  # a bad config: one line here, not a traceback from a measured process
    if args.measure:
        print(json.dumps(measure(args.config, args.steps, args.size)))
        return

    sys.path.insert(0, str(ROOT))
    from kernels import blas

    command = [
        sys.executable,
        __file__,
        "--measure",
        "--config",
        args.config,
        "--steps",
        str(args.steps),
        "--size",
        str(args.size),
    ]
    names = {"bundled": "MLX's bundled BLAS", "openblas": "OpenBLAS", "mkl": "MKL"}
    base_env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    results = {}
    for side in args.blas:
        env = dict(base_env, KERNELS_BLAS=side)
        if side != "bundled" and blas.choice(env) != side:
            print(f"{names[side]}: not installed here, left out", file=sys.stderr)
            continue
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True, cwd=ROOT)
        results[names[side]] = json.loads(out.stdout.strip().splitlines()[-1])
    first = next(iter(results.values()))
    baseline = first["median_s"]
    lines = [
        f"training step of {args.config}: batch {first['batch']} x {args.size} x {args.size}, "
        f"median of {args.steps} steps, {os.cpu_count()} CPUs ({blas.cpu_vendor() or 'vendor unknown'}); "
        f"speed-up against the first row; auto here: {blas.choice({})}",
        "",
        f"| {'BLAS':<20} | {'step (s)':>8} | {'speed-up':>8} |",
        f"|{'-' * 22}|{'-' * 10}|{'-' * 10}|",
    ]
    for name, result in results.items():
        lines.append(f"| {name:<20} | {result['median_s']:8.3f} | {baseline / result['median_s']:8.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
