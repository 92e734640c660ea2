"""A training run's directory, written by the main process alone (rank 0 in a distributed run), which
owns it for the run's life (`run_lock.py`: .lock):

config.yaml             the resolved config; after a resume that changed it, the one the run started
                        with, then `changes:` (each key's [old, new] and the global step it holds from)
log.jsonl               a JSON record per step, per epoch and per evaluation; at each start one per
                        split (train.py: images, boxes, what was dropped), and one per bad image skipped
checkpoint.safetensors  the model, optimizer state and progress (`weights/checkpoint.py`)
checkpoint_best.safetensors   the same, as it was after the evaluation of highest AP
eval_results.json, predictions.png, curves.png, pr_curves.png, confusion_matrix.png   at the end
                        (the matrix's counts in eval_results.json: inference/confusion.py)
tensorboard/            with train.tensorboard: event files (`tensorboard.py`)
mlflow/                 with train.mlflow: true: MLflow's store, mlflow.db and artifacts/ (`mlflow_run.py`)
wandb/                  with train.wandb: offline: W&B's offline runs (`wandb_run.py`)
run_ids.json            with either: {"mlflow": {"tracking_uri", "run_id"}, "wandb": {"run_id"}}, the runs
                        that `train.py --resume` in this directory continues

TensorBoard, MLflow and W&B show the same numbers: the step records' (`train/`), each evaluation's
(`val/`, `val_AP_per_class/`), at their global step (`scalar_groups`). MLflow and W&B receive them as
each checkpoint is written, the steps it holds (neither can hide, as TensorBoard's restart mark does,
the steps a run killed past its checkpoint logged, which its resume takes and logs again), and at the
end the final checkpoint, config.yaml, eval_results.json and the pictures (`ARTIFACTS`).

A run starts afresh or continues a checkpoint (`starting_point`); a fresh run into a directory that
holds one stops before writing anything, unless told to overwrite it. A file that cannot be written
stops the run in one line naming it, the system's reason and the checkpoint that stays intact."""

import contextlib
import dataclasses
import datetime
import json
import os
import shutil
from pathlib import Path

from tqdm import tqdm

from ..config import Config
from ..errors import CommandError, UsageError, WriteError
from ..inference.confusion import THRESHOLD, draw_confusion_matrix
from ..inference.detector import Detector
from ..inference.visualize import grid, plot_curves, pr_curves
from ..weights.checkpoint import save_checkpoint, saved_progress
from ..weights.files import temporary_path, write_errors_named
from .mlflow_run import MLflowRun
from .resume_check import ResumedConfig, config_text
from .run_lock import RunLock
from .tensorboard import TensorBoard
from .wandb_run import WandbRun

RESUME_HERE = "the output directory's checkpoint"  # train.py's --resume without a path
# What a run writes, removed when another starts afresh in its directory (--overwrite)
RUN_FILES = ("checkpoint.safetensors", "checkpoint_best.safetensors", "log.jsonl", "config.yaml", "eval_results.json")
RUN_FILES += ("predictions.png", "curves.png", "pr_curves.png", "confusion_matrix.png", "tensorboard")
RUN_FILES += ("mlflow", "wandb", "run_ids.json")
# What MLflow and W&B keep of a run that ends (those written): the final checkpoint, its config, results, pictures
ARTIFACTS = ("checkpoint.safetensors", "config.yaml", "eval_results.json", "predictions.png", "curves.png")
ARTIFACTS += ("pr_curves.png", "confusion_matrix.png")


