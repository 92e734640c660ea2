"""Train Deformable DETR.

    deformable-detr train --config r50 [--output-dir DIR] [--resume [CKPT] [--allow-change KEY] | --overwrite]
                          [--eval-only] [--weights W | --finetune W] [section.key=value ...]

(also `python -m deformable_detr.train`, or a checkout's `python train.py`). --config: a YAML file, or a
shipped config's name (r50, shapes, ...); its relative data paths are relative to the current directory.

The output directory has one owner: a second run into it stops at once. A fresh run into a directory
holding a checkpoint stops before writing anything: `--resume` continues that checkpoint (the same
command, relaunched after a preemption, carries on; with none there, it starts afresh), `--overwrite`
starts afresh, removing the earlier run's files once the new run is set up.

--resume compares the config with the checkpoint's (`training/resume_check.py`; config.py's
RESUME_EFFECTS classes every key): a change of what is trained or in what order (seed, batch size,
schedule, optimizer, model, data set, augmentation, precision, EMA) stops the run before anything is
built, naming each key with both values, unless `--allow-change KEY` (repeated, or comma-separated)
allows it; the others (workers, cadences, memory, the stop, the data set's path spelled another way)
are noted. config.yaml and the checkpoints keep each change with the global step it holds from.

--finetune W starts from a whole model of any number of classes (converted weights or a checkpoint
of this script): the class heads are rebuilt for this dataset's classes, each row whose category
name the weights record is carried over, the rest start fresh. Optimizer state is not loaded.

Several machines: `mlx.launch --hosts host1,host2 python train.py --config ...` (data parallel:
gradients averaged with all_sum, each process its own share of every epoch, rank 0 writes).
"""

import json
import sys
from pathlib import Path

import mlx.core as mx

from ..config import load_config
from ..data import DataLoader, build_dataset, num_classes_for
from ..data.ground_truth import dropped_line, split_summary, summary_lines
from ..errors import UsageError, entry_point
from ..inference.evaluation import evaluate, per_class_table
from ..models import build_model
from ..models.combinations import check_model
from ..models.precision import check_training_precision
from ..training.engine import Progress, fit
from ..training.mlflow_run import require_mlflow
from ..training.resume_check import allowed_changes
from ..training.run_directory import RESUME_HERE, RunDirectory
from ..training.tensorboard import require_tensorboard
from ..training.trainer import Trainer, process_share
from ..training.wandb_run import require_wandb
from ..weights.checkpoint import load_checkpoint
from ..weights.loading import load_for_finetuning, load_model_weights
from .cli import OVERRIDE_HELP, command_parser, split_overrides


def build_parser():
    """train's parser (docs/commands.md is generated from it)."""
    parser = command_parser("train", __doc__)
    parser.add_argument("--config", required=True, help="a YAML file, or a shipped config's name (r50, shapes, ...)")
    parser.add_argument("--output-dir", type=Path, help="default: output/<config name>")
    parser.add_argument(
        "--resume",
        nargs="?",
        const=RESUME_HERE,
        metavar="CHECKPOINT",
        help="continue a run from CHECKPOINT; without it, from the output directory's (a fresh run where it has none)",
    )
    parser.add_argument(
        "--allow-change",
        action="append",
        default=[],
        metavar="KEY",
        help="with --resume: let KEY (section.key; repeated, or comma-separated) change what is trained",
    )
    parser.add_argument("--overwrite", action="store_true", help="start afresh where a run's checkpoint is")
    starts = parser.add_mutually_exclusive_group()
    starts.add_argument("--weights", help="start from these weights (e.g. convert --backbone-only)")
    starts.add_argument("--finetune", help="start from a model with other classes (class heads by name)")
    parser.add_argument("--eval-only", action="store_true", help="evaluate and stop")
    parser.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help=f"{OVERRIDE_HELP}, e.g. schedule.batch_size=4"
    )
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)  # overrides before and after the options
    if args.resume not in (None, RESUME_HERE) and "=" in args.resume and not Path(args.resume).exists():
        # `--resume a.b=c`: an override after --resume without a path, put in its place among the others
        tokens = sys.argv[1:] if argv is None else list(argv)
        before = tokens[: tokens.index(args.resume)]
        args.overrides.insert(sum(token in args.overrides for token in before), args.resume)
        args.resume = RESUME_HERE
    if args.allow_change and args.resume is None:
        parser.error("--allow-change: only with --resume (it names the keys a resumed run may change)")
    args.allow_change = allowed_changes(args.allow_change)
    args.overrides = split_overrides(args.overrides)[0]  # written as in every command (cli.py)
    return args


