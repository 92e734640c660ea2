"""A write that fails (a full disk) names the file and the system's reason, and the training run says
which checkpoint stays intact: on a real full file system (a small tmpfs, mounted in a private mount
namespace where the machine allows it; /dev/full for the log) and with a writer patched to fail."""

import errno
import json
import os
import re
import shutil
import subprocess
import sys

from deformable_detr import load_config
from deformable_detr.errors import CommandError, WriteError
from deformable_detr.training.run_directory import RunDirectory
from deformable_detr.weights import files
from deformable_detr.weights.files import read_weights, save_weights

import numpy as np
import pytest
from test_train import ROOT, TINY, shapes  # noqa: F401  (the fixture)

import train

NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device"
WRITTEN = r"written \d{4}-\d\d-\d\d \d\d:\d\d"


def failing_writes(after: int):
    """mx.save_safetensors that writes `after` files, then half a file and fails as a full disk does."""
    save, calls = files.mx.save_safetensors, []

    def save_or_fail(file, arrays, metadata=None):
        calls.append(file)
        if len(calls) <= after:
            return save(file, arrays, metadata=metadata)
        file.write(b"\0" * 1000)
        raise OSError(errno.ENOSPC, NO_SPACE)

    return save_or_fail


def test_the_writer_names_the_file_and_the_reason_and_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "weights.safetensors"
    save_weights(path, {"a": np.ones(3, np.float32)}, {1: "thing"})
    before = path.read_bytes()
    monkeypatch.setattr(files.mx, "save_safetensors", failing_writes(after=0))
    with pytest.raises(WriteError) as failed:
        save_weights(path, {"a": np.zeros(3, np.float32)})
    assert str(failed.value) == f"{path}: cannot write it: {NO_SPACE}"
    assert failed.value.status == 1 and path.read_bytes() == before
    assert sorted(tmp_path.iterdir()) == [path]  # no temporary file left


def test_a_failed_checkpoint_save_stops_the_run_naming_the_checkpoint_intact(shapes, tmp_path, monkeypatch):  # noqa: F811
    """Saves after every step; the second fails: the run stops in one line, the first stays."""
    monkeypatch.setattr(files.mx, "save_safetensors", failing_writes(after=1))
    argv = ["--config", str(TINY), "--output-dir", str(tmp_path), f"data.coco_path={shapes}", "train.eval_every=0"]
    with pytest.raises(SystemExit) as stopped:
        train.main([*argv, "train.max_steps=3", "train.checkpoint_every=1"])
    checkpoint = tmp_path / "checkpoint.safetensors"
    assert re.fullmatch(
        re.escape(f"error: {checkpoint}: cannot write it: {NO_SPACE}; the last checkpoint, intact: {checkpoint} ")
        + rf"\(epoch 0, step 1, global step 1, {WRITTEN}\)",
        str(stopped.value),
    ), stopped.value
    assert read_weights(checkpoint).progress["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "checkpoint.safetensors", "config.yaml", "log.jsonl"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="/dev/full (Linux) answers every write: no space")
def test_a_full_disk_under_the_log_names_it(tmp_path):
    run = RunDirectory(tmp_path, load_config(TINY), {})
    (tmp_path / "log.jsonl").symlink_to("/dev/full")
    run.claim()
    with run:
        run.start_writing()
        with pytest.raises(CommandError) as failed:
            run.log({"global_step": 1, "loss": 1.0})
    assert str(failed.value) == f"{tmp_path / 'log.jsonl'}: cannot write it: {NO_SPACE}; no checkpoint written yet"


def can_mount_a_tmpfs() -> str:
    """'' where this process may mount a tmpfs in a mount namespace of its own, else why not."""
    if shutil.which("unshare") is None or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "mounting a tmpfs needs root and unshare (util-linux)"
    done = subprocess.run(
        ["unshare", "-m", "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", "/mnt"], capture_output=True
    )
    return "" if done.returncode == 0 else f"cannot mount a tmpfs here: {done.stderr.decode().strip()}"


def test_a_full_tmpfs_stops_the_run_at_the_save_that_does_not_fit(shapes, tmp_path):  # noqa: F811
    """A tmpfs with room for one checkpoint and a half: the first save fits, the second (written beside
    the first before the rename) does not. The command's own line, exit 1; read inside the mount
    namespace after it: the first checkpoint whole, no temporary file left."""
    why_not = can_mount_a_tmpfs()
    if why_not:
        pytest.skip(why_not)
    settings = [f"data.coco_path={shapes}", "train.eval_every=0"]
    train.main(["--config", str(TINY), "--output-dir", str(tmp_path / "sized"), *settings, "train.max_steps=1"])
    size = (tmp_path / "sized" / "checkpoint.safetensors").stat().st_size
    disk, run = tmp_path / "disk", tmp_path / "disk" / "run"
    disk.mkdir()
    command = [sys.executable, str(ROOT / "train.py"), "--config", str(TINY), "--output-dir", str(run), *settings]
    check = (
        "import json, os, sys; from deformable_detr.weights.files import read_weights; "
        "print(json.dumps([read_weights(sys.argv[1]).progress['global_step'], sorted(os.listdir(sys.argv[2]))]))"
    )
    script = (
        f"mount -t tmpfs -o size={size * 3 // 2 + 2**20} tmpfs {disk} || exit 99; "
        f'"$@"; status=$?; {sys.executable} -c "{check}" {run / "checkpoint.safetensors"} {run}; exit $status'
    )
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", *command, "train.checkpoint_every=1", "train.max_steps=3"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    checkpoint = run / "checkpoint.safetensors"
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        re.escape(f"error: {checkpoint}: cannot write it: {NO_SPACE}; the last checkpoint, intact: {checkpoint} ")
        + rf"\(epoch 0, step 1, global step 1, {WRITTEN}\)",
        last,
    ), done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [
        1,
        [".lock", "checkpoint.safetensors", "config.yaml", "log.jsonl"],
    ]