class RunDirectory:
    """`with run:` releases what `claim` and `start_writing` took (the lock, log.jsonl) at its end."""

    def __init__(self, path, cfg: Config, class_names: dict, is_main: bool = True):
        self.path, self.cfg, self.class_names, self.is_main = Path(path), cfg, class_names, is_main
        self.checkpoint = self.path / "checkpoint.safetensors"
        self.best_checkpoint = self.path / "checkpoint_best.safetensors"
        self.log_path = self.path / "log.jsonl"
        self.lock = RunLock(self.path)
        self._log, self._previous = None, []  # the files of an earlier run, removed by start_writing
        self._tensorboard = None
        self._trackers = {}  # "mlflow", "wandb": MLflowRun, WandbRun
        self._resumed_config, self.config_history = None, []  # `starting_point`'s; the changes made (resumes)
        if is_main:
            with self._writing(self.path):  # a read-only or missing parent: named as any write is
                self.path.mkdir(parents=True, exist_ok=True)

    def claim(self):
        """The main process locks the directory for the run (another run holding it: a CommandError),
        then removes what a run killed while saving left: a checkpoint's temporary file, never renamed."""
        if self.is_main:
            with self._writing(self.lock.path):  # the directory's first file: where it cannot be written
                self.lock.acquire()
            if self.lock.unlocked_because:
                self.print(
                    f"warning: cannot lock {self.lock.path} ({self.lock.unlocked_because}: a file system without "
                    "flock); running unlocked: make sure no other run writes to this directory"
                )
            for partial in map(temporary_path, (self.checkpoint, self.best_checkpoint)):
                if partial.is_file():  # the lock held: no save of another run is under way
                    with self._writing(partial):
                        partial.unlink()
                    self.print(f"removed {partial}: part of a checkpoint, left by a run stopped while saving it")

    def starting_point(self, resume, overwrite: bool, allowed_changes=frozenset()) -> Path | None:
        """-> the checkpoint to continue (`resume`: a path, or RESUME_HERE: this directory's, where it
        has one), or None: a fresh run. A checkpoint continued is compared with the config
        (`resume_check.py`): a change of what is trained not in `allowed_changes` stops here."""
        checkpoint = self._checkpoint_to_continue(resume, overwrite)
        self._resumed_config = ResumedConfig.read(checkpoint) if checkpoint is not None else None
        if self._resumed_config is not None:
            self._resumed_config.check(self.cfg, allowed_changes)
        return checkpoint

    def _checkpoint_to_continue(self, resume, overwrite: bool) -> Path | None:
        """`starting_point`'s checkpoint. A start other than from this directory's own checkpoint,
        into a directory holding one, stops here unless `overwrite`; the earlier run's files are then
        removed by `start_writing`, once the new run is set up (a run that fails before that, on a
        wrong setting or too little memory, leaves them as they were)."""
        if resume not in (None, RESUME_HERE) and not Path(resume).is_file():
            raise FileNotFoundError(f"{resume}: no such file")
        if resume == RESUME_HERE:
            if overwrite:
                raise UsageError("--resume without a path continues this directory's run, --overwrite replaces it")
            if self.checkpoint.is_file():
                return self.checkpoint
            self.print(f"--resume: no checkpoint in {self.path}: a fresh run")
            resume = None
        elif resume is not None and self.checkpoint.is_file() and Path(resume).resolve() == self.checkpoint.resolve():
            return self.checkpoint
        held = next((p for p in (self.checkpoint, self.best_checkpoint) if p.is_file()), None)
        if held is not None and not overwrite:
            raise CommandError(
                f"{self.path} holds a run ({held.name} at {describe_checkpoint(held)}): "
                + ("continue it with --resume, or" if resume is None else f"to continue {resume} here,")
                + " start afresh with --overwrite (its checkpoints, log and TensorBoard events are removed);"
                + " or give another --output-dir"
            )
        self._previous = [self.path / name for name in RUN_FILES if (self.path / name).exists()]
        return resume

    def start_writing(self, resumed_from=None, progress: dict | None = None):
        """Once the run is set up (model built, memory planned, checkpoint loaded): an earlier run's
        files removed (see `starting_point`), the log cut back to the checkpoint resumed (`resume`),
        config.yaml written (with the changes a resume made to the config, noted), log.jsonl opened."""
        if not self.is_main:
            return
        if resumed_from is not None and self._resumed_config is not None:
            self.config_history, note = self._resumed_config.record(self.cfg, progress["global_step"] + 1)
            if note:
                self.print(note)
        for path in self._previous:
            with self._writing(path):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
        if self._previous:
            names = ", ".join(p.name for p in self._previous)
            self.print(f"started afresh: removed the earlier run's {names} from {self.path}")
        if resumed_from is not None:
            self.resume(resumed_from, progress)
        self.write_config()
        with self._writing(self.log_path):
            self._log = open(self.log_path, "a")
        if self.cfg.train.tensorboard:
            first = progress["global_step"] + 1 if progress is not None else None
            with self._writing(self.path / "tensorboard"):
                self._tensorboard = TensorBoard(self.path / "tensorboard", purge_step=first)
        self._start_trackers(resumed_from, progress)

    def _start_trackers(self, resumed_from, progress: dict | None):
        """The MLflow and W&B runs the config asks for: those run_ids.json names where this directory's
        checkpoint is continued, else new ones; their ids written there. One that cannot start stops
        the run in one line, before its first step."""
        train, ids_path = self.cfg.train, self.path / "run_ids.json"
        continued = resumed_from is not None and Path(resumed_from).resolve() == self.checkpoint.resolve()
        known = json.loads(ids_path.read_text()) if continued and ids_path.is_file() else {}
        starts = {"mlflow": (MLflowRun, train.mlflow), "wandb": (WandbRun, train.wandb)}
        for name, (tracker, setting) in starts.items():
            if not setting:
                continue
            try:
                self._trackers[name] = tracker(
                    setting, self.path, self.cfg, known.get(name), self.print, self.config_history
                )
            except Exception as error:  # a server away, a store that cannot be opened: its own words
                raise CommandError(f"train.{name}: cannot start its run: {first_line(error)}") from error
        if self._trackers:
            with self._writing(ids_path):
                ids_path.write_text(json.dumps({**known, **{k: t.ids() for k, t in self._trackers.items()}}, indent=2))

    def write_config(self):
        """config.yaml: the config as resolved (the memory plan's choices in place of `auto`), printed;
        where resumes changed it, the config the run started with and `changes:` (`config_text`),
        which `load_config` reads as the config in effect last."""
        if self.is_main:
            text = config_text(self.cfg, self.config_history)
            with self._writing(self.path / "config.yaml"):
                (self.path / "config.yaml").write_text(text)
            print(text, end="")

    def __enter__(self):
        return self

    def __exit__(self, *exception):
        if self._log is not None:
            with contextlib.suppress(OSError):  # what it holds was flushed with each record
                self._log.close()
            self._log = None
        if self._tensorboard is not None:
            with contextlib.suppress(OSError):  # likewise
                self._tensorboard.close()
            self._tensorboard = None
        self._end_trackers(exception[1])
        self.lock.release()

    def _end_trackers(self, error: BaseException | None):
        """A run that ended (`error` None): MLflow's and W&B's last scalars and the `ARTIFACTS`; a run
        stopped (by a signal: killed) or failed, marked so, without the steps past its checkpoint."""
        for name, tracker in self._trackers.items():
            try:
                if error is None:
                    tracker.finish([self.path / file for file in ARTIFACTS if (self.path / file).is_file()])
                else:
                    tracker.stop(killed=isinstance(error, CommandError) and error.status > 128)
            except Exception as problem:  # the run's own files are written: a line, not a failure
                self.print(f"warning: train.{name}: could not end its run: {first_line(problem)}")
        self._trackers = {}

    def print(self, message: str):
        if self.is_main:
            tqdm.write(message)

    def log(self, record: dict):
        """A record of log.jsonl; a step's or an evaluation's scalars in TensorBoard, MLflow and W&B
        too (`scalar_groups`), and an evaluation's confusion matrix in TensorBoard."""
        if self._log is not None:
            with self._writing(self.log_path):
                self._log.write(json.dumps(record) + "\n")
                self._log.flush()
        groups = scalar_groups(record)
        if self._tensorboard is not None and groups:
            with self._writing(self.path / "tensorboard"):
                for prefix, values in groups:
                    self._tensorboard.scalars(values, record["global_step"], prefix)
                if "confusion_matrix" in record.get("eval", {}):
                    picture = draw_confusion_matrix(record["eval"]["confusion_matrix"])
                    self._tensorboard.image("val/confusion_matrix", picture, record["global_step"])
                self._tensorboard.flush()  # record by record, as the log: what TensorBoard shows is current
        for tracker in self._trackers.values():  # sent at the next checkpoint (`save`)
            for prefix, values in groups:
                tracker.scalars(values, record["global_step"], prefix)

    def resume(self, checkpoint, progress: dict):
        """Before the log is opened: a run killed after its last checkpoint (kill -9, a power cut)
        logged steps that the resumed run takes, and logs, again. When `checkpoint` is this
        directory's, the log is cut back to its length at that checkpoint, so each step is in it once."""
        logged = progress.get("log_bytes")
        if not self.is_main or logged is None or Path(checkpoint).resolve() != self.checkpoint.resolve():
            return
        if self.log_path.is_file() and self.log_path.stat().st_size >= logged:
            os.truncate(self.log_path, logged)

    def save(self, trainer, progress, best: bool = False):
        """The checkpoint (`best`: and the best one, the same), with `progress` (a dataclass) and the
        log's length (for `resume`)."""
        if not self.is_main:
            return
        logged = os.fstat(self._log.fileno()).st_size if self._log is not None else None
        metadata = {**dataclasses.asdict(progress), "log_bytes": logged}
        model, optimizer, ema = trainer.model, trainer.optimizer, trainer.ema
        for path in (self.checkpoint, self.best_checkpoint) if best else (self.checkpoint,):
            with self._writing(path):
                save_checkpoint(path, model, optimizer, self.cfg, metadata, self.class_names, ema, self.config_history)
        for name, tracker in self._trackers.items():  # the steps the checkpoint holds: each sent once
            try:
                tracker.flush()
            except Exception as error:  # a server away: they stay, for the next checkpoint to send
                self.print(f"warning: train.{name}: {first_line(error)}; its scalars wait for the next checkpoint")

    @contextlib.contextmanager
    def _writing(self, path):
        """A failed write of `path` -> one line: the file, the system's reason, the checkpoint intact."""
        try:
            with write_errors_named(path):
                yield
        except WriteError as error:
            standing = self.standing_checkpoint(best=Path(error.path) == self.best_checkpoint)
            raise CommandError(f"{error}; {standing}") from error

    def standing_checkpoint(self, best: bool = False) -> str:
        """What a run that stops leaves: 'the last checkpoint, intact: PATH (epoch 2, step 5, ...)'
        (`best`: the best one), or 'no checkpoint written yet'."""
        kept, label = (self.best_checkpoint, "the best") if best else (self.checkpoint, "the last")
        if not kept.is_file():
            return "no checkpoint written yet"
        return f"{label} checkpoint, intact: {kept} ({describe_checkpoint(kept)})"

    def write_results(self, stats: dict):
        """eval_results.json, and confusion_matrix.png where `stats` has the matrix."""
        if self.is_main:
            with self._writing(self.path / "eval_results.json"):
                (self.path / "eval_results.json").write_text(json.dumps(stats, indent=2))
            if "confusion_matrix" in stats:
                with self._writing(self.path / "confusion_matrix.png"):
                    draw_confusion_matrix(stats["confusion_matrix"], self.path / "confusion_matrix.png")

    def write_pictures(self, model, val, pr: dict, count: int = 6, threshold: float = THRESHOLD):
        """predictions.png: the first val images with what the model finds (scores >= threshold);
        curves.png: the training loss and val AP per epoch, from the log; pr_curves.png: precision
        against recall per category (`pr`, `Evaluation.curves`)."""
        if not self.is_main:
            return
        with self._writing(self.path / "predictions.png"):
            predictions_grid(model, self.cfg, val, count, threshold).save(self.path / "predictions.png")
        with self._writing(self.path / "pr_curves.png"):
            pr_curves(pr, self.path / "pr_curves.png")
        records = [json.loads(line) for line in self.log_path.read_text().splitlines()]
        with self._writing(self.path / "curves.png"):
            plot_curves(
                {
                    "training loss (epoch mean)": [(r["epoch"], r["loss"]) for r in records if "epoch_steps" in r],
                    "val AP50": [(r["epoch"], r["eval"]["AP50"]) for r in records if "eval" in r],
                    "val AP": [(r["epoch"], r["eval"]["AP"]) for r in records if "eval" in r],
                },
                self.path / "curves.png",
            )

    def draw_evaluation(self, model, val, pr: dict, step: int, count: int = 6, threshold: float = THRESHOLD):
        """With TensorBoard: the pictures of an evaluation (as `write_pictures` draws them at the end)
        at its global `step`; `model` with the weights evaluated."""
        if self._tensorboard is None:
            return
        predictions = predictions_grid(model, self.cfg, val, count, threshold)
        with self._writing(self.path / "tensorboard"):
            self._tensorboard.image("val/predictions", predictions, step)
            self._tensorboard.image("val/pr_curves", pr_curves(pr), step)
            self._tensorboard.flush()


