"""R50 Deformable DETR on the CPU, this port against PyTorch, in one run: inference and a training step.

    python bench/model.py [--task inference|train|both] [--train-size 800x1066,512x683] [--repeats 3]
                          [--threads N] [--output-dir DIR]

PyTorch side: Hugging Face's `DeformableDetrForObjectDetection` (the authors' architecture: ResNet-50,
6 + 6 layers, 300 queries, 4 levels, 91 classes; its deformable attention core is PyTorch ops on
the CPU, as the authors' `ms_deform_attn_core_pytorch`), random weights, `--threads` torch threads,
stem and layer1 frozen for training as the authors do. Ours: `configs/r50.yaml`, on the BLAS and malloc
set up as the package is imported (deformable_detr/runtime.py), the attention on the fastest backend
here. Each side runs in its own process, which reports its median time over `--repeats` after a
warm-up and its peak resident memory (ru_maxrss, the whole process: Python, libraries, weights and
activations). Both processes keep freed memory in glibc's heap as our commands do
(`runtime.malloc_environment`): PyTorch gains as much from it (a training step at 512 x 683 in
13.4 s instead of 19.0 s here); `--torch-malloc default` runs PyTorch on glibc's defaults instead,
as a plain PyTorch script runs.

Inference: batch 1 at 800 x 1066 (the authors' evaluation size), images/s. Training: batch 2 at each
`--train-size`, forward, Hungarian matching, losses, backward and an AdamW step; ours with activation
checkpointing off and on (`train.activation_checkpointing`), the R50 configs' default (`auto`: off
where the step fits the memory budget without it, as here for these steps) marked `(default)`; with
MLX's own peak (`mx.get_peak_memory`: arrays only) beside the process's.
Writes `model_cpu.txt` and `model_cpu.png` to --output-dir (default bench/results).
"""

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from deformable_detr.cli import ArgumentParser, entry_point  # noqa: E402

from common import bars, cpu_model, image_sizes, load_average, measured, median_time  # noqa: E402

SIZE = (800, 1066)


def targets_for(batch):
    boxes = [[0.3, 0.3, 0.2, 0.2], [0.7, 0.6, 0.3, 0.2], [0.5, 0.5, 0.6, 0.5]]
    return [{"labels": [1, 17, 62], "boxes": boxes} for _ in range(batch)]


def ours_setup(task, size, checkpointing=False):
    """configs/r50.yaml's model on seeded random images: inference at batch 1 (evaluation mode, dropout
    off), or a training step at batch 2 (its Trainer: stem and layer1 frozen), the weights from seed 0.
    -> (cfg, model, trainer or None, images, mask, targets or None), the images and mask numpy
    (B, H, W, 3) and (B, H, W)."""
    import mlx.core as mx
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from deformable_detr import build_model, load_config
    from deformable_detr.training.trainer import Trainer

    overrides = [f"train.activation_checkpointing={str(checkpointing).lower()}"]
    overrides += ["schedule.batch_size=2", "schedule.micro_batch_size=2"]  # the step below: the plan's probes of 2
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


def measure_ours(task, repeats, size, checkpointing):
    import kernels

    import mlx.core as mx

    _, model, trainer, images, mask, targets = ours_setup(task, size, checkpointing)
    if task == "inference":
        x, m = mx.array(images), mx.array(mask)
        seconds = median_time(lambda: mx.eval(model(x, m)), repeats)
    else:
        seconds = median_time(lambda: trainer.step([(images, mask, targets)]), repeats)
    backend = kernels.available_backends()[-1]
    return {
        "seconds": seconds,
        "batch": len(images),
        "mlx_peak_mib": mx.get_peak_memory() / 2**20,
        "versions": f"mlx {mx.__version__}, attention backend {backend}, BLAS {kernels.blas.description()}",
    }


def measure_torch(task, repeats, size, threads):
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
    if task == "inference":
        model.eval()

        def run():
            with torch.no_grad():
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
            model(pixel_values=images, pixel_mask=pixel_mask, labels=labels).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()

    seconds = median_time(run, repeats)
    return {"seconds": seconds, "batch": batch, "versions": f"torch {torch.__version__}, {threads} threads"}


