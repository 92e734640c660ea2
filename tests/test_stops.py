"""How a training run stops: an unreadable image, SIGTERM and Ctrl-C (one, two inside a step, one
during a save or an evaluation), kill -9 then --resume, bad annotations, a non-finite loss, any
other exception. Each ends in one line, with the exit status it
should have, the checkpoint it should leave, and no abort at exit (the loader's threads stopped);
the ones where the exit status matters run train.py as a user does, in a subprocess."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from deformable_detr import load_config
from deformable_detr.data import DataLoader, build_dataset
from deformable_detr.data.shapes import generate
from deformable_detr.training.trainer import Trainer
from deformable_detr.weights.files import read_weights

import mlx.core as mx
import pytest
from test_train import ROOT, TINY

import train

# 40 images: 20 batches of 2 per epoch, more than the loader prefetches, so its threads are busy
# when a stop comes mid-epoch.
SETTINGS = ["train.eval_every=0", "model.dropout=0.0"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("shapes"), 40, 4, seed=3, height=(64, 64), width=(64, 64), max_size=40)


def train_command(shapes, output, *overrides):
    command = [sys.executable, str(ROOT / "train.py"), "--config", str(TINY), "--output-dir", str(output)]
    return command + [f"data.path={shapes}", *SETTINGS, *overrides]


def run_train(*command_args, **kwargs):
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        train_command(*command_args), capture_output=True, text=True, cwd=ROOT, env=environment, **kwargs
    )


def progress_of(checkpoint) -> dict:
    return read_weights(checkpoint).progress


def step_records(output) -> list[int]:
    lines = (output / "log.jsonl").read_text().splitlines()
    return [json.loads(line)["global_step"] for line in lines if '"step":' in line]


def assert_one_clean_line(done, status):
    """Exit `status`, the last line of stderr `error: ...`, no traceback, no abort."""
    assert done.returncode == status, done.stderr[-3000:]
    for sign in ("Traceback", "Fatal Python error", "terminate called", "Segmentation fault"):
        assert sign not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), done.stderr[-3000:]
    return last


def test_an_unreadable_image_mid_epoch_saves_the_progress_and_names_the_way_on(shapes, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(shapes, root)
    cfg = load_config(TINY, [f"data.path={root}"])
    dataset = build_dataset("train", cfg.data)
    batch = 5  # the batch of epoch 0 with the bad image: five steps come before it
    index = DataLoader(dataset, cfg.schedule.batch_size, seed=cfg.seed)._steps(0)[batch][0][0]
    bad = dataset.image_dir / dataset.coco.imgs[dataset.ids[index]]["file_name"]
    bad.write_bytes(b"not a PNG")

    output = tmp_path / "run"
    done = run_train(root, output, "train.max_steps=12")
    line = assert_one_clean_line(done, 1)
    assert line.startswith(f"error: {bad}: cannot read image")
    assert "set data.skip_bad_images=true and continue with --resume" in line
    assert str(output / "checkpoint.safetensors") in line
    assert {k: progress_of(output / "checkpoint.safetensors")[k] for k in ("epoch", "step")} == {"epoch": 0, "step": 5}

    resumed = run_train(
        root,
        output,
        "train.max_steps=12",
        "data.skip_bad_images=true",
        "--resume",
        str(output / "checkpoint.safetensors"),
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "skipping" in resumed.stderr and str(bad) in resumed.stderr
    assert step_records(output) == list(range(1, 13))


def start_training(shapes, output, *overrides):
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = train_command(shapes, output, *overrides)
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=environment
    )


def wait_for_steps(process, output, at_least: int, timeout: float = 240, every: float = 0.02) -> int:
    """Poll log.jsonl (`every` seconds) until it holds `at_least` step records; -> the last one's global step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-3000:]
        steps = step_records(output) if (output / "log.jsonl").exists() else []
        if len(steps) >= at_least:
            return steps[-1]
        time.sleep(every)
    process.kill()
    raise AssertionError(f"no {at_least} steps in {timeout} s")


