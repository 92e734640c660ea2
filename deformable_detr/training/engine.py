"""The training loop: `fit` runs the epochs from a `Progress` to the end of the schedule (or
`train.max_steps`), evaluating and checkpointing as the config says, and ends cleanly whatever
stops it:

- Ctrl-C or SIGTERM (kill, job schedulers, preemptible machines): at the end of the step under way
  (at once between steps or in an evaluation), a checkpoint with the progress, one line, exit status
  128 + the first signal's number (130, 143). A second signal inside the same step stops it as soon
  as Python has control back, without saving; the line names the checkpoint that stands (its epoch
  and step). A signal while a checkpoint is written waits for the save to complete (a checkpoint is
  never half written), then stops the run, the line naming that checkpoint. Signals are counted
  one by one, those that come while MLX computes too (`stops.py`).
- an image that cannot be read (`data.skip_bad_images=false`): a checkpoint with the progress (that
  batch not taken), one line naming the image and the way on. (With `data.skip_bad_images=true` it
  is left out: a warning, and a log record {"skipped_image": message, "epoch", "global_step"}.)
- a non-finite loss: its record in log.jsonl (the epoch, step and global step that went non-finite,
  the terms not finite as text, the others, the learning rate, the gradient norm), one line naming
  that step.
- running out of memory, or anything else: one line (anything else: its traceback in log.jsonl).
  After these no checkpoint is written: the last one stays as it was, named with its epoch and step.
In every case the data loader's threads are stopped first, so the process exits normally.
`train.early_stop_patience` N ends the schedule early, after N evaluations without a higher AP (the
best kept as checkpoint_best), with a line saying so: a normal end."""

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field

import mlx.core as mx
from tqdm import tqdm

from ..errors import CommandError
from ..inference.evaluation import evaluate
from .memory_plan import is_out_of_memory, out_of_memory_message
from .optimizer import set_epoch_learning_rates
from .run_directory import RunDirectory
from .stops import StopSignals, stopping_cleanly
from .trainer import Trainer, seed_step


@dataclass
class Progress:
    """Where a run is; saved in every checkpoint, so that a resumed run continues exactly."""

    epoch: int = 0
    step: int = 0  # steps taken in this epoch
    global_step: int = 0
    loss_sums: dict = field(default_factory=dict)  # over this epoch's steps, for its mean
    seconds: float = 0.0  # this epoch's, in steps
    best_ap: float = -1.0  # the highest val AP so far (checkpoint_best.safetensors)
    best_epoch: int = -1  # the epoch it was evaluated after
    evaluations_since_best: int = 0  # evaluations since, none higher (train.early_stop_patience)

    @classmethod
    def from_checkpoint(cls, progress: dict) -> "Progress":
        return cls(**{f.name: progress[f.name] for f in dataclasses.fields(cls) if f.name in progress})

    def add_step(self, losses: dict, seconds: float):
        self.step, self.global_step, self.seconds = self.step + 1, self.global_step + 1, self.seconds + seconds
        for key, value in losses.items():
            self.loss_sums[key] = self.loss_sums.get(key, 0.0) + value

    def next_epoch(self):
        self.epoch, self.step, self.loss_sums, self.seconds = self.epoch + 1, 0, {}, 0.0


