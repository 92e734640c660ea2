"""R50 Deformable DETR on the CPU, this port against PyTorch, in one run: inference and a training step,
each in float32 and in bfloat16.

    python bench/model.py [--task inference|train|both] [--train-size 800x1066,512x683] [--repeats 3]
                          [--threads N] [--output-dir DIR]
    python bench/model.py --alternate 10 [--train-size 512x683] [--output-dir DIR]

PyTorch side: Hugging Face's `DeformableDetrForObjectDetection` (the authors' architecture: ResNet-50,
6 + 6 layers, 300 queries, 4 levels, 91 classes; its deformable attention core is PyTorch ops on
the CPU, as the authors' `ms_deform_attn_core_pytorch`), random weights, `--threads` torch threads,
stem and layer1 frozen for training as the authors do; in float32 and under
`torch.autocast("cpu", dtype=torch.bfloat16)` (the forward and the loss inside it, the backward and
the optimizer step outside, as PyTorch recommends: a user's fastest PyTorch on a CPU with bfloat16
instructions). Ours: `configs/r50.yaml`, on the BLAS and malloc set up as the package is imported
(deformable_detr/runtime.py), the convolutions and linears on oneDNN (kernels/onednn.py), the
attention on the fastest backend here. Each row runs in its own process, which reports its median
time over `--repeats` after a warm-up and its peak resident memory (ru_maxrss, the whole process:
Python, libraries, weights and activations). All processes keep freed memory in glibc's heap as our
commands do (`runtime.malloc_environment`): PyTorch gains as much from it (a training step at
512 x 683 in 13.4 s instead of 19.0 s here); `--torch-malloc default` runs PyTorch on glibc's
defaults instead, as a plain PyTorch script runs.

Inference: batch 1 at 800 x 1066 (the authors' evaluation size). Rows `PyTorch (float32)`,
`PyTorch (autocast bfloat16)`, `ours (MLX, float32)` and `ours (MLX, bfloat16)` (the forward inside
`kernels.onednn.products_in(mx.bfloat16)`: float32 weights and activations, the convolutions' and
linears' products in bfloat16, as `--precision bfloat16` predicts); `(default)` marks the one
`--precision auto` picks on this machine (`models.precision.resolve_precision`: bfloat16 where its
products are fast, float32 elsewhere; asked in ours' measuring process).
Training: batch 2 at each `--train-size`, forward, Hungarian matching, losses, backward and an AdamW
step; ours in float32 with activation checkpointing off and on (`train.activation_checkpointing`),
the R50 configs' default (`auto`: off where the step fits the memory budget without it, as here for
these steps) marked `(default)`, and `ours (MLX, bfloat16)`: `train.precision=bfloat16` (bfloat16
weight copies and activations through oneDNN) with that default checkpointing choice; with MLX's own
peak (`mx.get_peak_memory`: arrays only) beside the process's.
Where bfloat16 products are not fast (kernels.bfloat16_products: a CPU without AMX or AVX512-BF16, or
one capped below them), the bfloat16 rows, PyTorch's and ours, are skipped and the header says why:
they cannot be fast there (PyTorch's autocast bfloat16 inference took 123 s against 5.35 s at float32
on a Zen 2), and the run finishes in minutes.
The table gives, per row, its seconds, PyTorch float32's time / its time (> 1: faster than PyTorch
float32) and its peaks; the header names the CPU, any instruction-set caps (bench/common.py's AS_AVX2)
and whether bfloat16 products are fast.
Writes `model_cpu.txt` and `model_cpu.png` (seconds per image, a bar per row) to --output-dir
(default bench/results).

`--alternate N`: only the float32 training step at the first --train-size (ours with checkpointing off,
the R50 default for these steps), its ratio from N pairs of processes, PyTorch's then ours, one pair
after another: on a shared machine PyTorch's step moves by 20% from one process to the next, more than a
single row of the table can tell apart. Writes `train_alternating.txt`: each pair's seconds and ratio,
the medians of each side's steps and their ratio, the median and range of the pairs' ratios.
"""