def default_checkpointing(without: dict) -> bool:
    """What configs/r50.yaml's `train.activation_checkpointing: auto` chooses for this step on this
    machine: off where the step's MLX peak without recomputation fits the memory budget."""
    from deformable_detr import load_config
    from deformable_detr.training.memory_plan import budget_bytes

    return without["mlx_peak_mib"] * 2**20 > budget_bytes(load_config(ROOT / "configs" / "r50.yaml").train)


def run_side(side, task, repeats, size, threads, checkpointing=False, torch_malloc="same"):
    """One side in its own process: its peak memory is its own."""
    sys.path.insert(0, str(ROOT))
    from deformable_detr import runtime

    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", *runtime.MALLOC)}
    if side != "ours" and torch_malloc == "same":  # ours sets itself up as it imports deformable_detr
        env = runtime.malloc_environment(env)
    command = [sys.executable, __file__, "--measure", side, "--task", task, "--repeats", str(repeats)]
    command += ["--threads", str(threads), "--train-size", f"{size[0]}x{size[1]}"]
    command += ["--checkpointing"] if checkpointing else []
    return measured(command, env, f"{side} {task}")


def compare(task: str, size: tuple, args, versions: set) -> tuple:
    """One task in PyTorch and in ours (checkpointing off and on for training): the table's rows and
    (the task's name, its bars)."""
    theirs = run_side("torch", task, args.repeats, size, args.threads, torch_malloc=args.torch_malloc)
    versions.add(f"PyTorch: {theirs['versions']}")
    name = f"{task}, batch {theirs['batch']}, {size[0]}x{size[1]}"
    bars_of_task = [("PyTorch", theirs["seconds"] / theirs["batch"])]
    measured, rows = {}, []
    for checkpointing in (False, True) if task == "train" else (False,):
        measured[checkpointing] = ours = run_side("ours", task, args.repeats, size, args.threads, checkpointing)
        versions.add(f"ours: {ours['versions']}")
    for checkpointing, ours in measured.items():
        label = "ours" if task == "inference" else f"ours, checkpointing {'on' if checkpointing else 'off'}"
        if task == "inference" or checkpointing == default_checkpointing(measured[False]):
            label += " (default)"
        rows.append(
            f"| {name}: {label} | {theirs['seconds']:.2f} | {ours['seconds']:.2f} "
            f"| {theirs['seconds'] / ours['seconds']:.2f} | {theirs['peak_rss_mib']:.0f} "
            f"| {ours['peak_rss_mib']:.0f} | {ours['mlx_peak_mib']:.0f} |"
        )
        bars_of_task.append((label.replace("ours", "this port"), ours["seconds"] / ours["batch"]))
        print(rows[-1], flush=True)
    return rows, (name, bars_of_task)


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
    parser.add_argument("--measure", choices=["ours", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    train_sizes = args.train_size
    if args.measure:
        size = SIZE if args.task == "inference" else train_sizes[0]
        if args.measure == "ours":
            result = measure_ours(args.task, args.repeats, size, args.checkpointing)
        else:
            result = measure_torch(args.task, args.repeats, size, args.threads)
        result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result))
        return

    jobs = [("inference", SIZE)] if args.task in ("inference", "both") else []
    jobs += [("train", size) for size in train_sizes] if args.task in ("train", "both") else []
    lines = [
        f"run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU: {cpu_model(count=True)}; "
        f"load average at start: {load_average()}",
        f"machine: {platform.machine()}, {platform.system()}, {args.threads} cores used by each side, "
        f"python {platform.python_version()}",
        f"median of {args.repeats} after a warm-up; ratio = PyTorch time / ours (> 1: ours faster); "
        "peak = peak RSS of each side's process (MLX: arrays only, mx.get_peak_memory); PyTorch's malloc: "
        + ("as ours (freed memory kept)" if args.torch_malloc == "same" else "glibc's defaults"),
        "",
        "| task | PyTorch (s) | ours (s) | ratio | PyTorch peak MiB | ours peak MiB | ours MLX peak MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    groups, versions = [], set()
    for task, size in jobs:
        rows, bars_of_task = compare(task, size, args, versions)
        lines += rows
        groups.append(bars_of_task)
    lines[1:1] = sorted(versions)
    text = "\n".join(lines)
    print(text)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "model_cpu.txt").write_text(text + "\n")
    title = "R50 Deformable DETR on the CPU: seconds per image (shorter is faster)"
    bars(title, groups, args.output_dir / "model_cpu.png")


if __name__ == "__main__":
    main()
