"""A write that fails (a full disk) names the file and the system's reason, and the training run says
which checkpoint stays intact: on a real full file system (a small tmpfs, mounted in a private mount
namespace where the machine allows it; /dev/full for the log) and with a writer patched to fail."""

import contextlib
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
    argv = ["--config", str(TINY), "--output-dir", str(tmp_path), f"data.path={shapes}", "train.eval_every=0"]
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
    settings = [f"data.path={shapes}", "train.eval_every=0"]
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


# An output directory that cannot be written. The tests run as root (here and in CI), which permission
# bits do not stop: what refuses root is used instead, each a real refusal by the kernel: a file where
# a directory should be (ENOTDIR), the immutable attribute (chattr +i: EPERM, even for root), a
# read-only mount (EROFS).
NOT_PERMITTED, READ_ONLY = os.strerror(errno.EPERM), os.strerror(errno.EROFS)


@contextlib.contextmanager
def immutable(path):
    """`path` with the immutable attribute for the block; a skip saying why where it cannot be set."""
    done = (
        subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True) if shutil.which("chattr") else None
    )
    if done is None or done.returncode != 0:
        pytest.skip(f"cannot make a file immutable here: {done.stderr.strip() if done else 'no chattr'}")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def train_into(shapes, output):  # noqa: F811
    """train.main into `output` -> its one line."""
    argv = ["--config", str(TINY), "--output-dir", str(output), f"data.path={shapes}", "train.eval_every=0"]
    with pytest.raises(SystemExit) as stopped:
        train.main([*argv, "train.max_steps=1"])
    return str(stopped.value)


def test_an_output_directory_under_a_file_is_named_as_a_write_error(shapes, tmp_path):  # noqa: F811
    (tmp_path / "file").write_text("")
    output = tmp_path / "file" / "run"
    assert train_into(shapes, output) == (
        f"error: {output}: cannot write it: {os.strerror(errno.ENOTDIR)}; no checkpoint written yet"
    )


def test_a_directory_that_cannot_be_made_is_named_as_a_write_error(shapes, tmp_path):  # noqa: F811
    with immutable(tmp_path):
        line = train_into(shapes, tmp_path / "run")
    assert line == f"error: {tmp_path / 'run'}: cannot write it: {NOT_PERMITTED}; no checkpoint written yet"


@pytest.mark.parametrize("held", [[], [".lock"]], ids=["the lock", "config.yaml"])
def test_the_first_file_that_cannot_be_written_is_named_as_a_write_error(shapes, tmp_path, held):  # noqa: F811
    """An output directory where no file can be made: the lock is the first; where an earlier run
    that stopped before writing anything left its lock, config.yaml."""
    for name in held:
        (tmp_path / name).write_text("")
    first = tmp_path / (".lock" if not held else "config.yaml")
    with immutable(tmp_path):
        line = train_into(shapes, tmp_path)
    assert line == f"error: {first}: cannot write it: {NOT_PERMITTED}; no checkpoint written yet"


def test_a_log_that_cannot_be_opened_is_named_as_a_write_error(tmp_path):
    run = RunDirectory(tmp_path, load_config(TINY), {})
    (tmp_path / "log.jsonl").write_text("")
    run.claim()
    with run, immutable(tmp_path / "log.jsonl"), pytest.raises(CommandError) as failed:
        run.start_writing()
    assert str(failed.value) == f"{tmp_path / 'log.jsonl'}: cannot write it: {NOT_PERMITTED}; no checkpoint written yet"


def test_a_read_only_file_system_is_named_as_a_write_error(shapes, tmp_path):  # noqa: F811
    """The command, in a mount namespace where the output directory's parent is a read-only tmpfs."""
    why_not = can_mount_a_tmpfs()
    if why_not:
        pytest.skip(why_not)
    disk, output = tmp_path / "disk", tmp_path / "disk" / "run"
    disk.mkdir()
    command = [sys.executable, str(ROOT / "train.py"), "--config", str(TINY), "--output-dir", str(output)]
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o ro tmpfs {disk} || exit 99; exec "$@"', "sh", *command]
        + [f"data.path={shapes}", "train.eval_every=0", "train.max_steps=1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {output}: cannot write it: {READ_ONLY}; no checkpoint written yet"
    )
