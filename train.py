"""Train Deformable DETR.

    python train.py --config configs/r50.yaml [--output-dir DIR] [--resume CKPT] [--eval-only]
                    [--weights W | --finetune W] [section.key=value ...]

--finetune W starts from a whole model of any number of classes (converted weights or a checkpoint
of this script): the class heads are rebuilt for this dataset's classes, each row whose category
name the weights record is carried over, the rest start fresh. Optimizer state is not loaded.

Several machines: `mlx.launch --hosts host1,host2 python train.py --config ...` (data parallel:
gradients averaged with all_sum, each process its own share of every epoch, rank 0 writes).
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import mlx.core as mx
import yaml
from tqdm import tqdm

from deformable_detr import build_criterion, build_model, load_config
from deformable_detr.config import config_to_dict
from deformable_detr.data import DataLoader, build_dataset, num_classes_for
from deformable_detr.engine import (
    Trainer,
    build_optimizer,
    check_sampling_offsets,
    freeze_for_training,
    load_checkpoint,
    sampling_offsets_grad_norms,
    save_checkpoint,
    seed_step,
    set_epoch_learning_rates,
)
from deformable_detr.evaluate import coco_stats, predict_detections
from deformable_detr.fast_blas import use_mkl
from deformable_detr.memory import (
    GIB,
    MemoryBudgetError,
    budget_bytes,
    check_memory,
    is_out_of_memory,
    out_of_memory_message,
)
from deformable_detr.predict import detect
from deformable_detr.visualize import draw_detections, grid, plot_curves
from deformable_detr.weights import load_for_finetuning, load_model_weights


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a YAML file of configs/")
    parser.add_argument("--output-dir", type=Path, help="default: output/<config name>")
    parser.add_argument("--resume", type=Path, help="a checkpoint.safetensors written by this script")
    starts = parser.add_mutually_exclusive_group()
    starts.add_argument("--weights", type=Path, help="start from these weights (e.g. convert --backbone-only)")
    starts.add_argument("--finetune", type=Path, help="start from a model with other classes (class heads by name)")
    parser.add_argument("--eval-only", action="store_true", help="evaluate and stop")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. schedule.batch_size=4")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    group = mx.distributed.init()
    rank, world_size = group.rank(), group.size()
    is_main = rank == 0
    output_dir = args.output_dir or Path("output") / Path(args.config).stem
    try:
        train_set = build_dataset("train", cfg.data)
        cfg.model.num_classes = num_classes_for(train_set, cfg.model.num_classes)
    except (FileNotFoundError, ValueError) as error:
        sys.exit(f"error: {error}")
    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")

    mx.random.seed(cfg.seed)
    model = build_model(cfg)
    try:
        if args.weights:
            started = f"started from {load_model_weights(model, args.weights, strict=False)} tensors of {args.weights}"
        if args.finetune:
            started = load_for_finetuning(model, args.finetune, train_set.class_names())
    except (FileNotFoundError, ValueError) as error:
        sys.exit(f"error: {error}")
    if is_main and (args.weights or args.finetune):
        print(started)
    freeze_for_training(model, cfg)
    mx.eval(model.parameters())  # materialise the initial weights once, before any step reseeds MLX's generator
    optimizer = build_optimizer(cfg)
    criterion = build_criterion(cfg)
    epoch, first_step, global_step = 0, 0, 0
    if args.resume:
        progress = load_checkpoint(args.resume, model, optimizer)
        epoch, first_step, global_step = progress["epoch"], progress["step"], progress["global_step"]
        if is_main:
            print(f"resumed from {args.resume}: epoch {epoch}, step {first_step}")
    if args.eval_only:
        stats = evaluate(model, build_dataset("val", cfg.data), cfg)
        if is_main:
            (output_dir / "eval_results.json").write_text(json.dumps(stats, indent=2))
            print(json.dumps(stats, indent=2))
        return

    loader = DataLoader(
        train_set,
        cfg.schedule.batch_size,
        shuffle=True,
        seed=cfg.seed,
        num_workers=cfg.data.num_workers,
        prefetch=cfg.data.prefetch,
        rank=rank,
        world_size=world_size,
    )
    if loader.batches_per_epoch() == 0:
        sys.exit(
            f"the train split has {len(loader.dataset)} images: fewer than schedule.batch_size "
            f"({cfg.schedule.batch_size}) x {world_size} process(es)"
        )
    trainer = Trainer(model, criterion, optimizer, cfg, group if world_size > 1 else None)
    val = build_dataset("val", cfg.data) if cfg.train.eval_every and is_main else None
    checkpoint = output_dir / "checkpoint.safetensors"
    log = open(output_dir / "log.jsonl", "a") if is_main else None
    stats = None
    max_steps = cfg.train.max_steps or math.inf

    def save(at_epoch, at_step):
        if is_main:
            save_checkpoint(checkpoint, model, optimizer, cfg, at_epoch, at_step, global_step, train_set.class_names())

    def write(record):
        if log:
            log.write(json.dumps(record) + "\n")
            log.flush()

    model.train()
    try:
        estimate = check_memory(trainer, loader.dataset, cfg, log=print if is_main else None)
    except MemoryBudgetError as error:
        sys.exit(f"error: {error}")
    if is_main:
        print(
            f"memory: a step of the largest batch needs about {estimate.describe()}; "
            f"budget {budget_bytes(cfg.train) / GIB:.1f} GiB"
        )
    step = first_step
    try:
        while epoch < cfg.schedule.epochs and global_step < max_steps:
            set_epoch_learning_rates(optimizer, cfg, epoch)
            bar = tqdm(total=loader.batches_per_epoch(), initial=step, desc=f"epoch {epoch}", disable=not is_main)
            totals, count, started = {}, 0, time.perf_counter()
            for images, mask, targets in loader.epoch(epoch, step):
                tick = time.perf_counter()
                seed_step(cfg.seed, global_step)
                try:
                    losses, grads, grad_norm = trainer.step(images, mask, targets)
                except RuntimeError as error:  # Metal's allocation failure; the CPU's was ruled out above
                    if not is_out_of_memory(error):
                        raise
                    message = out_of_memory_message(error, images.shape, cfg.train.activation_checkpointing)
                    sys.exit(f"error: {message}; last checkpoint, intact: {checkpoint}")
                if global_step == 0:
                    norms = sampling_offsets_grad_norms(grads)
                    write({"sampling_offsets_grad_norms": norms})
                    if is_main:
                        tqdm.write(
                            "sampling_offsets gradient norms, first step: "
                            + ", ".join(f"{k.replace('transformer.', '')} {v:.3g}" for k, v in norms.items())
                        )
                    if cfg.train.check_sampling_offsets:
                        check_sampling_offsets(norms)
                if not math.isfinite(losses["loss"]):
                    save(epoch, step)
                    sys.exit(f"loss is {losses['loss']} at epoch {epoch}, step {step}; stopping: {losses}")
                step, global_step, count = step + 1, global_step + 1, count + 1
                images_per_s = len(targets) * world_size / (time.perf_counter() - tick)
                lr = optimizer.optimizers[-1].learning_rate.item()
                for key, value in losses.items():
                    totals[key] = totals.get(key, 0.0) + value
                if global_step % cfg.train.log_every == 0:
                    write(
                        {
                            "epoch": epoch,
                            "step": step,
                            "global_step": global_step,
                            "lr": lr,
                            "grad_norm": grad_norm,
                            "images_per_s": images_per_s,
                            **losses,
                        }
                    )
                bar.set_postfix(loss=f"{losses['loss']:.4g}", lr=f"{lr:.2g}", img_s=f"{images_per_s:.1f}")
                bar.update()
                if cfg.train.checkpoint_every and global_step % cfg.train.checkpoint_every == 0:
                    save(epoch, step)
                if global_step >= max_steps:
                    break
            bar.close()
            write(
                {
                    "epoch": epoch,
                    "epoch_steps": count,
                    "global_step": global_step,
                    "seconds": time.perf_counter() - started,
                    **{k: v / max(count, 1) for k, v in totals.items()},
                }
            )
            if step >= loader.batches_per_epoch():
                if val is not None and (epoch + 1) % cfg.train.eval_every == 0:
                    stats = evaluate(model, val, cfg)
                    write({"epoch": epoch, "eval": stats})
                    tqdm.write(f"epoch {epoch}: AP {stats['AP']:.3f}, AP50 {stats['AP50']:.3f}")
                epoch, step = epoch + 1, 0
            save(epoch, step)
    except KeyboardInterrupt:
        save(epoch, step)
        sys.exit(f"interrupted; checkpoint at epoch {epoch}, step {step}: {checkpoint}")
    if is_main:
        if val is not None:
            stats = stats or evaluate(model, val, cfg)
            (output_dir / "eval_results.json").write_text(json.dumps(stats, indent=2))
            write_pictures(model, val, cfg, output_dir)
            print(
                f"AP {stats['AP']:.3f}, AP50 {stats['AP50']:.3f}: {output_dir / 'eval_results.json'}; "
                f"pictures: {output_dir / 'predictions.png'}, {output_dir / 'curves.png'}"
            )
        print(f"done: {global_step} steps; checkpoint {checkpoint}")


def evaluate(model, val, cfg):
    """COCO box AP on the val split; leaves the model in training mode."""
    detections = predict_detections(model, val, cfg.schedule.batch_size, cfg.data.num_workers)
    model.train()
    return coco_stats(val.coco, detections, verbose=False)


def write_pictures(model, val, cfg, output_dir, count=6, threshold=0.3):
    """predictions.png: the first val images with what the model finds (scores >= threshold);
    curves.png: loss and AP per epoch."""
    model.eval()
    names = val.class_names()
    drawn = []
    for index in range(min(count, len(val))):
        image, _ = val.load(index)
        detections = detect(model, image, cfg.data.val_size, cfg.data.max_size)
        drawn.append(draw_detections(image, detections, names, threshold))
    grid(drawn).save(output_dir / "predictions.png")
    records = [json.loads(line) for line in (output_dir / "log.jsonl").read_text().splitlines()]
    plot_curves(
        {
            "training loss (epoch mean)": [(r["epoch"], r["loss"]) for r in records if "epoch_steps" in r],
            "val AP50": [(r["epoch"], r["eval"]["AP50"]) for r in records if "eval" in r],
            "val AP": [(r["epoch"], r["eval"]["AP"]) for r in records if "eval" in r],
        },
        output_dir / "curves.png",
    )
    model.train()


if __name__ == "__main__":
    use_mkl()
    main()
