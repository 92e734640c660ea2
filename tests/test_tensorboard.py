"""`train.tensorboard: true`: the event files, read back with TensorBoard's own reader, hold the step
records' scalars at the logged steps (the values of log.jsonl), each evaluation's AP and per-class AP
and its pictures (at the end, the same pixels as predictions.png and pr_curves.png); after kill -9
and a resume, each step once; no PyTorch imported; without the package, one line before any step.
With supervision, each evaluation's confusion matrix too (at the end, confusion_matrix.png's pixels)."""

import importlib.util
import io
import json
import os
import subprocess
import sys

from deformable_detr.data.shapes import generate

import numpy as np
import pytest
from PIL import Image
from test_stops import progress_of, start_training, step_records, wait_for_steps
from test_train import ROOT, TINY

import train

pytest.importorskip("tensorboard", reason="reads the event files back: pip install -e '.[tensorboard]'")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader  # noqa: E402


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """8 train images (4 steps an epoch), 4 val."""
    return generate(tmp_path_factory.mktemp("shapes"), 8, 4, seed=5, height=(64, 64), width=(64, 64), max_size=40)


@pytest.fixture(scope="module")
def many_shapes(tmp_path_factory):
    """40 train images: 20 steps an epoch (test_stops' set)."""
    return generate(tmp_path_factory.mktemp("shapes"), 40, 4, seed=3, height=(64, 64), width=(64, 64), max_size=40)


def shown(output) -> EventAccumulator:
    """What TensorBoard shows of the run: every scalar and image kept (no sampling), restarts purged."""
    events = EventAccumulator(str(output / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return events


def written_steps(output, tag: str) -> list[int]:
    """The steps of `tag` in the event files as written, file after file (what a restart leaves)."""
    steps = []
    for path in sorted((output / "tensorboard").iterdir()):
        for event in EventFileLoader(str(path)).Load():
            steps += [event.step for value in event.summary.value if value.tag == tag]
    return steps


def records(output) -> list[dict]:
    return [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]


def test_scalars_at_the_logged_steps_evaluations_and_pictures(shapes, tmp_path):
    argv = ["--config", str(TINY), "--output-dir", str(tmp_path), f"data.path={shapes}", "schedule.epochs=2"]
    train.main([*argv, "train.tensorboard=true", "train.log_every=3"])
    events = shown(tmp_path)
    steps = [r for r in records(tmp_path) if "step" in r and "loss" in r]
    assert [r["global_step"] for r in steps] == [3, 6]  # every third of 8
    for key in ("loss", "loss_giou", "loss_ce_0", "lr", "grad_norm", "images_per_s"):
        scalars = events.Scalars(f"train/{key}")
        assert [s.step for s in scalars] == [3, 6], key
        np.testing.assert_allclose([s.value for s in scalars], [r[key] for r in steps], rtol=1e-6, err_msg=key)
    evaluations = [r for r in records(tmp_path) if "eval" in r]
    assert [r["global_step"] for r in evaluations] == [4, 8]
    for key in ("AP", "AP50", "AR100"):
        scalars = events.Scalars(f"val/{key}")
        assert [s.step for s in scalars] == [4, 8]
        np.testing.assert_allclose([s.value for s in scalars], [r["eval"][key] for r in evaluations], rtol=1e-6)
    names = {"circle", "cross", "diamond", "square", "triangle"}
    assert {tag for tag in events.Tags()["scalars"] if tag.startswith("val_AP_per_class/")} == {
        f"val_AP_per_class/{name}" for name in names
    }
    last = evaluations[-1]["eval"]["per_class"]
    assert [s.value for s in events.Scalars("val_AP_per_class/square")][-1] == pytest.approx(last["square"]["AP"])
    pictures = [("val/predictions", "predictions.png"), ("val/pr_curves", "pr_curves.png")]
    if importlib.util.find_spec("supervision"):  # the confusion matrix's (the confusion-matrix extra)
        pictures.append(("val/confusion_matrix", "confusion_matrix.png"))
    for tag, end_file in pictures:
        images = events.Images(tag)
        assert [image.step for image in images] == [4, 8]
        drawn = np.array(Image.open(io.BytesIO(images[-1].encoded_image_string)))
        np.testing.assert_array_equal(drawn, np.array(Image.open(tmp_path / end_file).convert("RGB")), err_msg=tag)
    assert written_steps(tmp_path, "train/loss") == [3, 6]


def test_after_kill_9_a_resumed_run_shows_each_step_once(many_shapes, tmp_path):
    """Killed after steps past its last checkpoint (already in the event file); resumed: TensorBoard
    shows steps 1..14 once each, the resumed run's values past the checkpoint. Resumed in a process
    that asserts it never imported PyTorch."""
    output = tmp_path / "run"
    settings = ["train.tensorboard=true", "train.checkpoint_every=5", "train.max_steps=14"]
    process = start_training(many_shapes, output, *settings)
    wait_for_steps(process, output, 7)
    process.kill()
    process.communicate()
    saved_at = progress_of(output / "checkpoint.safetensors")["global_step"]
    assert max(written_steps(output, "train/loss")) > saved_at  # the case at hand: steps past the checkpoint

    script = "import sys, train\ntrain.main(sys.argv[1:])\nassert 'torch' not in sys.modules, 'PyTorch imported'\n"
    command = [sys.executable, "-c", script, "--config", str(TINY), "--output-dir", str(output)]
    command += [f"data.path={many_shapes}", "train.eval_every=0", "model.dropout=0.0", *settings, "--resume"]
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert step_records(output) == list(range(1, 15))
    scalars = shown(output).Scalars("train/loss")
    assert [s.step for s in scalars] == list(range(1, 15))
    logged = {r["global_step"]: r["loss"] for r in records(output) if "step" in r and "loss" in r}
    np.testing.assert_allclose([s.value for s in scalars], [logged[step] for step in range(1, 15)], rtol=1e-6)
    assert len(written_steps(output, "train/loss")) > 14  # the duplicates are there, and hidden


def test_without_the_package_one_line_before_anything_is_written(shapes, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)  # as if not installed
    argv = ["--config", str(TINY), "--output-dir", str(tmp_path / "run"), f"data.path={shapes}"]
    with pytest.raises(SystemExit) as stopped:
        train.main([*argv, "train.tensorboard=true"])
    assert str(stopped.value) == (
        'error: train.tensorboard: true needs tensorboard, in the "tensorboard" extra: pip install -e ".[tensorboard]"'
    )
    assert not (tmp_path / "run").exists()
