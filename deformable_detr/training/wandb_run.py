"""Weights & Biases tracking of a training run (`train.wandb: offline`, the `wandb` extra): the
resolved config as the run's config, the step records' scalars (`train/`), each evaluation's AP, AP50,
... (`val/`) and each category's AP (`val_AP_per_class/`) at their global step, as TensorBoard has
them (`tensorboard.py`); at the end, an artifact `run-<id>` (type model) of the final checkpoint,
config.yaml, eval_results.json and the pictures.

Offline: W&B writes the run under <run>/wandb/offline-run-<time>-<id>/ and nothing leaves the
machine; `wandb sync <run>/wandb/offline-run-*` uploads it later (a W&B account), `wandb beta leet
<run>/wandb` shows it in the terminal. The project is $WANDB_PROJECT, else "deformable-detr"; the run
is named after the run directory. W&B keeps a copy of each artifact file until it is synced (in
$WANDB_DATA_DIR, by default ~/.local/share/wandb): the checkpoint's size again.

The x axis of every chart is `global_step`, logged with each row (W&B's `define_metric`): W&B's own
step counts rows, starts again in each offline folder of a resumed run, and keeps a row open until
the next step comes. Each step once, after a resume too: as for MLflow (`mlflow_run.py`), the scalars
go to W&B when a checkpoint is written (`flush`). `train.py --resume` in the same directory continues
the run whose id run_ids.json keeps: offline, W&B starts another offline-run folder of that id, and
`wandb sync` of them all uploads them in order, into the one run. (Killed with kill -9, a process
keeps in its folder what W&B's writer had written of it: the writer writes every 15 seconds.)"""

import os
from pathlib import Path

from ..config import config_to_dict
from ..errors import optional

PROJECT = "deformable-detr"  # where $WANDB_PROJECT is not set
MODES = ("offline",)  # train.wandb's values other than false


def require_wandb():
    """Before a run starts: `train.wandb` without the package is one line naming the extra."""
    optional("wandb", "wandb", "train.wandb")


class WandbRun:
    """The W&B run of a training run, in `mode` (offline). `known`: run_ids.json's {"run_id"} of the
    run to continue (a resume in the same directory), or None: a new one. `log`: where notes are
    printed. (`history`, the changes resumes made, MLflowRun's: W&B takes a resumed run's config as it is.)"""

    def __init__(self, mode: str, run_path: Path, cfg, known: dict | None, log, history: list = ()):
        import wandb

        self._wandb, self._pending = wandb, []  # pending: rows {"global_step", name: value} since the last checkpoint
        self.run = wandb.init(
            mode=mode,
            dir=str(run_path),
            project=None if os.environ.get("WANDB_PROJECT") else PROJECT,
            name=Path(run_path).name,
            id=known["run_id"] if known else None,
            resume="allow" if known else None,
            config=config_to_dict(cfg),
            # a run of its own (not the one a notebook may have open); our own lines, not W&B's banner;
            # stdout and stderr left alone (the progress bars, and the command's one-line errors)
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run.define_metric("global_step")
        self.run.define_metric("*", step_metric="global_step")
        self.folder = Path(self.run.settings.sync_dir)
        log(f"W&B: {mode} run {self.run.id} in {self.folder}; upload it with `wandb sync {self.folder}`")

    def scalars(self, values: dict, step: int, prefix: str):
        """`prefix`/name of each number in `values`, at `step`: sent at the next `flush` (in one row
        with the others of that step taken since the last flush)."""
        if not self._pending or self._pending[-1]["global_step"] != step:
            self._pending.append({"global_step": step})
        self._pending[-1].update({f"{prefix}/{name}": float(value) for name, value in values.items()})

    def flush(self):
        """What `scalars` took since the last flush, to W&B (at a checkpoint: the steps it holds)."""
        while self._pending:
            self.run.log(self._pending[0])  # a row of its own, written as it comes
            del self._pending[0]

    def finish(self, artifacts: list):
        """At a run's end: what is pending, an artifact of the files `artifacts`, the run finished."""
        self.flush()
        if artifacts:
            artifact = self._wandb.Artifact(f"run-{self.run.id}", type="model")
            for path in artifacts:
                artifact.add_file(str(path))
            self.run.log_artifact(artifact)
        self.run.finish()

    def stop(self, killed: bool):
        """A run that stops before its end: the scalars since the checkpoint dropped (log.jsonl has
        them; the resumed run sends them), the run finished with a failing exit code."""
        self._pending.clear()
        self.run.finish(exit_code=130 if killed else 1)

    def ids(self) -> dict:
        return {"run_id": self.run.id}
