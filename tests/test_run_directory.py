"""The run directory has one owner: a second run into it while one runs stops at once (naming the
process holding it), leaving the first's log and checkpoint as they were; a fresh run into a directory
holding a checkpoint stops before writing anything; --resume without a path continues that directory's
checkpoint; --overwrite starts afresh, removing the earlier run's files only once the new run is set up."""

import errno
import json
import os
import re
import signal
import socket

from deformable_detr.errors import CommandError
from deformable_detr.training import run_lock
from deformable_detr.training.run_directory import RESUME_HERE
from deformable_detr.training.run_lock import RunLock

import mlx.core as mx
import numpy as np
import pytest
from test_stops import assert_one_clean_line, progress_of, run_train, start_training, step_records, wait_for_steps
from test_train import TINY, weights

import train

SETTINGS = ["train.eval_every=0", "model.dropout=0.0"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from deformable_detr.data.shapes import generate

    return generate(tmp_path_factory.mktemp("shapes"), 40, 4, seed=3, height=(64, 64), width=(64, 64), max_size=40)


def run(shapes, output, *arguments):
    train.main(["--config", str(TINY), "--output-dir", str(output), f"data.path={shapes}", *SETTINGS, *arguments])


def contents(output) -> dict:
    return {p.name: p.read_bytes() for p in output.iterdir() if p.is_file() and p.name != ".lock"}


def test_a_second_run_into_a_directory_in_use_stops_at_once_and_leaves_the_first_intact(shapes, tmp_path):
    output = tmp_path / "run"
    first = start_training(shapes, output, "schedule.epochs=50")
    try:
        wait_for_steps(first, output, 2)
        for starting in ([], ["--overwrite"], ["--resume"]):  # none of them may touch the first run's files
            second = run_train(shapes, output, "train.max_steps=1", *starting, timeout=300)
            line = assert_one_clean_line(second, 1)
            assert re.fullmatch(
                re.escape(f"error: {output} is in use by another run (process {first.pid} on {socket.gethostname()}, ")
                + r"since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \([\d.]+ (s|min|h) ago\); "
                + re.escape(f"the lock: {output / '.lock'}): a second run would interleave its log and overwrite its ")
                + re.escape("checkpoints; wait for it to end, or use another --output-dir"),
                line,
            ), line
    finally:
        first.send_signal(signal.SIGTERM)
        _, stderr = first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    steps = step_records(output)
    assert steps == list(range(1, len(steps) + 1))  # its steps alone, each once
    assert progress_of(output / "checkpoint.safetensors")["global_step"] == steps[-1]


def test_the_lock_file_of_a_dead_run_blocks_nothing(shapes, tmp_path):
    """kill -9 leaves .lock behind, with its text; the kernel released the lock with the process."""
    tmp_path.joinpath(".lock").write_text(json.dumps({"pid": 999999, "host": "elsewhere", "started": 0.0}))
    run(shapes, tmp_path, "train.max_steps=1")
    holder = json.loads(tmp_path.joinpath(".lock").read_text())
    assert (holder["pid"], holder["host"]) == (os.getpid(), socket.gethostname())


def test_a_lock_held_in_this_process_is_named(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(
            CommandError, match=rf"^{re.escape(str(tmp_path))} is in use by another run \(process {os.getpid()}"
        ):
            RunLock(tmp_path).acquire()
    RunLock(tmp_path).acquire().release()  # released at the end of the first


def test_without_flock_the_run_goes_on_unlocked_saying_so(shapes, tmp_path, monkeypatch, capsys):
    def no_flock(descriptor, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_lock.fcntl, "flock", no_flock)
    run(shapes, tmp_path, "train.max_steps=1")
    assert (
        f"warning: cannot lock {tmp_path / '.lock'} ({os.strerror(errno.ENOLCK)}: a file system without flock); "
        "running unlocked: make sure no other run writes to this directory"
    ) in capsys.readouterr().out
    assert progress_of(tmp_path / "checkpoint.safetensors")["global_step"] == 1


def test_a_fresh_run_into_a_directory_holding_a_checkpoint_stops_before_writing(shapes, tmp_path):
    run(shapes, tmp_path, "train.max_steps=3")
    before = contents(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        run(shapes, tmp_path, "train.max_steps=6")
    assert re.fullmatch(
        re.escape(f"error: {tmp_path} holds a run (checkpoint.safetensors at epoch 0, step 3, global step 3, written ")
        + r"\d{4}-\d\d-\d\d \d\d:\d\d\): continue it with --resume, or start afresh with --overwrite "
        + re.escape("(its checkpoints, log and TensorBoard events are removed); or give another --output-dir"),
        str(stopped.value),
    ), stopped.value
    assert contents(tmp_path) == before


def test_the_refusal_is_exit_1_from_the_command(shapes, tmp_path):
    run(shapes, tmp_path, "train.max_steps=1")
    line = assert_one_clean_line(run_train(shapes, tmp_path, "train.max_steps=2", timeout=300), 1)
    assert line.startswith(f"error: {tmp_path} holds a run (checkpoint.safetensors at epoch 0, step 1")


def test_resume_without_a_path_continues_the_directorys_checkpoint_bit_for_bit(shapes, tmp_path):
    run(shapes, tmp_path / "a", "train.max_steps=3", "model.dropout=0.1")
    run(shapes, tmp_path / "a", "--resume", "train.max_steps=5", "model.dropout=0.1")  # an override after it
    run(shapes, tmp_path / "b", "train.max_steps=5", "model.dropout=0.1")
    assert step_records(tmp_path / "a") == [1, 2, 3, 4, 5]
    got, want = weights(tmp_path / "a" / "checkpoint.safetensors"), weights(tmp_path / "b" / "checkpoint.safetensors")
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_resume_without_a_path_where_there_is_no_checkpoint_starts_afresh(shapes, tmp_path, capsys):
    """The relaunch of a run preempted before its first checkpoint: what it logged is removed."""
    tmp_path.joinpath("log.jsonl").write_text('{"epoch": 0, "step": 1, "global_step": 1, "loss": 1.0}\n')
    run(shapes, tmp_path, "train.max_steps=2", "--resume")
    said = capsys.readouterr().out
    assert f"--resume: no checkpoint in {tmp_path}: a fresh run" in said
    assert f"started afresh: removed the earlier run's log.jsonl from {tmp_path}" in said
    assert step_records(tmp_path) == [1, 2]


def test_overwrite_removes_the_earlier_run_once_the_new_one_is_set_up(shapes, tmp_path, capsys):
    run(shapes, tmp_path, "train.eval_every=1", "schedule.epochs=1")  # 20 steps and an evaluation
    assert {"checkpoint_best.safetensors", "eval_results.json", "predictions.png"} <= set(contents(tmp_path))
    before = contents(tmp_path)
    with pytest.raises(SystemExit, match="train.memory_limit_gb"):  # set-up fails: nothing removed yet
        run(shapes, tmp_path, "--overwrite", "train.max_steps=1", "train.memory_limit_gb=0.001")
    assert contents(tmp_path) == before
    capsys.readouterr()
    run(shapes, tmp_path, "--overwrite", "train.max_steps=2")
    assert "started afresh: removed the earlier run's checkpoint.safetensors, checkpoint_best.safetensors" in (
        capsys.readouterr().out
    )
    assert sorted(contents(tmp_path)) == ["checkpoint.safetensors", "config.yaml", "log.jsonl"]
    assert step_records(tmp_path) == [1, 2] and progress_of(tmp_path / "checkpoint.safetensors")["global_step"] == 2


def test_resuming_another_directorys_checkpoint_over_a_run_is_refused(shapes, tmp_path):
    run(shapes, tmp_path / "a", "train.max_steps=1")
    run(shapes, tmp_path / "b", "train.max_steps=2")
    other = tmp_path / "a" / "checkpoint.safetensors"
    with pytest.raises(SystemExit, match=rf"holds a run .*: to continue {re.escape(str(other))} here, start afresh"):
        run(shapes, tmp_path / "b", "--resume", str(other), "train.max_steps=3")
    assert progress_of(tmp_path / "b" / "checkpoint.safetensors")["global_step"] == 2
    run(shapes, tmp_path / "b", "--resume", str(other), "--overwrite", "train.max_steps=3")
    assert step_records(tmp_path / "b") == [2, 3]  # the earlier log removed; this one continues a's step 1
    assert mx.load(str(tmp_path / "b" / "checkpoint.safetensors"))


def test_resume_without_a_path_and_overwrite_is_a_usage_error(shapes, tmp_path):
    done = run_train(shapes, tmp_path, "--resume", "--overwrite", timeout=300)
    line = assert_one_clean_line(done, 2)
    assert line == "error: --resume without a path continues this directory's run, --overwrite replaces it"
    assert not (tmp_path / "config.yaml").exists()


@pytest.mark.parametrize(
    "argv, resume, overrides",
    [
        (["--resume", "a.b=1", "c.d=2"], "RESUME_HERE", ["a.b=1", "c.d=2"]),
        (["x.y=0", "--resume", "a.b=1", "c.d=2"], "RESUME_HERE", ["x.y=0", "a.b=1", "c.d=2"]),
        (["x.y=0", "--resume"], "RESUME_HERE", ["x.y=0"]),
        (["--resume", "some.safetensors", "c.d=2"], "some.safetensors", ["c.d=2"]),
        (["--overwrite", "c.d=2"], None, ["c.d=2"]),
    ],
)
def test_resume_takes_a_path_or_none_before_the_overrides(argv, resume, overrides):
    args = train.parse_args(["--config", str(TINY), *argv])
    assert args.resume == (RESUME_HERE if resume == "RESUME_HERE" else resume)
    assert args.overrides == overrides


def test_eval_only_takes_no_lock_and_resume_without_a_path_evaluates_the_directorys_checkpoint(shapes, tmp_path):
    run(shapes, tmp_path, "train.max_steps=1")
    with RunLock(tmp_path):  # a run under way
        run(shapes, tmp_path, "--eval-only", "--resume")
    assert json.loads((tmp_path / "eval_results.json").read_text())["AP"] >= 0


def test_a_run_that_ends_releases_the_directory(shapes, tmp_path):
    run(shapes, tmp_path, "train.max_steps=1")
    RunLock(tmp_path).acquire().release()  # in this process: a descriptor left open would refuse it
    with pytest.raises(SystemExit):
        run(shapes, tmp_path, "train.max_steps=1")  # refused (a checkpoint): released all the same
    RunLock(tmp_path).acquire().release()
