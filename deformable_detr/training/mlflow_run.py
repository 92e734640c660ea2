"""MLflow tracking of a training run (`train.mlflow: true | URI`, the `mlflow` extra): the resolved
config as the run's params, the step records' scalars (`train/`: losses, lr, gradient norm, images/s),
each evaluation's AP, AP50, ... (`val/`) and each category's AP (`val_AP_per_class/`) at their global
step, as TensorBoard has them (`tensorboard.py`); at the end, the final checkpoint, config.yaml,
eval_results.json and the pictures as artifacts.

Where: `true` is $MLFLOW_TRACKING_URI where it is set, else a store in the run directory,
<run>/mlflow/mlflow.db (SQLite) with the artifacts in <run>/mlflow/artifacts; a URI is MLflow's
tracking URI as given (http://host:5000, sqlite:///path.db, databricks, ...). The experiment is
$MLFLOW_EXPERIMENT_NAME, else "deformable-detr"; the run is named after the run directory.

The extra is mlflow-skinny (MLflow's client without its server, UI and data-science dependencies)
with SQLAlchemy and Alembic, which its SQLite store needs (skinny's own advice for "SQL-based metadata
storage"): about 85 MB over this package's own dependencies, where the full `mlflow` package is some
430 MB (pyarrow, pandas, scikit-learn, matplotlib, Flask). Skinny's other local store, the file store (./mlruns), is in
maintenance mode since MLflow 3.7: it refuses to open unless MLFLOW_ALLOW_FILE_STORE=true. `mlflow ui`
or `mlflow server`, to look at the runs, is the full package (`pip install mlflow`), anywhere.

Each step once, after a resume too: MLflow cannot delete what a run logged, so the scalars are sent
when a checkpoint is written (`flush`), the same steps as the checkpoint holds; a run killed after it
(kill -9, a power cut) logged the later steps to log.jsonl alone, and the resumed run sends them once.
`train.py --resume` in the same directory continues the MLflow run whose id run_ids.json keeps. The
params are the config the run started with (as config.yaml's first part), which MLflow keeps as first
logged; each key a resume changed (config.yaml's `changes:`) is a tag `config_change.<key>`:
"old -> new from global step N" ("; " between changes of one key)."""

import os
import re
import time
from pathlib import Path

from ..config import flat_config
from ..errors import optional

EXPERIMENT = "deformable-detr"  # where $MLFLOW_EXPERIMENT_NAME is not set
REMOTE_SCHEMES = ("http", "https", "databricks")  # served stores: no database client needed here


def require_mlflow(setting):
    """Before a run starts: `train.mlflow` without the packages its store needs is one line naming
    the extra."""
    needed = ["mlflow.tracking"]
    if setting is True or uri_scheme(setting) not in (*REMOTE_SCHEMES, "file", ""):  # "": a folder, the file store
        needed += ["sqlalchemy", "alembic"]  # MLflow's database stores (SQLite, PostgreSQL, ...)
    for module in needed:
        optional(module, "mlflow", "train.mlflow")


def uri_scheme(uri: str) -> str:
    return uri.split(":", 1)[0].split("+", 1)[0].lower() if ":" in uri else ""


def tracking_uri(setting, run_path: Path) -> str:
    """`train.mlflow` -> the tracking URI (the module's docstring)."""
    if setting is not True:
        return setting
    return os.environ.get("MLFLOW_TRACKING_URI") or own_store(run_path)


def own_store(run_path: Path) -> str:
    """The URI of the run directory's own store, <run>/mlflow/mlflow.db."""
    return f"sqlite:///{(Path(run_path) / 'mlflow' / 'mlflow.db').resolve()}"


def metric_name(name: str) -> str:
    """A name MLflow takes as a metric's: letters, digits, _ - and spaces (a class named "a/b" or "a+b")."""
    return re.sub(r"[^\w\- ]", "_", str(name))