@pytest.mark.parametrize("signum, name", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")])
def test_a_signal_checkpoints_the_progress_at_the_end_of_the_step(shapes, tmp_path, signum, name):
    output = tmp_path / "run"
    process = start_training(shapes, output, "schedule.epochs=10")
    wait_for_steps(process, output, 3)
    process.send_signal(signum)
    line = assert_one_clean_line(stopped(process), 128 + signum)
    progress = progress_of(output / "checkpoint.safetensors")
    assert line == (
        f"error: interrupted ({name}) at epoch {progress['epoch']}, step {progress['step']}; "
        f"checkpoint: {output / 'checkpoint.safetensors'} (continue with --resume {output / 'checkpoint.safetensors'})"
    )
    steps = step_records(output)
    assert progress["global_step"] == steps[-1] >= 3  # every step taken is in the checkpoint and in the log


def stopped(process) -> subprocess.CompletedProcess:
    _, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, "", stderr)


def fastest_step_seconds(output) -> float:
    """The shortest of the steps logged so far (their images_per_s, 2 images a step). Not their mean:
    with another test process beside it, a step here took 0.7-3 s, and step 1 is the slowest."""
    lines = (output / "log.jsonl").read_text().splitlines()
    return min(2 / r["images_per_s"] for r in map(json.loads, lines) if "images_per_s" in r)


def send_twice(process, signum, apart: float):
    """Two deliveries `apart` seconds apart: while MLX runs native code, CPython's C handler takes
    both before its Python handler runs once. (Sent microseconds apart, the kernel itself would
    merge the second into the first while that one is pending: a standard signal does not queue.)"""
    os.kill(process.pid, signum)
    time.sleep(apart)
    os.kill(process.pid, signum)