def fit(trainer: Trainer, loader, run: RunDirectory, progress: Progress, val=None) -> dict | None:
    """Train from `progress` to the end of the schedule; evaluate on `val` (the main process's val
    split, or None) every `train.eval_every` epochs, keeping the best as checkpoint_best, and at the
    end. -> the last evaluation's stats."""
    cfg = trainer.cfg
    if loader.batches_per_epoch() == 0:
        raise ValueError(
            f"the train split has {len(loader.dataset)} images: fewer than schedule.batch_size ({loader.batch_size})"
        )
    last = None  # evaluation
    with StopSignals() as signals, stopping_cleanly(trainer, run, progress, signals):
        while progress.epoch < cfg.schedule.epochs and progress.global_step < (cfg.train.max_steps or math.inf):
            if stopped_early(trainer, progress):
                run.print(
                    f"stopped early: no higher val AP in {progress.evaluations_since_best} evaluations "
                    f"(train.early_stop_patience); the best, AP {progress.best_ap:.3f} after epoch "
                    f"{progress.best_epoch}: {run.best_checkpoint}"
                )
                break
            train_one_epoch(trainer, loader, run, progress, signals)
            evaluated, best = (
                end_epoch(trainer, run, progress, val) if progress.step == loader.batches_per_epoch() else (None, False)
            )
            with signals.saving():
                run.save(trainer, progress, best)
            last = evaluated or last
        if val is not None:
            with trainer.evaluation_weights():
                last = last or evaluate(trainer.model, val, cfg)
                run.write_results(last.stats)
                run.write_pictures(trainer.model, val, last.curves)
    return last.stats if last is not None else None


def train_one_epoch(trainer: Trainer, loader, run: RunDirectory, progress: Progress, signals: StopSignals):
    """The epoch's steps from `progress.step` on, until its end or `train.max_steps`."""
    cfg = trainer.cfg
    set_epoch_learning_rates(trainer.optimizer, cfg, progress.epoch)
    bar = tqdm(
        total=loader.batches_per_epoch(), initial=progress.step, desc=f"epoch {progress.epoch}", disable=not run.is_main
    )
    with bar, contextlib.closing(loader.epoch(progress.epoch, progress.step)) as batches:
        for micro_batches in batches:
            log_skipped_images(loader, run, progress)
            with signals.step():
                record = train_step(trainer, micro_batches, run, progress)
                if progress.global_step % cfg.train.log_every == 0:
                    run.log(record)
            bar.set_postfix(
                loss=f"{record['loss']:.4g}", lr=f"{record['lr']:.2g}", img_s=f"{record['images_per_s']:.1f}"
            )
            bar.update()
            if cfg.train.checkpoint_every and progress.global_step % cfg.train.checkpoint_every == 0:
                with signals.saving():
                    run.save(trainer, progress)
            if progress.global_step >= (cfg.train.max_steps or math.inf):
                break
    log_skipped_images(loader, run, progress)  # those of a last step whose every image was skipped


def log_skipped_images(loader, run: RunDirectory, progress: Progress):
    """A log record for each image the loader skipped (data.skip_bad_images) since the last step:
    `global_step` is the step whose batch it was left out of."""
    for message in loader.take_skipped():
        run.log({"skipped_image": message, "epoch": progress.epoch, "global_step": progress.global_step + 1})


def train_step(trainer: Trainer, micro_batches: list, run: RunDirectory, progress: Progress) -> dict:
    """One optimizer step, counted in `progress`; -> its log record."""
    seed_step(trainer.cfg.seed, progress.global_step)
    started = time.perf_counter()
    try:
        losses, grad_norm = trainer.step(micro_batches, progress.global_step)
    except RuntimeError as error:  # Metal's allocation failure (the memory check rules the CPU's out)
        if not is_out_of_memory(error):
            raise
        shape = max(images.shape for images, _, _ in micro_batches)
        message = out_of_memory_message(error, shape, trainer.cfg.train.activation_checkpointing)
        raise CommandError(f"{message}; {run.standing_checkpoint()}") from None
    if trainer.steps == 1:  # the trainer's first: it measured (and checked) every sampling_offsets layer
        norms = trainer.sampling_offsets_grad_norms
        run.log({"sampling_offsets_grad_norms": norms, "by_query_group": trainer.branch_grad_norms})
        listed = ", ".join(f"{k.replace('transformer.', '')} {v:.3g}" for k, v in norms.items())
        run.print(f"sampling_offsets gradient norms, first step: {listed}")
        for group, branch in trainer.branch_grad_norms.items():  # each training-only group's losses alone
            smallest = min(branch.values(), default=0.0)
            run.print(f"  of the {group} queries' losses alone: {len(branch)} layers, the smallest {smallest:.3g}")
    lr = trainer.optimizer.optimizers[-1].learning_rate.item()
    if not math.isfinite(losses["loss"]):
        stop_at_non_finite_loss(run, progress, losses, lr, grad_norm)
    seconds = time.perf_counter() - started
    progress.add_step(losses, seconds)
    return {
        "epoch": progress.epoch,
        "step": progress.step,
        "global_step": progress.global_step,
        "lr": lr,
        "grad_norm": grad_norm,
        "images_per_s": sum(len(targets) for _, _, targets in micro_batches) * trainer.world_size / seconds,
        **losses,
    }