class MLflowRun:
    """The MLflow run of a training run. `known`: run_ids.json's {"tracking_uri", "run_id"} of the run
    to continue (a resume in the same directory), or None: a new one. `log`: where notes are printed;
    `history`: the changes resumes made to the config (`ResumedConfig.record`'s)."""

    def __init__(self, setting, run_path: Path, cfg, known: dict | None, log, history: list = ()):
        from mlflow.entities import Param, RunStatus, RunTag
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self._Param, self._status = Param, RunStatus
        self.uri = tracking_uri(setting, run_path)
        self.client = MlflowClient(self.uri)
        self._pending = []  # the metrics since the last checkpoint
        run = None
        if known is not None and known.get("tracking_uri") == self.uri:
            try:
                run = self.client.get_run(known["run_id"])
            except MlflowException as error:
                log(f"MLflow: run {known['run_id']} is not in {self.uri} ({error.error_code}): a new run")
            if run is not None and run.info.lifecycle_stage != "active":
                log(f"MLflow: run {known['run_id']} was deleted from {self.uri}: a new run")
                run = None
        elif known is not None:
            log(f"MLflow: the run was tracked in {known.get('tracking_uri')}; now in {self.uri}: a new run")
        params = {key: str(value) for key, value in flat_config(cfg).items()}
        for change in reversed(history):  # undone: the config the run started with
            params |= {key: str(pair[0]) for key, pair in change.items() if key != "from_global_step"}
        if run is None:
            run = self.client.create_run(self._experiment(run_path), run_name=Path(run_path).name)
            self.run_id = run.info.run_id
            self.client.set_tag(self.run_id, "run_directory", str(Path(run_path).resolve()))
            self._log_params(params)
        else:
            self.run_id = run.info.run_id
            self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            logged = run.data.params
            self._log_params({k: v for k, v in params.items() if k not in logged})  # keys newer than the run
        changes = {}
        for change in history:
            for key, (old, new) in ((k, v) for k, v in change.items() if k != "from_global_step"):
                changes.setdefault(key, []).append(f"{old} -> {new} from global step {change['from_global_step']}")
        tags = [RunTag(f"config_change.{key}", "; ".join(texts)) for key, texts in changes.items()]
        for start in range(0, len(tags), 100):  # MLflow's most tags a batch
            self.client.log_batch(self.run_id, tags=tags[start : start + 100])
        where = self.client.get_experiment(run.info.experiment_id).name
        log(f"MLflow: run {self.run_id} ({run.info.run_name}) of experiment {where!r} in {self.uri}")

    def _experiment(self, run_path: Path) -> str:
        """The experiment's id, created where it is not there (in the run directory's own store, with
        its artifacts beside the database; elsewhere where the store puts them)."""
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or EXPERIMENT
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        own = self.uri == own_store(run_path)
        location = (Path(run_path) / "mlflow" / "artifacts").resolve().as_uri() if own else None
        return self.client.create_experiment(name, artifact_location=location)

    def _log_params(self, params: dict):
        items = [self._Param(key, value) for key, value in params.items()]
        for start in range(0, len(items), 100):  # MLflow's most params a batch
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def scalars(self, values: dict, step: int, prefix: str):
        """`prefix`/name of each number in `values`, at `step`: sent at the next `flush`."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending += [Metric(f"{prefix}/{metric_name(k)}", float(v), now, step) for k, v in values.items()]

    def flush(self):
        """What `scalars` took since the last flush, to MLflow (at a checkpoint: the steps it holds)."""
        while self._pending:
            batch = self._pending[:1000]  # MLflow's most metrics a batch
            self.client.log_batch(self.run_id, metrics=batch)
            del self._pending[: len(batch)]

    def finish(self, artifacts: list):
        """At a run's end: what is pending, the `artifacts` (paths), the run marked finished."""
        self.flush()
        for path in artifacts:
            self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, self._status.to_string(self._status.FINISHED))

    def stop(self, killed: bool):
        """A run that stops before its end (`killed`: by a signal, its checkpoint written): marked so;
        the scalars since the checkpoint dropped (log.jsonl has them; the resumed run sends them)."""
        self._pending.clear()
        status = self._status.KILLED if killed else self._status.FAILED
        self.client.set_terminated(self.run_id, self._status.to_string(status))

    def ids(self) -> dict:
        return {"tracking_uri": self.uri, "run_id": self.run_id}