import argparse
import json
import os
import platform
import re
import resource
import statistics
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import kernels  # noqa: E402
from deformable_detr.errors import ArgumentParser, entry_point  # noqa: E402

from common import bars, count_at_least, cpu_model, image_sizes, instruction_caps, load_average, measured, median_time  # noqa: E402

SIZE = (800, 1066)
PRECISIONS = ("float32", "bfloat16")  # each side's rows (PyTorch's bfloat16: autocast)


def targets_for(batch):
    boxes = [[0.3, 0.3, 0.2, 0.2], [0.7, 0.6, 0.3, 0.2], [0.5, 0.5, 0.6, 0.5]]
    return [{"labels": [1, 17, 62], "boxes": boxes} for _ in range(batch)]


def ours_setup(task, size, checkpointing=False, precision="float32"):
    """configs/r50.yaml's model on seeded random images: inference at batch 1 (evaluation mode, dropout
    off), or a training step at batch 2 (its Trainer: stem and layer1 frozen; `precision`:
    `train.precision`), the weights from seed 0. -> (cfg, model, trainer or None, images, mask, targets
    or None), the images and mask numpy (B, H, W, 3) and (B, H, W)."""
    import mlx.core as mx
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from deformable_detr import build_model, load_config
    from deformable_detr.training.trainer import Trainer

    overrides = [f"train.activation_checkpointing={str(checkpointing).lower()}"]
    overrides += ["schedule.batch_size=2", "schedule.micro_batch_size=2"]  # the step below: the plan's probes of 2
    overrides += [f"train.precision={precision}"] if task == "train" else []  # inference: products_in (measure_ours)
    cfg = load_config(ROOT / "configs" / "r50.yaml", overrides + ([] if task == "train" else ["model.dropout=0.0"]))
    mx.random.seed(0)
    model = build_model(cfg)
    rng = np.random.default_rng(0)
    batch = 1 if task == "inference" else 2
    images = rng.standard_normal((batch, *size, 3)).astype(np.float32)
    mask = np.zeros((batch, *size), bool)
    trainer = targets = None
    if task == "inference":
        model.eval()
    else:
        trainer = Trainer.from_config(model, cfg, [size[::-1]])  # (width, height)
        targets = [
            {k: np.array(v, np.float32 if k == "boxes" else np.int64) for k, v in t.items()} for t in targets_for(batch)
        ]
    mx.eval(model.parameters())
    return cfg, model, trainer, images, mask, targets


def measure_ours(task, repeats, size, checkpointing, precision):
    """Ours in this process: inference with the products in `precision` (float32 weights and
    activations either way), or a training step at `train.precision=precision`. The result says what
    `--precision auto` picks here (`auto`: [precision, why])."""
    import kernels
    from deformable_detr.models.precision import DTYPES, resolve_precision

    import mlx.core as mx

    _, model, trainer, images, mask, targets = ours_setup(task, size, checkpointing, precision)
    if task == "inference":
        x, m = mx.array(images), mx.array(mask)
        kept = kernels.onednn.kept_weights()

        def run():
            with kernels.onednn.products_in(DTYPES[precision], kept):  # as Detector.products()
                mx.eval(model(x, m))

        seconds = median_time(run, repeats)
    else:
        seconds = median_time(lambda: trainer.step([(images, mask, targets)]), repeats)
    backend = kernels.available_backends()[-1]
    return {
        "seconds": seconds,
        "batch": len(images),
        "mlx_peak_mib": mx.get_peak_memory() / 2**20,
        "auto": [resolve_precision("auto").ran, resolve_precision("auto").reason],
        "versions": f"mlx {mx.__version__}, attention backend {backend}, BLAS {kernels.blas.description()}, "
        f"convolutions and linears on {kernels.onednn.describe()}",
    }


