"""`train.mlflow` and `train.wandb: offline`: a run trained in three goes (to global step 6; resumed
and killed with kill -9 past its checkpoint at step 8; resumed to step 18), then read back with
MLflow's own client and from W&B's offline files: the config as params, every step's scalars once
each and equal to log.jsonl's (those the killed process logged past its checkpoint too, sent once by
the resume), each evaluation's AP and per-class AP at its step, and the final checkpoint, results and
pictures as artifacts, in one MLflow run and one W&B run id through both resumes. (W&B: of the killed
process's steps 7 and 8, what W&B's writer had written before the kill: it writes every 15 s.)

MLflow: the run directory's own store (train.mlflow=true: SQLite, what the mlflow extra, mlflow-skinny
with SQLAlchemy and Alembic, runs); and MLflow's own tracking server on 127.0.0.1 where the installed
MLflow has one (the full `mlflow` package; skinny has no server). W&B: its offline files read by its
own reader, `wandb leet inspect --json` (wandb 0.31 has no Python one: sdk/internal/datastore.py and
`wandb sync --view` went with the legacy service)."""

import base64
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from deformable_detr.config import flat_config, load_config
from deformable_detr.data.shapes import generate
from deformable_detr.training.run_directory import ARTIFACTS

import pytest
import yaml
from test_stops import progress_of, step_records, wait_for_steps
from test_train import ROOT, TINY

import train

mlflow = pytest.importorskip("mlflow", reason="reads the MLflow run back: pip install -e '.[mlflow]'")
from mlflow.tracking import MlflowClient  # noqa: E402

STEP_KEYS = ("loss", "loss_ce", "loss_giou", "lr", "grad_norm", "images_per_s")
EVAL_KEYS = ("AP", "AP50", "AR100")
# Every tracker's variable cleared: what the run does on its own
TRACKER_VARIABLES = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """12 train images: 6 steps an epoch; 4 val."""
    return generate(tmp_path_factory.mktemp("shapes"), 12, 4, seed=5, height=(64, 64), width=(64, 64), max_size=40)


def environment(tmp) -> dict:
    """The trackers' variables cleared; W&B's files (its artifacts' staging copies) under `tmp`."""
    env = {k: v for k, v in os.environ.items() if k not in TRACKER_VARIABLES}
    return env | {f"WANDB_{name}_DIR": str(tmp / f"wandb_{name.lower()}") for name in ("DATA", "CACHE", "CONFIG")}


def three_goes(shapes, output, env: dict, *settings) -> list[dict]:
    """Steps 1-6 (an evaluation at 6); resumed to 18, checkpointing every 8, killed (kill -9) after
    step 10, past its checkpoint at 8; resumed to 18 (evaluations at 12 and 18). -> log.jsonl's records."""
    argv = ["--config", str(TINY), "--output-dir", str(output), f"data.path={shapes}", "schedule.epochs=3"]
    argv += ["model.dropout=0.0", *settings]
    with pytest.MonkeyPatch.context() as patch:
        for name in TRACKER_VARIABLES:
            patch.delenv(name, raising=False)
        for name, value in env.items():
            patch.setenv(name, value)
        train.main([*argv, "train.max_steps=6"])
        later = [*argv, "train.max_steps=18", "train.checkpoint_every=8", "--resume"]
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *later],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env | {"PYTHONPATH": str(ROOT)},
        )
        wait_for_steps(process, output, 10)
        process.kill()
        process.communicate()
        saved_at = progress_of(output / "checkpoint.safetensors")["global_step"]
        assert max(step_records(output)) > saved_at == 8  # the case at hand: steps past the checkpoint
        train.main(later)
    return [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]


def first_config(output) -> dict:
    """config.yaml's config as the run started (its `changes:` aside), and the changes."""
    config = yaml.safe_load((output / "config.yaml").read_text())
    return config, config.pop("changes", [])


@pytest.fixture(scope="module")
def tracked(shapes, tmp_path_factory):
    """A run with train.mlflow=true (its own store) and train.wandb=offline: (folder, log records)."""
    output = tmp_path_factory.mktemp("tracked") / "run"
    env = environment(output.parent)
    records = three_goes(shapes, output, env, "train.mlflow=true", "train.wandb=offline")
    return output, records


