"""Padding batches to a multiple of 32 pixels instead of to the batch's largest image (the authors' way):
how many fewer shapes oneDNN makes plans for, and how far the model's answers move, the masks covering the
padding either way.

    python bench/padding.py [--checkpoint output/shapes/checkpoint.safetensors] [--output bench/results/padding_cpu.txt]

On the quick start's checkpoint and data: the distinct padded shapes of one training epoch (its loader,
batches of 8) each way, and COCO AP of the val set each way (batches of 2).
"""

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels  # noqa: E402, F401  (before mlx: the BLAS)
from deformable_detr import Detector  # noqa: E402
from deformable_detr.data import DataLoader, build_dataset, loader  # noqa: E402
from deformable_detr.errors import ArgumentParser, entry_point  # noqa: E402

from common import cpu_model, load_average, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STRIDE = 32


def rounded_up(samples):
    """loader.collate, then padded on to a multiple of STRIDE (the mask True there)."""
    images, mask, targets = AUTHORS(samples)
    b, h, w, _ = images.shape
    height, width = -(-h // STRIDE) * STRIDE, -(-w // STRIDE) * STRIDE
    padded = np.zeros((b, height, width, 3), np.float32)
    padded_mask = np.ones((b, height, width), bool)
    padded[:, :h, :w], padded_mask[:, :h, :w] = images, mask
    return padded, padded_mask, targets


AUTHORS = loader.collate


def epoch_shapes(cfg, collate) -> int:
    loader.collate = collate
    try:
        data = DataLoader(build_dataset("train", cfg.data), 8, seed=cfg.seed, num_workers=1)
        return len({images.shape[1:3] for step in data.epoch(0) for images, _, _ in step})
    finally:
        loader.collate = AUTHORS


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "output" / "shapes" / "checkpoint.safetensors")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "padding_cpu.txt")
    args = parser.parse_args(argv)

    detector = Detector.load(args.checkpoint, precision="float32")
    cfg = detector.cfg
    shapes = {name: epoch_shapes(cfg, collate) for name, collate in (("largest", AUTHORS), ("32", rounded_up))}
    aps = {}
    for name, collate in (("largest", AUTHORS), ("32", rounded_up)):
        loader.collate = collate
        try:
            aps[name] = detector.evaluate(batch_size=2)
        finally:
            loader.collate = AUTHORS
    lines = [
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU: {cpu_model(count=True)}; "
        f"load average {load_average()}; {args.checkpoint}",
        "",
        "| padding | training shapes in epoch 0 (batches of 8) | val AP | AP50 |",
        "| --- | ---: | ---: | ---: |",
        *(
            f"| {label} | {shapes[name]} | {aps[name]['AP']:.4f} | {aps[name]['AP50']:.4f} |"
            for name, label in (
                ("largest", "to the batch's largest (the authors')"),
                ("32", f"to a multiple of {STRIDE}"),
            )
        ),
        "",
        "The model is not padding-invariant (the backbone's borders and the input projections' GroupNorm see the "
        "padding), so the AP moves: the authors' padding stays (bench/README.md, memory over many shapes).",
    ]
    report(lines, args.output)


if __name__ == "__main__":
    main()