def start_weights(model, args, class_names: dict, say, evaluated=None):
    """--weights (some of a model's), --finetune (a model of other classes), or for --eval-only the
    checkpoint `evaluated` (its weights: its EMA where it has one) into `model`."""
    if args.weights:
        say(f"started from {load_model_weights(model, args.weights, strict=False)} tensors of {args.weights}")
    if args.finetune:
        say(load_for_finetuning(model, args.finetune, class_names))
    if evaluated:
        say(f"evaluating {load_model_weights(model, evaluated)} tensors of {evaluated}")


def evaluate_only(args, cfg, class_names: dict, run: RunDirectory):
    """--eval-only: no lock (it writes eval_results.json alone, and may evaluate a run under way)."""
    evaluated = run.checkpoint if args.resume == RESUME_HERE else args.resume
    mx.random.seed(cfg.seed)
    model = build_model(cfg)
    start_weights(model, args, class_names, run.print, evaluated)
    if run.is_main:
        stats = evaluate(model, build_dataset("val", cfg.data), cfg).stats
        run.write_results(stats)
        run.print(per_class_table(stats))
        run.print(json.dumps({k: v for k, v in stats.items() if k != "per_class"}, indent=2))
        if line := dropped_line(stats["ground_truth"]):
            run.print(line)


def check_settings(cfg, processes: int):
    """What the config asks that cannot be done, at once, before anything is read, built or written."""
    check_model(cfg.model)  # settings that do not go together (models/combinations.py)
    process_share(cfg, processes)  # a batch that does not split over the processes: a usage error
    if cfg.train.early_stop_patience and not cfg.train.eval_every:
        raise UsageError("train.early_stop_patience counts evaluations: it needs train.eval_every above 0")
    if problem := check_training_precision(cfg.train.precision, cfg.train.precision_even_if_slow):
        raise UsageError(problem)
    if cfg.train.tensorboard:
        require_tensorboard()
    if cfg.train.mlflow:
        require_mlflow(cfg.train.mlflow)
    if cfg.train.wandb:
        require_wandb()


@entry_point
def main(argv=None):
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    group = mx.distributed.init()
    check_settings(cfg, group.size())
    train_set = build_dataset("train", cfg.data)
    cfg.model.num_classes = num_classes_for(train_set, cfg.model.num_classes)
    output_dir = args.output_dir or Path("output") / Path(args.config).stem
    with RunDirectory(output_dir, cfg, train_set.class_names(), is_main=group.rank() == 0) as run:
        if args.eval_only:
            return evaluate_only(args, cfg, train_set.class_names(), run)
        run.claim()  # before anything is written: a second run into the directory stops here
        train(args, cfg, group, train_set, run, run.starting_point(args.resume, args.overwrite, args.allow_change))


def train(args, cfg, group, train_set, run: RunDirectory, resume):
    """Build, set up (memory plan, `resume`: the checkpoint continued, or None), write, and fit."""
    mx.random.seed(cfg.seed)
    model = build_model(cfg)
    start_weights(model, args, train_set.class_names(), run.print)
    trainer = Trainer.from_config(model, cfg, train_set.image_sizes(), group, log=run.print)  # with its memory plan
    resumed = load_checkpoint(resume, trainer) if resume else None
    run.start_writing(resume, resumed)
    progress = Progress.from_checkpoint(resumed) if resume else Progress()
    if resume:
        run.print(f"resumed from {resume}: epoch {progress.epoch}, step {progress.step}")
    val = build_dataset("val", cfg.data) if run.is_main and cfg.train.eval_every else None
    record_splits(run, {"train": train_set, "val": val})
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
    stats = fit(trainer, loader, run, progress, val)
    if stats is not None:
        run.print(
            f"AP {stats['AP']:.3f}, AP50 {stats['AP50']:.3f}: {run.path / 'eval_results.json'}; "
            f"pictures: {run.path / 'predictions.png'}, {run.path / 'curves.png'}"
            + (f", {run.path / 'confusion_matrix.png'}" if "confusion_matrix" in stats else "")
        )
        if line := dropped_line(stats["ground_truth"]):
            run.print(line)
    run.print(f"done: {progress.global_step} steps; checkpoint {run.checkpoint}")


def record_splits(run: RunDirectory, splits: dict):
    """What each split (None: not used) holds, printed and as a log.jsonl record (`split_summary`)."""
    for split, dataset in splits.items():
        if dataset is not None and run.is_main:
            summary = split_summary(dataset, split)
            run.log(summary)
            for line in summary_lines(summary):
                run.print(line)


if __name__ == "__main__":
    main()
