"""One writer for every weights file: the previous file survives a write cut short, nothing temporary
is left, and the new file and its directory entry reach the disk before and after the rename. One
reader: a checkpoint's model tensors come back under their parameter names."""

import os
from pathlib import Path

from deformable_detr import build_model, load_config
from deformable_detr.training.optimizer import build_optimizer
from deformable_detr.weights.checkpoint import save_checkpoint
from deformable_detr.weights.files import atomic_write, read_weights, save_weights
from deformable_detr.weights.loading import load_trained_model

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_train import TINY


def test_a_write_cut_short_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_weights(path, {"a": np.ones(3, np.float32)}, {1: "thing"})
    before = path.read_bytes()
    with pytest.raises(KeyboardInterrupt), atomic_write(path) as tmp:
        tmp.write_bytes(b"the first half of a file")
        raise KeyboardInterrupt
    assert path.read_bytes() == before
    assert sorted(tmp_path.iterdir()) == [path]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names a descriptor's file through /proc (Linux)")
def test_the_file_is_synced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    events, replace = [], os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", str(a), str(b))), replace(a, b))[1])
    path = tmp_path / "weights.safetensors"
    save_weights(path, {"a": np.ones(3, np.float32)})
    tmp = str(tmp_path / "weights.tmp.safetensors")
    assert events == [("fsync", tmp), ("rename", tmp, str(path)), ("fsync", str(tmp_path))]
    np.testing.assert_array_equal(np.array(read_weights(path).tensors["a"]), np.ones(3))


def test_a_checkpoint_reads_back_under_the_parameter_names(tmp_path):
    cfg = load_config(TINY)
    mx.random.seed(0)
    model = build_model(cfg)
    progress = {"epoch": 2, "step": 1, "global_step": 9}
    save_checkpoint(tmp_path / "checkpoint.safetensors", model, build_optimizer(cfg), cfg, progress, {3: "star"})
    saved = read_weights(tmp_path / "checkpoint.safetensors")
    assert saved.progress == progress and saved.class_names == {3: "star"}
    assert saved.config["model"]["hidden_dim"] == 64

    loaded, names = load_trained_model(
        tmp_path / "checkpoint.safetensors", load_config(TINY, ["model.num_classes=auto"])
    )
    assert names == {3: "star"} and not loaded.training
    parameters = dict(tree_flatten(model.parameters()))
    assert saved.tensors.keys() == parameters.keys()
    for key, value in saved.tensors.items():
        np.testing.assert_array_equal(np.array(value), np.array(parameters[key]), err_msg=key)