def stop_at_non_finite_loss(run: RunDirectory, progress: Progress, losses: dict, lr: float, grad_norm: float):
    """A step whose loss is not finite: its record in log.jsonl (the step it was, the terms not finite
    as text, since JSON has no NaN, the others, the learning rate, the gradient norm), then a
    CommandError naming that step; nothing saved."""
    non_finite = {k: str(v) for k, v in losses.items() if not math.isfinite(v)}
    finite = {k: v for k, v in losses.items() if k not in non_finite}
    step, global_step = progress.step + 1, progress.global_step + 1  # the step's: add_step has not run
    run.log(
        {
            "epoch": progress.epoch,
            "step": step,
            "global_step": global_step,
            "non_finite_loss": non_finite,
            "lr": lr,
            "grad_norm": grad_norm if math.isfinite(grad_norm) else str(grad_norm),
            **finite,
        }
    )
    raise CommandError(
        f"the loss is {losses['loss']} at epoch {progress.epoch}, step {step} (global step {global_step}; not "
        f"finite: {', '.join(non_finite)}; its record: {run.log_path}); stopped without saving: "
        f"{run.standing_checkpoint()}"
    )


def end_epoch(trainer: Trainer, run: RunDirectory, progress: Progress, val):
    """After the epoch's last step: its evaluation (when due), then its records; the next epoch.
    -> (the evaluation or None, whether its AP is the highest so far)."""
    cfg, evaluation = trainer.cfg, None
    if val is not None and (progress.epoch + 1) % cfg.train.eval_every == 0:
        with trainer.evaluation_weights():
            evaluation = evaluate(trainer.model, val, cfg)
            run.draw_evaluation(trainer.model, val, evaluation.curves, progress.global_step)  # TensorBoard's
        stats = evaluation.stats
        run.print(f"epoch {progress.epoch}: AP {stats['AP']:.3f}, AP50 {stats['AP50']:.3f}")
    means = {k: v / max(progress.step, 1) for k, v in progress.loss_sums.items()}
    run.log(
        {
            "epoch": progress.epoch,
            "epoch_steps": progress.step,
            "global_step": progress.global_step,
            "seconds": progress.seconds,
            **means,
        }
    )
    best = evaluation is not None and evaluation.stats["AP"] > progress.best_ap
    if evaluation is not None:
        run.log({"epoch": progress.epoch, "global_step": progress.global_step, "eval": evaluation.stats})
        progress.evaluations_since_best = 0 if best else progress.evaluations_since_best + 1
        if best:
            progress.best_ap, progress.best_epoch = evaluation.stats["AP"], progress.epoch
    progress.next_epoch()
    return evaluation, best


def stopped_early(trainer: Trainer, progress: Progress) -> bool:
    """`train.early_stop_patience` evaluations without a higher AP; every process agrees (the main
    one alone evaluates: the others' count stays 0)."""
    patience = trainer.cfg.train.early_stop_patience
    stop = patience > 0 and progress.evaluations_since_best >= patience
    if trainer.world_size > 1:
        stop = mx.distributed.all_sum(mx.array(int(stop)), group=trainer.group).item() > 0
    return stop
