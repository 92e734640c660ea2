"""Train Deformable DETR.

    python train.py --config configs/r50.yaml [--output-dir DIR] [--resume CKPT] [--eval-only]
                    [--weights W | --finetune W] [section.key=value ...]

--finetune W starts from a whole model of any number of classes (converted weights or a checkpoint
of this script): the class heads are rebuilt for this dataset's classes, each row whose category
name the weights record is carried over, the rest start fresh. Optimizer state is not loaded.

Several machines: `mlx.launch --hosts host1,host2 python train.py --config ...` (data parallel:
gradients averaged with all_sum, each process its own share of every epoch, rank 0 writes).
"""

import json
from pathlib import Path

from deformable_detr import build_model, load_config
from deformable_detr.cli import ArgumentParser, entry_point
from deformable_detr.data import DataLoader, build_dataset, num_classes_for
from deformable_detr.inference.evaluation import evaluate, evaluation_batch_size, per_class_table
from deformable_detr.training.engine import Progress, fit
from deformable_detr.training.run_directory import RunDirectory
from deformable_detr.training.trainer import Trainer, process_share
from deformable_detr.weights.checkpoint import load_checkpoint
from deformable_detr.weights.loading import load_for_finetuning, load_model_weights

import mlx.core as mx


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a YAML file of configs/")
    parser.add_argument("--output-dir", type=Path, help="default: output/<config name>")
    parser.add_argument("--resume", type=Path, help="a checkpoint.safetensors written by this script")
    starts = parser.add_mutually_exclusive_group()
    starts.add_argument("--weights", help="start from these weights (e.g. convert --backbone-only)")
    starts.add_argument("--finetune", help="start from a model with other classes (class heads by name)")
    parser.add_argument("--eval-only", action="store_true", help="evaluate and stop")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. schedule.batch_size=4")
    return parser.parse_args(argv)


def start_weights(model, args, class_names: dict, say):
    """--weights (some of a model's), --finetune (a model of other classes), or for --eval-only --resume
    (the checkpoint's weights: its EMA where it has one) into `model`."""
    if args.weights:
        say(f"started from {load_model_weights(model, args.weights, strict=False)} tensors of {args.weights}")
    if args.finetune:
        say(load_for_finetuning(model, args.finetune, class_names))
    if args.eval_only and args.resume:
        say(f"evaluating {load_model_weights(model, args.resume)} tensors of {args.resume}")


def evaluate_only(model, cfg, run: RunDirectory):
    if run.is_main:
        val, batch = build_dataset("val", cfg.data), evaluation_batch_size(cfg)
        stats = evaluate(model, val, batch, cfg.data.num_workers, backend=cfg.evaluation.backend).stats
        run.write_results(stats)
        run.print(per_class_table(stats))
        run.print(json.dumps({k: v for k, v in stats.items() if k != "per_class"}, indent=2))


@entry_point
def main(argv=None):
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    group = mx.distributed.init()
    process_share(cfg, group.size())  # a batch that does not split over the processes: a usage error, at once
    train_set = build_dataset("train", cfg.data)
    cfg.model.num_classes = num_classes_for(train_set, cfg.model.num_classes)
    output_dir = args.output_dir or Path("output") / Path(args.config).stem
    run = RunDirectory(output_dir, cfg, train_set.class_names(), is_main=group.rank() == 0)

    mx.random.seed(cfg.seed)
    model = build_model(cfg)
    start_weights(model, args, train_set.class_names(), run.print)
    if args.eval_only:
        return evaluate_only(model, cfg, run)
    trainer = Trainer.from_config(model, cfg, train_set.image_sizes(), group, log=run.print)  # with its memory plan
    run.write_config()
    progress = Progress()
    if args.resume:
        resumed = load_checkpoint(args.resume, trainer)
        run.resume(args.resume, resumed)
        progress = Progress.from_checkpoint(resumed)
        run.print(f"resumed from {args.resume}: epoch {progress.epoch}, step {progress.step}")
    val = build_dataset("val", cfg.data) if run.is_main and cfg.train.eval_every else None
    micro, share = trainer.micro_batch_size, cfg.schedule.batch_size // group.size()
    run.print(f"{cfg.schedule.batch_size} images a step: {group.size()} process(es) x {share // micro} of {micro}")
    loader = DataLoader(
        train_set,
        cfg.schedule.batch_size,
        seed=cfg.seed,
        num_workers=cfg.data.num_workers,
        prefetch=cfg.data.prefetch,
        rank=group.rank(),
        world_size=group.size(),
        micro_batch_size=micro,
    )
    with run:
        stats = fit(trainer, loader, run, progress, val)
    if stats is not None:
        run.print(
            f"AP {stats['AP']:.3f}, AP50 {stats['AP50']:.3f}: {run.path / 'eval_results.json'}; "
            f"pictures: {run.path / 'predictions.png'}, {run.path / 'curves.png'}"
        )
    run.print(f"done: {progress.global_step} steps; checkpoint {run.checkpoint}")


if __name__ == "__main__":
    main()
