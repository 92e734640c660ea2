"""Where an R50 training step's time goes: backbone, encoder, decoder (with the heads), matching and
losses, backward, optimizer; with activation checkpointing off and on.

    python bench/step_parts.py [--size 512x683] [--repeats 2] [--output bench/results/step_parts_cpu.txt]

configs/r50.yaml, random weights, a micro-batch of 2 synthetic images of `--size` with three boxes
each. The forward's parts are timed with an evaluation after each (a forward without gradient);
matching and losses on the evaluated outputs; the backward is the differentiated step's time less
that forward and the losses; the optimizer is AdamW's update with the gradient clipping. The median
of `--repeats` after a warm-up, each setting in its own process, started as train.py starts.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

from deformable_detr.errors import entry_point

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_parser, measured, report  # noqa: E402

PARTS = ("backbone", "encoder", "decoder and heads", "matching and losses", "backward", "optimizer")


def build_step(checkpointing: bool, size: tuple[int, int]) -> tuple:
    """bench/model.py's training step (the R50 config, micro-batch 2, two seeded images of `size` with
    three boxes each), the images and mask as MLX arrays, and the step's box count."""
    import mlx.core as mx
    from model import ours_setup

    cfg, model, trainer, images, mask, targets = ours_setup("train", size, checkpointing)
    return cfg, model, trainer, mx.array(images), mx.array(mask), targets, trainer.num_boxes(targets)


def parts_of_step(forward_parts, trainer, model, cfg, batch, seconds: dict) -> dict:
    """One step timed part by part: the forward's (backbone and encoder through `seconds`), the
    differentiated step's, the optimizer's."""
    from deformable_detr.training.trainer import seed_step

    import mlx.core as mx

    images, mask, targets, num_boxes = batch
    seconds.clear()
    forward, matching = forward_parts()
    seed_step(cfg.seed, 0)
    start = time.perf_counter()
    (total, _), grads = trainer.loss_and_grad(images, mask, targets, num_boxes)
    mx.eval(total, grads)
    differentiated = time.perf_counter() - start
    start = time.perf_counter()
    trainer._update(grads, total, {})
    mx.eval(model.parameters(), trainer.optimizer.state)
    optimizer = time.perf_counter() - start
    return {
        "backbone": seconds["backbone"],
        "encoder": seconds["encoder"],
        "decoder and heads": forward - seconds["backbone"] - seconds["encoder"],
        "matching and losses": matching,
        "backward": differentiated - forward - matching,
        "optimizer": optimizer,
        "step": differentiated + optimizer,
    }


def timed_parts(checkpointing: bool, size: tuple[int, int], repeats: int) -> dict:
    import deformable_detr.models.deformable_transformer as transformer_module
    import kernels
    from deformable_detr.models.backbone import Backbone
    from deformable_detr.training.trainer import seed_step

    import mlx.core as mx
    import numpy as np

    cfg, model, trainer, images, mask, targets, num_boxes = build_step(checkpointing, size)
    seconds = {}

    def timing(name, function):
        def wrapper(*args, **kwargs):
            mx.eval([a for a in args if isinstance(a, mx.array)])
            start = time.perf_counter()
            out = function(*args, **kwargs)
            mx.eval(out)
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
            return out

        return wrapper

    originals = (Backbone.__call__, transformer_module.DeformableTransformerEncoder.__call__)

    def forward_parts():
        Backbone.__call__ = timing("backbone", originals[0])
        transformer_module.DeformableTransformerEncoder.__call__ = timing("encoder", originals[1])
        try:
            seed_step(cfg.seed, 0)
            start = time.perf_counter()
            outputs = model(images, mask)
            mx.eval(outputs)
            total = time.perf_counter() - start
        finally:
            Backbone.__call__, transformer_module.DeformableTransformerEncoder.__call__ = originals
        start = time.perf_counter()
        losses = trainer.criterion(outputs, targets, num_boxes)
        mx.eval(losses)
        matching = time.perf_counter() - start
        return total, matching

    results = [
        parts_of_step(forward_parts, trainer, model, cfg, (images, mask, targets, num_boxes), seconds)
        for _ in range(repeats + 1)
    ]
    kept = results[1:]  # after the warm-up
    return {**{k: float(np.median([r[k] for r in kept])) for k in kept[0]}, "blas": kernels.blas.description()}


@entry_point
def main(argv=None):
    parser = bench_parser(__doc__, "512x683", "step_parts_cpu.txt", 2)
    parser.add_argument("--measure", choices=["off", "on"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    size = args.size[0]
    if args.measure:
        print(json.dumps(timed_parts(args.measure == "on", size, args.repeats)))
        return

    results = {}
    for setting in ("off", "on"):
        command = [sys.executable, __file__, "--measure", setting, "--size", f"{size[0]}x{size[1]}"]
        command += ["--repeats", str(args.repeats)]
        results[setting] = measured(command, dict(os.environ), f"the step with checkpointing {setting}")
        print(setting, results[setting], flush=True)
    lines = [
        f"R50 training step (configs/r50.yaml), micro-batch 2 x {size[0]} x {size[1]}, median of {args.repeats} "
        f"after a warm-up, seconds; CPU with {results['off']['blas']}",
        "",
        "| part | checkpointing off | checkpointing on |",
        "| --- | ---: | ---: |",
    ]
    for part in (*PARTS, "step"):
        lines.append(f"| {part} | {results['off'][part]:.2f} | {results['on'][part]:.2f} |")
    report(lines, args.output)


if __name__ == "__main__":
    main()