def check_mlflow_run(output, records: list[dict], uri: str):
    """The MLflow run (one, through both resumes) against log.jsonl, config.yaml and the files."""
    client = MlflowClient(uri)
    ids = json.loads((output / "run_ids.json").read_text())["mlflow"]
    assert ids["tracking_uri"] == uri
    experiment = client.get_experiment_by_name("deformable-detr")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == ids["run_id"] and run.info.run_name == output.name
    assert run.info.status == "FINISHED"

    config, changes = first_config(output)
    started = load_config(None, base=config)
    assert run.data.params == {key: str(value) for key, value in flat_config(started).items()}
    [change] = changes  # the second go's: max_steps and checkpoint_every, from step 7
    assert change["from_global_step"] == 7
    for key, (old, new) in ((k, v) for k, v in change.items() if k != "from_global_step"):
        assert run.data.tags[f"config_change.{key}"] == f"{old} -> {new} from global step 7"

    steps = [r for r in records if "step" in r and "loss" in r]
    assert [r["global_step"] for r in steps] == list(range(1, 19))
    for key in STEP_KEYS:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, f"train/{key}"))
        assert history == [(r["global_step"], r[key]) for r in steps], key  # each step once, as logged
    evaluations = [r for r in records if "eval" in r]
    assert [r["global_step"] for r in evaluations] == [6, 12, 18]
    for key in EVAL_KEYS:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, f"val/{key}"))
        assert history == [(r["global_step"], r["eval"][key]) for r in evaluations], key
    for name in evaluations[-1]["eval"]["per_class"]:
        history = client.get_metric_history(run.info.run_id, f"val_AP_per_class/{name}")
        history = sorted((m.step, m.value) for m in history)
        assert history == [(r["global_step"], r["eval"]["per_class"][name]["AP"]) for r in evaluations], name

    written = [name for name in ARTIFACTS if (output / name).is_file()]
    assert {"checkpoint.safetensors", "eval_results.json", "predictions.png", "pr_curves.png"} <= set(written)
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == sorted(written)
    for name in ("checkpoint.safetensors", "eval_results.json", "curves.png"):
        copy = client.download_artifacts(run.info.run_id, name, str(output.parent / "downloaded"))
        assert open(copy, "rb").read() == (output / name).read_bytes(), name  # the final one


def test_mlflow_store_in_the_run_directory_holds_the_log(tracked):
    output, records = tracked
    uri = f"sqlite:///{output.resolve() / 'mlflow' / 'mlflow.db'}"
    check_mlflow_run(output, records, uri)
    assert (output / "mlflow" / "artifacts").is_dir()  # the artifacts beside the store, in the run directory


@pytest.fixture
def mlflow_server(tmp_path):
    """MLflow's own tracking server on 127.0.0.1 (a free port), with a SQLite store; its URI."""
    try:
        import mlflow.server  # noqa: F401
    except ImportError as error:
        pytest.skip(f"no MLflow tracking server here ({error}): the full `mlflow` package has it, not mlflow-skinny")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    command += ["--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}"]
    command += ["--artifacts-destination", str(tmp_path / "server_artifacts")]
    env = {k: v for k, v in os.environ.items() if k not in TRACKER_VARIABLES}
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the MLflow server did not answer in 90 s"
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # it and its workers
        server.wait(timeout=30)
        log.close()


def test_mlflow_tracking_server_holds_the_log(shapes, tmp_path, mlflow_server):
    output = tmp_path / "run"
    records = three_goes(shapes, output, environment(tmp_path), f"train.mlflow={mlflow_server}")
    check_mlflow_run(output, records, mlflow_server)
    assert not (output / "mlflow").exists()  # all of it on the server


def wandb_records(folder) -> list[dict]:
    """The records of an offline run's .wandb file, as W&B's own reader prints them (`wandb leet
    inspect --json`: a JSON object a record, {"type": ..., <type>: {...}})."""
    command = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(folder)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def of_type(records: list[dict], kind: str) -> list[dict]:
    return [record[kind] for record in records if record["type"] == kind]


