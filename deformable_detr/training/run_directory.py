"""A training run's directory, written by the main process alone (rank 0 in a distributed run):

config.yaml             the resolved config
log.jsonl               a JSON record per step, per epoch and per evaluation
checkpoint.safetensors  the model, optimizer state and progress (`weights/checkpoint.py`)
checkpoint_best.safetensors   the same, as it was after the evaluation of highest AP
eval_results.json, predictions.png, curves.png, pr_curves.png   at the end
"""

import dataclasses
import json
import os
from pathlib import Path

import yaml
from tqdm import tqdm

from ..config import Config, config_to_dict
from ..inference.detector import Detector
from ..inference.visualize import grid, plot_curves, pr_curves
from ..weights.checkpoint import save_checkpoint


class RunDirectory:
    """`with run:` holds log.jsonl open for the records in between."""

    def __init__(self, path, cfg: Config, class_names: dict, is_main: bool = True):
        self.path, self.cfg, self.class_names, self.is_main = Path(path), cfg, class_names, is_main
        self.checkpoint = self.path / "checkpoint.safetensors"
        self.best_checkpoint = self.path / "checkpoint_best.safetensors"
        self.log_path = self.path / "log.jsonl"
        self._log = None
        if is_main:
            self.path.mkdir(parents=True, exist_ok=True)

    def write_config(self):
        """config.yaml: the config as resolved (the memory plan's choices in place of `auto`), printed."""
        if self.is_main:
            text = yaml.safe_dump(config_to_dict(self.cfg), sort_keys=False)
            (self.path / "config.yaml").write_text(text)
            print(text, end="")

    def __enter__(self):
        if self.is_main:
            self._log = open(self.log_path, "a")
        return self

    def __exit__(self, *exception):
        if self._log is not None:
            self._log.close()
            self._log = None

    def print(self, message: str):
        if self.is_main:
            tqdm.write(message)

    def log(self, record: dict):
        if self._log is not None:
            self._log.write(json.dumps(record) + "\n")
            self._log.flush()

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
        for path in (self.checkpoint, self.best_checkpoint) if best else (self.checkpoint,):
            save_checkpoint(path, trainer.model, trainer.optimizer, self.cfg, metadata, self.class_names, trainer.ema)

    def write_results(self, stats: dict):
        if self.is_main:
            (self.path / "eval_results.json").write_text(json.dumps(stats, indent=2))

    def write_pictures(self, model, val, pr: dict, count: int = 6, threshold: float = 0.3):
        """predictions.png: the first val images with what the model finds (scores >= threshold);
        curves.png: the training loss and val AP per epoch, from the log; pr_curves.png: precision
        against recall per category (`pr`, `Evaluation.curves`)."""
        if not self.is_main:
            return
        training = model.training
        detector = Detector(model, self.cfg, val.class_names())
        images = [val.load(index)[0] for index in range(min(count, len(val)))]
        drawn = [result.draw(image) for image, result in zip(images, detector.predict(images, threshold), strict=True)]
        model.train(training)
        grid(drawn).save(self.path / "predictions.png")
        pr_curves(pr, self.path / "pr_curves.png")
        records = [json.loads(line) for line in self.log_path.read_text().splitlines()]
        plot_curves(
            {
                "training loss (epoch mean)": [(r["epoch"], r["loss"]) for r in records if "epoch_steps" in r],
                "val AP50": [(r["epoch"], r["eval"]["AP50"]) for r in records if "eval" in r],
                "val AP": [(r["epoch"], r["eval"]["AP"]) for r in records if "eval" in r],
            },
            self.path / "curves.png",
        )