def measure_torch(task, repeats, size, threads, precision):
    """PyTorch in this process: in float32, or (`precision` bfloat16) its forward (and loss) under
    `torch.autocast("cpu", dtype=torch.bfloat16)`, the backward and the optimizer step outside it."""
    import contextlib

    import torch
    import transformers

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = transformers.DeformableDetrConfig(
        use_timm_backbone=False,
        use_pretrained_backbone=False,
        backbone_config=transformers.ResNetConfig(out_features=["stage2", "stage3", "stage4"]),
        num_labels=91,
        dropout=0.0 if task == "inference" else 0.1,
    )
    model = transformers.DeformableDetrForObjectDetection(config)
    batch = 1 if task == "inference" else 2
    images = torch.randn(batch, 3, *size)
    pixel_mask = torch.ones(batch, *size, dtype=torch.long)

    def autocast():
        if precision == "float32":
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=torch.bfloat16)

    if task == "inference":
        model.eval()

        def run():
            with torch.no_grad(), autocast():
                model(pixel_values=images, pixel_mask=pixel_mask)

    else:
        model.train()
        for name, parameter in model.named_parameters():  # the authors freeze the stem and layer1
            if ".backbone." in name and (".embedder." in name or ".stages.0." in name):
                parameter.requires_grad_(False)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
        labels = [
            {"class_labels": torch.tensor(t["labels"]), "boxes": torch.tensor(t["boxes"])} for t in targets_for(batch)
        ]

        def run():
            optimizer.zero_grad()
            with autocast():
                loss = model(pixel_values=images, pixel_mask=pixel_mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()

    seconds = median_time(run, repeats)
    capability = torch.backends.cpu.get_cpu_capability()
    versions = f"torch {torch.__version__}, {threads} threads, CPU capability {capability}"
    return {"seconds": seconds, "batch": batch, "versions": versions}


def default_checkpointing(without: dict) -> bool:
    """What configs/r50.yaml's `train.activation_checkpointing: auto` chooses for this step on this
    machine: off where the step's MLX peak without recomputation fits the memory budget."""
    from deformable_detr import load_config
    from deformable_detr.training.memory_plan import budget_bytes

    return without["mlx_peak_mib"] * 2**20 > budget_bytes(load_config(ROOT / "configs" / "r50.yaml").train)


def run_side(side, task, repeats, size, threads, checkpointing=False, torch_malloc="same", precision="float32"):
    """One side (ours or torch) at `precision` (float32 or bfloat16) in its own process: its peak
    memory is its own."""
    sys.path.insert(0, str(ROOT))
    from deformable_detr import runtime

    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", *runtime.MALLOC)}
    if side != "ours" and torch_malloc == "same":  # ours sets itself up as it imports deformable_detr
        env = runtime.malloc_environment(env)
    command = [sys.executable, __file__, "--measure", side, "--task", task, "--repeats", str(repeats)]
    command += ["--threads", str(threads), "--train-size", f"{size[0]}x{size[1]}"]
    command += ["--checkpointing"] if checkpointing else []
    command += ["--precision", precision]
    return measured(command, env, f"{side} {task} {precision}")


MALLOC_LABELS = {"same": "as ours (freed memory kept)", "default": "glibc's defaults"}
TORCH_LABELS = {"float32": "PyTorch (float32)", "bfloat16": "PyTorch (autocast bfloat16)"}


def ours_runs(task: str, size: tuple, args) -> list:
    """Ours' rows of a task: [(label, measurement)]. Inference: float32 and bfloat16 products, the one
    `--precision auto` picks marked `(default)`. Training: float32 with checkpointing off and on, the
    default choice marked, then `train.precision=bfloat16` with that checkpointing."""
    run = partial(run_side, "ours", task, args.repeats, size, args.threads)
    if task == "inference":
        runs = {precision: run(precision=precision) for precision in args.precisions}
        default = runs["float32"]["auto"][0]
        return [
            (f"ours (MLX, {precision})" + (" (default)" if precision == default else ""), result)
            for precision, result in runs.items()
        ]
    runs = {checkpointing: run(checkpointing) for checkpointing in (False, True)}
    default = default_checkpointing(runs[False])
    rows = [
        (
            f"ours (MLX, float32), checkpointing {'on' if checkpointing else 'off'}"
            + (" (default)" if checkpointing == default else ""),
            result,
        )
        for checkpointing, result in runs.items()
    ]
    if "bfloat16" in args.precisions:
        bfloat16 = run(default, precision="bfloat16")
        rows.append((f"ours (MLX, bfloat16), checkpointing {'on' if default else 'off'}", bfloat16))
    return rows


def short(label: str) -> str:
    """A row's label as its bar in the chart names it."""
    label = re.sub(r"\((?:MLX, )?((?:autocast )?(?:float32|bfloat16))\)", r"\1", label.replace("ours", "this port"))
    return label.replace("float32", "f32").replace("bfloat16", "bf16").replace("checkpointing", "ckpt")


def compare(task: str, size: tuple, args, versions: set, auto: list) -> tuple:
    """One task in PyTorch (float32, autocast bfloat16) and in ours (ours_runs): the table's rows and
    (the task's name, its bars); `auto` gets what `--precision auto` picks (from ours' processes)."""
    runs = [
        (label, run_side("torch", task, args.repeats, size, args.threads, torch_malloc=args.torch_malloc, precision=p))
        for p, label in TORCH_LABELS.items()
        if p in args.precisions
    ]
    runs += ours_runs(task, size, args)
    reference = runs[0][1]["seconds"]  # PyTorch float32
    name = f"{task}, batch {runs[0][1]['batch']}, {size[0]}x{size[1]}"
    rows, bars_of_task = [], []
    for label, result in runs:
        versions.add(f"{label.split(' (')[0]}: {result['versions']}")
        auto += [tuple(result["auto"])] if "auto" in result else []
        mlx_peak = f"{result['mlx_peak_mib']:.0f}" if "mlx_peak_mib" in result else ""
        rows.append(
            f"| {name} | {label} | {result['seconds']:.2f} | {reference / result['seconds']:.2f} "
            f"| {result['peak_rss_mib']:.0f} | {mlx_peak} |"
        )
        bars_of_task.append((short(label), result["seconds"] / result["batch"]))
        print(rows[-1], flush=True)
    return rows, (name, bars_of_task)


def alternate(pairs: int, size: tuple, args) -> list:
    """The training step's alternating pairs (see the module): the report's lines, printed as they come."""
    lines = [
        f"run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU: {cpu_model(count=True)}"
        f"{instruction_caps()}; load average at start: {load_average()}",
        f"R50 training step, batch 2, {size[0]}x{size[1]}, float32, {args.threads} cores each: {pairs} pairs of "
        f"processes, PyTorch's then ours (checkpointing off), each the median of {args.repeats} steps after a "
        f"warm-up; PyTorch's malloc: {MALLOC_LABELS[args.torch_malloc]}",
        "",
        "| pair | PyTorch s | ours s | ratio |",
        "| ---: | ---: | ---: | ---: |",
    ]
    print("\n".join(lines), flush=True)
    theirs, ours = [], []
    for pair in range(1, pairs + 1):
        theirs.append(run_side("torch", "train", args.repeats, size, args.threads, torch_malloc=args.torch_malloc))
        ours.append(run_side("ours", "train", args.repeats, size, args.threads))
        lines.append(
            f"| {pair} | {theirs[-1]['seconds']:.2f} | {ours[-1]['seconds']:.2f} | "
            f"{theirs[-1]['seconds'] / ours[-1]['seconds']:.2f} |"
        )
        print(lines[-1], flush=True)
    ratios = sorted(t["seconds"] / o["seconds"] for t, o in zip(theirs, ours, strict=True))
    torch_median = statistics.median(t["seconds"] for t in theirs)
    ours_median = statistics.median(o["seconds"] for o in ours)
    lines += [
        "",
        f"medians: PyTorch {torch_median:.2f} s, ours {ours_median:.2f} s: {torch_median / ours_median:.2f}x; "
        f"the pairs' ratios: median {statistics.median(ratios):.2f}, {ratios[0]:.2f}-{ratios[-1]:.2f}, "
        f"{sum(r >= 1.3 for r in ratios)} of {pairs} at least 1.30",
        f"PyTorch: {theirs[0]['versions']}",
        f"ours: {ours[0]['versions']}",
    ]
    print("\n".join(lines[-3:]))
    return lines


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=["inference", "train", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument(
        "--train-size", type=image_sizes, default="800x1066,512x683", help="HxW of the training images, comma-separated"
    )
    parser.add_argument("--output-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument(
        "--torch-malloc",
        choices=["same", "default"],
        default="same",
        help="PyTorch's process: glibc's malloc set as ours (same) or glibc's defaults",
    )
    parser.add_argument(
        "--alternate",
        type=count_at_least(1, "pairs"),
        metavar="N",
        help="only the training step's ratio from N process pairs",
    )
    parser.add_argument("--measure", choices=["ours", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--precision", choices=PRECISIONS, default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    train_sizes = args.train_size
    if args.measure:
        size = SIZE if args.task == "inference" else train_sizes[0]
        if args.measure == "ours":
            result = measure_ours(args.task, args.repeats, size, args.checkpointing, args.precision)
        else:
            result = measure_torch(args.task, args.repeats, size, args.threads, args.precision)
        result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result))
        return

    if args.alternate is not None:
        lines = alternate(args.alternate, train_sizes[0], args)
        args.output_dir.mkdir(parents=True, exist_ok=True)
        (args.output_dir / "train_alternating.txt").write_text("\n".join(lines) + "\n")
        return

    jobs = [("inference", SIZE)] if args.task in ("inference", "both") else []
    jobs += [("train", size) for size in train_sizes] if args.task in ("train", "both") else []
    # bfloat16 rows only where its products are fast (PyTorch's autocast needs the same instructions)
    fast, why = kernels.bfloat16_products()
    args.precisions = PRECISIONS if fast else ("float32",)
    lines = [
        f"run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU: {cpu_model(count=True)}"
        f"{instruction_caps()}; bfloat16 products {'fast' if fast else 'not fast'}: {why}"
        + ("" if fast else " (the bfloat16 rows, PyTorch's and ours, skipped)")
        + f"; load average at start: {load_average()}",
        f"machine: {platform.machine()}, {platform.system()}, {args.threads} cores used by each process, "
        f"python {platform.python_version()}",
        f"median of {args.repeats} after a warm-up, each row in its own process, one after another; "
        "ratio = PyTorch float32's time / the row's (> 1: faster than PyTorch float32); "
        "peak RSS = the row's process (MLX peak: arrays only, mx.get_peak_memory); PyTorch's malloc: "
        + MALLOC_LABELS[args.torch_malloc],
        "",
        "| task | implementation | s | ratio | peak RSS MiB | MLX peak MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    groups, versions, auto = [], set(), []
    for task, size in jobs:
        rows, bars_of_task = compare(task, size, args, versions, auto)
        lines += rows
        groups.append(bars_of_task)
    lines[1:1] = sorted(versions) + [f"`--precision auto` picks {auto[0][0]} here ({auto[0][1]})"]
    text = "\n".join(lines)
    print(text)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "model_cpu.txt").write_text(text + "\n")
    title = "R50 Deformable DETR on the CPU: seconds per image (shorter is faster)"
    bars(title, groups, args.output_dir / "model_cpu.png")


if __name__ == "__main__":
    main()