def test_wandb_offline_run_holds_the_log(tracked):
    output, records = tracked
    wandb_id = json.loads((output / "run_ids.json").read_text())["wandb"]["run_id"]
    folders = sorted((output / "wandb").glob("offline-run-*"))
    assert len(folders) == 3 and all(folder.name.endswith(f"-{wandb_id}") for folder in folders)  # one run, 3 goes
    goes = [wandb_records(folder) for folder in folders]
    # (the killed go's file may hold nothing: W&B's writer had not written yet)
    runs = [run for go in goes for run in of_type(go, "run")]
    assert {run["run_id"] for run in runs} == {wandb_id} and runs[0]["display_name"] == output.name
    assert len(of_type(goes[0], "run")) == len(of_type(goes[2], "run")) == 1

    config, changes = first_config(output)
    recorded = {k: v for k, v in runs[0]["config"]["update"].items() if k != "_wandb"}
    assert recorded == config  # the config the run started with
    last = runs[-1]["config"]["update"]
    for key, (_, new) in ((k, v) for k, v in changes[0].items() if k != "from_global_step"):
        section, name = key.split(".")
        assert last[section][name] == new, key  # the resumed goes' config

    rows = [[history["item"] for history in of_type(go, "history")] for go in goes]
    steps_of = [sorted({row["global_step"] for row in go}) for go in rows]
    assert steps_of[0] == list(range(1, 7)) and steps_of[2] == list(range(9, 19))
    # the killed go: what W&B's writer had written of its steps 7 and 8 (it writes every 15 s), none past 8
    assert steps_of[1] == [7, 8][: len(steps_of[1])]
    shown, counters = {}, {"global_step", "_step", "_runtime", "_timestamp"}
    for row in (row for go in rows for row in go):
        assert not set(shown.get(row["global_step"], {})) & (set(row) - counters)
        shown.setdefault(row["global_step"], {}).update(row)  # a step's train and val rows; none twice
    steps = [r for r in records if "step" in r and "loss" in r and r["global_step"] in shown]
    assert [r["global_step"] for r in steps] == sorted(shown) == [*steps_of[0], *steps_of[1], *steps_of[2]]
    for key in STEP_KEYS:
        assert [shown[r["global_step"]][f"train/{key}"] for r in steps] == [r[key] for r in steps], key
    for evaluation in (r for r in records if "eval" in r):
        values, stats = shown[evaluation["global_step"]], evaluation["eval"]
        assert [values[f"val/{key}"] for key in EVAL_KEYS] == [stats[key] for key in EVAL_KEYS]
        for name, per_class in stats["per_class"].items():
            assert values[f"val_AP_per_class/{name}"] == per_class["AP"], name
    logged = sorted(f"train/{k}" for k in steps[4] if k not in ("epoch", "step", "global_step"))
    assert sorted(k for k in shown[5] if "/" in k) == logged  # every number of a step record

    [artifact] = of_type(goes[2], "artifact")
    assert (artifact["name"], artifact["type"]) == (f"run-{wandb_id}", "model")
    files = {entry["path"]: entry for entry in artifact["manifest"]["contents"]}
    assert sorted(files) == sorted(name for name in ARTIFACTS if (output / name).is_file())
    for name, entry in files.items():  # the final files: their MD5, as W&B records it
        assert entry["digest"] == base64.b64encode(hashlib.md5((output / name).read_bytes()).digest()).decode(), name
    assert not of_type(goes[1], "artifact")  # killed: no end, no artifact
    assert {"glob_name": "*", "step_metric": "global_step"}.items() <= of_type(goes[0], "metric")[-1].items()


def test_without_the_packages_one_line_before_anything_is_written(shapes, tmp_path, monkeypatch):
    argv = ["--config", str(TINY), "--output-dir", str(tmp_path / "run"), f"data.path={shapes}"]
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # as if not installed
    with pytest.raises(SystemExit) as stopped:
        train.main([*argv, "train.mlflow=true"])
    assert str(stopped.value) == (
        'error: train.mlflow needs sqlalchemy, in the "mlflow" extra: pip install -e ".[mlflow]"'
    )
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(SystemExit) as stopped:
        train.main([*argv, "train.wandb=offline"])
    assert str(stopped.value) == 'error: train.wandb needs wandb, in the "wandb" extra: pip install -e ".[wandb]"'
    assert not (tmp_path / "run").exists()