def scalar_groups(record: dict) -> list[tuple[str, dict]]:
    """The numbers of a step record ("train": losses, lr, gradient norm, images/s) or an evaluation
    record ("val": AP, AP50, ...; "val_AP_per_class": each category's AP), as (group, {name: number});
    [] for the log's other records."""

    def numbers(values: dict) -> dict:
        return {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    if "eval" in record:
        stats = record["eval"]
        per_class = {name: values["AP"] for name, values in stats.get("per_class", {}).items()}
        return [("val", numbers(stats)), ("val_AP_per_class", numbers(per_class))]
    if "loss" in record and "step" in record:
        return [("train", numbers({k: v for k, v in record.items() if k not in ("epoch", "step", "global_step")}))]
    return []


def first_line(error: BaseException) -> str:
    """An error's message, its first line (MLflow's carry the server's whole answer), or its class."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def predictions_grid(model, cfg: Config, val, count: int, threshold: float):
    """The first `count` val images with what `model` finds there (scores >= threshold), in a grid;
    the model is left in the mode it was in."""
    training = model.training
    detector = Detector(model, cfg, val.class_names())
    images = [val.load(index)[0] for index in range(min(count, len(val)))]
    drawn = [result.draw(image) for image, result in zip(images, detector.predict(images, threshold), strict=True)]
    model.train(training)
    return grid(drawn)


def describe_checkpoint(path) -> str:
    """'epoch 2, step 5, global step 45, written 2025-01-31 12:00' from a checkpoint's header."""
    try:
        progress = saved_progress(path)
        where = f"epoch {progress['epoch']}, step {progress['step']}, global step {progress['global_step']}"
    except (OSError, ValueError, KeyError) as error:
        return f"unreadable: {error}"
    written = datetime.datetime.fromtimestamp(Path(path).stat().st_mtime).strftime("%Y-%m-%d %H:%M")
    return f"{where}, written {written}"