@pytest.mark.parametrize("signum, name", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")])
def test_two_signals_inside_one_step_stop_it_without_saving(shapes, tmp_path, signum, name):
    """Steps of 384 x 384 images (0.25-3 s here, most of it in MLX's native code); the pair sent an
    eighth and a quarter of the fastest step so far after step 3's record, so inside step 4 (at a
    quarter of the mean, the pair once came after a short step 4's end, in CI beside another test
    process): no save, the line names the checkpoint of step 2 that stands; the log ends at step 3."""
    output = tmp_path / "run"
    sizes = ["data.scales=[384]", "data.max_size=384", "train.checkpoint_every=2"]
    process = start_training(shapes, output, "schedule.epochs=10", *sizes)
    wait_for_steps(process, output, 3, every=0.002)
    seconds = fastest_step_seconds(output)
    time.sleep(seconds / 8)
    send_twice(process, signum, apart=seconds / 8)
    line = assert_one_clean_line(stopped(process), 128 + signum)
    checkpoint = output / "checkpoint.safetensors"
    assert re.fullmatch(
        re.escape(
            f"error: a second signal ({name}, {name}) inside epoch 0's step 4: stopped there, without saving; "
            f"the last checkpoint, intact: {checkpoint} (epoch 0, step 2, global step 2, written "
        )
        + r"\d{4}-\d\d-\d\d \d\d:\d\d\)",
        line,
    ), line
    assert progress_of(checkpoint)["global_step"] == 2 and step_records(output) == [1, 2, 3]


def signal_during_the_save(process, output, signum, timeout: float = 240):
    """`signum` as soon as the checkpoint's temporary file appears (the save is under way)."""
    tmp, deadline = output / "checkpoint.tmp.safetensors", time.monotonic() + timeout
    while not tmp.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
    os.kill(process.pid, signum)


@pytest.mark.parametrize("first_signal", [True, False], ids=["the first signal's save", "a periodic save"])
def test_a_signal_during_a_save_waits_for_it_then_stops(shapes, tmp_path, first_signal):
    """A SIGTERM while a checkpoint is written (the first SIGTERM's, or train.checkpoint_every's):
    the save completes, the run stops, exit 143, the line names the checkpoint just saved, which
    loads and holds every step taken."""
    output = tmp_path / "run"
    process = start_training(
        shapes, output, "schedule.epochs=10", *([] if first_signal else ["train.checkpoint_every=3"])
    )
    if first_signal:
        wait_for_steps(process, output, 2)
        process.send_signal(signal.SIGTERM)
    signal_during_the_save(process, output, signal.SIGTERM)
    line = assert_one_clean_line(stopped(process), 143)
    checkpoint = output / "checkpoint.safetensors"
    progress = progress_of(checkpoint)
    names = "SIGTERM, SIGTERM" if first_signal else "SIGTERM"
    assert line == (
        f"error: interrupted ({names}) at epoch {progress['epoch']}, step {progress['step']}; "
        f"checkpoint: {checkpoint} (continue with --resume {checkpoint})"
    )
    assert progress["global_step"] == step_records(output)[-1]  # every step taken, saved
    assert first_signal or progress["global_step"] == 3  # the periodic save's: no step after it
    assert len(read_weights(checkpoint).tensors) > 0 and not (output / "checkpoint.tmp.safetensors").exists()


@pytest.fixture(scope="module")
def many_val_images(tmp_path_factory):
    """8 train images (4 steps an epoch), 60 val: an evaluation long enough to signal during it."""
    return generate(tmp_path_factory.mktemp("shapes"), 8, 60, seed=3, height=(64, 64), width=(64, 64), max_size=40)


def test_a_signal_during_an_evaluation_stops_at_once_with_the_epochs_steps_saved(many_val_images, tmp_path):
    """SIGTERM just after the epoch's last step, in its evaluation: at once, the checkpoint holding the
    epoch's 4 steps (a resume evaluates the epoch then), no evaluation record, exit 143."""
    output = tmp_path / "run"
    process = start_training(many_val_images, output, "schedule.epochs=3", "train.eval_every=1")
    wait_for_steps(process, output, 4, every=0.002)
    time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    line = assert_one_clean_line(stopped(process), 143)
    checkpoint = output / "checkpoint.safetensors"
    assert {k: progress_of(checkpoint)[k] for k in ("epoch", "step", "global_step")} == {
        "epoch": 0,
        "step": 4,
        "global_step": 4,
    }
    assert line == (
        f"error: interrupted (SIGTERM) at epoch 0, step 4; checkpoint: {checkpoint} "
        f"(continue with --resume {checkpoint})"
    )
    assert not any('"eval"' in record for record in (output / "log.jsonl").read_text().splitlines())


def test_after_kill_9_a_resumed_run_logs_each_step_once(shapes, tmp_path):
    output = tmp_path / "run"
    process = start_training(shapes, output, "train.checkpoint_every=5", "train.max_steps=14")
    wait_for_steps(process, output, 7)
    process.kill()
    process.communicate()
    checkpoint = output / "checkpoint.safetensors"
    saved_at = progress_of(checkpoint)["global_step"]
    assert step_records(output)[-1] > saved_at  # steps were logged after the checkpoint: the case at hand

    resumed = run_train(shapes, output, "train.checkpoint_every=5", "train.max_steps=14", "--resume", str(checkpoint))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert step_records(output) == list(range(1, 15))


def annotations_with(shapes, tmp_path, change):
    root = tmp_path / "data"
    shutil.copytree(shapes, root)
    path = root / "annotations" / "instances_train2017.json"
    data = json.loads(path.read_text())
    change(data["annotations"][7])
    path.write_text(json.dumps(data))
    return root, path, data["annotations"][7]["id"]


@pytest.mark.parametrize(
    "key, value, said",
    [
        ("category_id", -1, "category_id -1 is not a non-negative integer"),
        ("category_id", "3", "category_id '3' is not a non-negative integer"),
        ("bbox", [1.0, 2.0, 3.0], "bbox [1.0, 2.0, 3.0] is not four finite numbers (x, y, width, height)"),
        (
            "bbox",
            [1.0, 2.0, math.nan, 4.0],
            "bbox [1.0, 2.0, nan, 4.0] is not four finite numbers (x, y, width, height)",
        ),
        ("bbox", [1.0, "2", 3.0, 4.0], "bbox [1.0, '2', 3.0, 4.0] is not four finite numbers (x, y, width, height)"),
    ],
)
def test_a_bad_annotation_stops_before_any_step_naming_file_annotation_and_value(shapes, tmp_path, key, value, said):
    root, path, annotation = annotations_with(shapes, tmp_path, lambda a: a.__setitem__(key, value))
    output = tmp_path / "run"
    argv = ["--config", str(TINY), "--output-dir", str(output), f"data.path={root}", "model.num_classes=auto"]
    with pytest.raises(SystemExit) as stopped:
        train.main(argv)
    assert str(stopped.value) == f"error: {path}: annotation id {annotation!r}: {said}"
    assert not output.exists()  # before anything was built or written


def test_a_bad_annotation_is_one_line_and_exit_1_from_the_command(shapes, tmp_path):
    root, path, annotation = annotations_with(shapes, tmp_path, lambda a: a.__setitem__("category_id", "3"))
    line = assert_one_clean_line(run_train(root, tmp_path / "run"), 1)
    assert line == f"error: {path}: annotation id {annotation!r}: category_id '3' is not a non-negative integer"


def failing_at_step(number: int, failure):
    """Trainer.step, with `failure(losses)` applied to (or raised at) the trainer's step `number`."""
    step = Trainer.step

    def failing(self, micro_batches, *args, **kwargs):
        losses, grad_norm = step(self, micro_batches, *args, **kwargs)
        if self.steps == number:
            failure(losses)
        return losses, grad_norm

    return failing


def test_a_non_finite_loss_stops_naming_its_step_with_its_record_in_the_log(shapes, tmp_path):
    """A learning rate of 1e30: the first step's update takes the weights to about 1e30, the second
    step's forward overflows (a real run going non-finite). Its record names that step and each term;
    the checkpoint of the first step stays as it was."""
    output = tmp_path / "run"
    argv = ["--config", str(TINY), "--output-dir", str(output), f"data.path={shapes}", *SETTINGS]
    with pytest.raises(SystemExit) as stopped:
        train.main([*argv, "optimizer.lr=1e30", "train.checkpoint_every=1", "train.max_steps=4"])
    checkpoint, log = output / "checkpoint.safetensors", output / "log.jsonl"
    last = json.loads(log.read_text().splitlines()[-1])
    not_finite = last.pop("non_finite_loss")
    assert {k: last.pop(k) for k in ("epoch", "step", "global_step", "lr")} == {
        "epoch": 0,
        "step": 2,
        "global_step": 2,
        "lr": pytest.approx(1e30),
    }
    assert last.pop("grad_norm") in ("nan", "inf")
    assert "loss" in not_finite and {"loss_ce", "loss_bbox", "loss_giou"} <= not_finite.keys()
    assert set(not_finite.values()) <= {"nan", "inf", "-inf"}
    assert all(math.isfinite(value) for value in last.values())  # the terms that stayed finite
    assert re.fullmatch(
        re.escape(
            f"error: the loss is {not_finite['loss']} at epoch 0, step 2 (global step 2; not finite: "
            f"{', '.join(not_finite)}; its record: {log}); stopped without saving: the last checkpoint, "
            f"intact: {checkpoint} (epoch 0, step 1, global step 1, written "
        )
        + r"\d{4}-\d\d-\d\d \d\d:\d\d\)",
        str(stopped.value),
    ), stopped.value
    assert progress_of(checkpoint)["global_step"] == 1


def test_any_other_exception_is_one_line_with_the_traceback_in_the_log(shapes, tmp_path):
    """Step 3 raises: one line, exit 1, no abort with the loader's threads busy; the traceback is the
    last record of log.jsonl; the checkpoint of step 2 stays."""
    output = tmp_path / "run"
    script = (
        "import sys, train\n"
        "from deformable_detr.training.trainer import Trainer\n"
        "from test_stops import failing_at_step\n"
        "def fail(losses): raise ZeroDivisionError('something went wrong')\n"
        "Trainer.step = failing_at_step(3, fail)\n"
        "train.main(sys.argv[1:])\n"
    )
    command = [sys.executable, "-c", script, *train_command(shapes, output, "train.checkpoint_every=2")[2:]]
    environment = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=environment)
    line = assert_one_clean_line(done, 1)
    assert line.startswith(
        "error: ZeroDivisionError: something went wrong at epoch 0, step 2 "
        f"(the traceback is in {output / 'log.jsonl'}); "
        f"the last checkpoint, intact: {output / 'checkpoint.safetensors'} (epoch 0, step 2, global step 2, "
    ) and line.endswith(")")
    last = json.loads((output / "log.jsonl").read_text().splitlines()[-1])
    assert "ZeroDivisionError: something went wrong" in last["traceback"] and "failing" in last["traceback"]
    assert progress_of(output / "checkpoint.safetensors")["global_step"] == 2
    assert mx.load(str(output / "checkpoint.safetensors"))  # whole and readable
