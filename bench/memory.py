"""Where the peak memory of an R50 training step goes: MLX's peak (`mx.get_peak_memory`) for a forward
alone and for forward + backward with activation checkpointing off, on for one part at a time
(backbone stages 2-4, encoder layers, decoder layers) and on for all, each in its own process.

    python bench/memory.py [--size 512x683] [--output bench/results/memory_cpu.txt]

Batch 2 of `configs/r50.yaml` (stem and layer1 frozen, as trained), the BLAS preloaded as train.py runs. Peaks are above
the weights (measured after they are evaluated); the optimizer's state is not included.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

from deformable_detr.errors import ArgumentParser, entry_point

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import image_sizes, measured  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PARTS = {
    "forward only (no gradient)": None,
    "none": [],
    "backbone stages 2-4": ["backbone"],
    "encoder layers": ["encoder"],
    "decoder layers": ["decoder"],
    "all (checkpointing on)": ["backbone", "encoder", "decoder"],
}


def measure(parts, size):
    import mlx.core as mx
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from deformable_detr import build_model, load_config
    from deformable_detr.training.trainer import Trainer

    cfg = load_config(
        ROOT / "configs" / "r50.yaml",
        ["train.activation_checkpointing=false", "schedule.batch_size=2", "schedule.micro_batch_size=2"],
    )
    model = build_model(cfg)
    trainer = Trainer.from_config(model, cfg, [size[::-1]])  # (width, height)
    if parts:
        model.backbone[0].body.activation_checkpointing = "backbone" in parts
        model.transformer.encoder.activation_checkpointing = "encoder" in parts
        model.transformer.decoder.activation_checkpointing = "decoder" in parts
    rng = np.random.default_rng(0)
    images = mx.array(rng.standard_normal((2, *size, 3)).astype(np.float32))
    mask = mx.zeros((2, *size), dtype=mx.bool_)
    boxes = np.array([[0.3, 0.3, 0.2, 0.2], [0.7, 0.6, 0.3, 0.2], [0.5, 0.5, 0.6, 0.5]], np.float32)
    targets = [{"labels": np.array([1, 17, 62]), "boxes": boxes} for _ in range(2)]

    def step():
        if parts is None:
            mx.eval(model(images, mask))
        else:
            (total, _), grads = trainer.loss_and_grad(images, mask, targets, 6.0)
            mx.eval(total, grads)

    step()  # warm-up: the first call's allocations differ
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    start = time.perf_counter()
    step()
    return {"peak_mib": (mx.get_peak_memory() - base) / 2**20, "seconds": time.perf_counter() - start}


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=image_sizes, default="512x683", help="HxW")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "memory_cpu.txt")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    size = args.size[0]
    if args.measure is not None:
        print(json.dumps(measure(json.loads(args.measure), size)))
        return
    env = dict(os.environ)
    lines = [
        f"R50 training step, batch 2, {size[0]}x{size[1]}: MLX's peak above the weights, by what is checkpointed",
        "",
        "| checkpointed | peak MiB | time (s) |",
        "| --- | ---: | ---: |",
    ]
    for name, parts in PARTS.items():
        command = [sys.executable, __file__, "--size", f"{size[0]}x{size[1]}", "--measure", json.dumps(parts)]
        result = measured(command, env, name)
        lines.append(f"| {name} | {result['peak_mib']:.0f} | {result['seconds']:.1f} |")
        print(lines[-1], flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
