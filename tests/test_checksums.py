"""Every weights file written here records the SHA-256 of each tensor (name, dtype, shape, bytes) in
its metadata, and every reader checks it: one flipped byte in a tensor is refused in one line naming
the file and the tensor, by read_weights and by train.py --resume (before anything in the run
directory is written), eval, predict, serve and export. Files without checksums (the authors',
Hugging Face's, ours from before) load as before. A checkpoint's temporary file, left by a run killed
while saving, is removed with a note when the next run claims the directory."""

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys

from deformable_detr.weights.files import CHECKSUMS_KEY, read_metadata, read_weights, save_weights

import mlx.core as mx
import pytest
from test_stops import assert_one_clean_line, progress_of, run_train
from test_train import ROOT, TINY

import train

SETTINGS = ["train.eval_every=0", "model.dropout=0.0"]
DAMAGED = "does not match its checksum: the file was damaged after it was written (on disk or in a copy)"


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from deformable_detr.data.shapes import generate

    return generate(tmp_path_factory.mktemp("shapes"), 40, 4, seed=3, height=(64, 64), width=(64, 64), max_size=40)


@pytest.fixture(scope="module")
def trained(shapes, tmp_path_factory):
    """A run directory after one training step: its checkpoint, config.yaml and log.jsonl."""
    output = tmp_path_factory.mktemp("run")
    argv = ["--config", str(TINY), "--output-dir", str(output), f"data.path={shapes}", "train.max_steps=1"]
    train.main(argv + SETTINGS)
    return output


def run_copy(trained, tmp_path):
    output = tmp_path / "run"
    shutil.copytree(trained, output)
    return output


def data_range(path, name) -> tuple[int, int]:
    """Where tensor `name`'s bytes are in the safetensors file at `path` (from its header)."""
    with open(path, "rb") as file:
        length = struct.unpack("<Q", file.read(8))[0]
        begin, end = json.loads(file.read(length))[name]["data_offsets"]
    return 8 + length + begin, 8 + length + end


def flip_a_byte(path, name):
    """One byte in the middle of tensor `name`'s data, its bits inverted, in place."""
    begin, end = data_range(path, name)
    data = bytearray(path.read_bytes())
    data[(begin + end) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def contents(output) -> dict:
    return {p.name: p.read_bytes() for p in output.iterdir() if p.is_file() and p.name != ".lock"}


ARRAYS = {
    "weight": mx.arange(12, dtype=mx.float32).reshape(3, 4),
    "half": (mx.arange(6, dtype=mx.bfloat16) / 3).reshape(2, 3).T,  # bf16, and not contiguous in memory
    "step": mx.array(7, dtype=mx.uint32),  # 0-d, as an optimizer's step count
    "mask": mx.array([True, False, True]),
}


def test_the_checksum_is_the_sha256_of_each_tensors_dtype_shape_and_bytes_in_the_file(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_weights(path, ARRAYS, {1: "thing"})
    recorded = json.loads(read_metadata(path)[CHECKSUMS_KEY])
    assert sorted(recorded) == sorted(ARRAYS)
    data = path.read_bytes()
    for name, (dtype, shape) in {"weight": ("F32", [3, 4]), "half": ("BF16", [3, 2]), "step": ("U32", [])}.items():
        begin, end = data_range(path, name)
        expected = hashlib.sha256(json.dumps([dtype, shape]).encode() + data[begin:end]).hexdigest()
        assert recorded[name] == expected, name
    loaded = read_weights(path)
    assert loaded.class_names == {1: "thing"}
    for name, array in ARRAYS.items():
        assert mx.array_equal(loaded.tensors[name], array).item() and loaded.tensors[name].dtype == array.dtype, name


@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_one_flipped_byte_in_any_tensor_is_refused_naming_the_file_and_the_tensor(tmp_path, name):
    path = tmp_path / "weights.safetensors"
    save_weights(path, ARRAYS)
    flip_a_byte(path, name)
    with pytest.raises(ValueError) as refused:
        read_weights(path)
    assert str(refused.value).startswith(f"{path}: tensor {name} {DAMAGED}")
    assert read_weights(path, verify=False).tensors.keys() == ARRAYS.keys()  # what --config lookups read


def test_a_tensor_removed_or_added_after_the_checksums_were_written_is_refused(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_weights(path, ARRAYS)
    metadata = read_metadata(path)
    mx.save_safetensors(str(path), {k: v for k, v in ARRAYS.items() if k != "mask"}, metadata=metadata)
    with pytest.raises(ValueError, match=rf"^{path}: tensor mask has a checksum but is not in the file: "):
        read_weights(path)
    mx.save_safetensors(str(path), {**ARRAYS, "extra": mx.zeros(2)}, metadata=metadata)
    with pytest.raises(ValueError, match=rf"^{path}: tensor extra has no checksum: "):
        read_weights(path)


@pytest.mark.parametrize("recorded", ["[]", '"abc"', "{", "7"])
def test_damaged_checksum_metadata_is_one_error_naming_the_file(tmp_path, recorded):
    path = tmp_path / "weights.safetensors"
    save_weights(path, ARRAYS)
    mx.save_safetensors(str(path), ARRAYS, metadata={**read_metadata(path), "tensor_sha256": recorded})
    with pytest.raises(ValueError, match=rf"^{path}: unreadable tensor_sha256 metadata: the file is damaged$"):
        read_weights(path)


def test_files_without_checksums_load_as_before(trained, tmp_path):
    """The authors' and Hugging Face's files, and ours written before checksums: no such metadata."""
    bare = tmp_path / "bare.safetensors"
    mx.save_safetensors(str(bare), {"a": mx.ones(3)})
    assert mx.array_equal(read_weights(bare).tensors["a"], mx.ones(3)).item()

    older = tmp_path / "checkpoint.safetensors"
    arrays, metadata = mx.load(str(trained / "checkpoint.safetensors"), return_metadata=True)
    del metadata[CHECKSUMS_KEY]
    mx.save_safetensors(str(older), arrays, metadata=metadata)
    assert read_weights(older).progress == read_weights(trained / "checkpoint.safetensors").progress


def test_resume_from_a_checkpoint_with_a_flipped_byte_stops_before_writing_anything(shapes, trained, tmp_path):
    output = run_copy(trained, tmp_path)
    checkpoint = output / "checkpoint.safetensors"
    flip_a_byte(checkpoint, "model.class_embed.0.bias")
    before = contents(output)
    done = run_train(shapes, output, "train.max_steps=2", "--resume", timeout=300)
    line = assert_one_clean_line(done, 1)
    assert line.startswith(f"error: {checkpoint}: tensor model.class_embed.0.bias {DAMAGED}"), line
    assert contents(output) == before  # the checkpoint, config.yaml and log.jsonl untouched

    shutil.copy(trained / "checkpoint.safetensors", checkpoint)  # the intact copy resumes
    done = run_train(shapes, output, "train.max_steps=2", "--resume", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert progress_of(checkpoint)["global_step"] == 2


def inference_command(name: str, checkpoint, shapes, tmp_path) -> list[str]:
    module = [sys.executable, "-m", f"deformable_detr.{name}"]
    if name == "eval":
        return module + ["--checkpoint", str(checkpoint), "--data-path", str(shapes)]
    if name == "predict":
        image = sorted((shapes / "val2017").iterdir())[0]
        return module + ["--checkpoint", str(checkpoint), "--output-dir", str(tmp_path / "predictions"), str(image)]
    if name == "serve":
        return module + ["--checkpoint", str(checkpoint), "--port", "0"]
    return module + ["--to", "mlx", "--checkpoint", str(checkpoint), str(tmp_path / "model.mlxfn")]


@pytest.mark.parametrize("name", ["eval", "predict", "serve", "export"])
def test_eval_predict_serve_and_export_refuse_a_flipped_byte_in_one_line(shapes, trained, tmp_path, name):
    checkpoint = tmp_path / "checkpoint.safetensors"
    shutil.copy(trained / "checkpoint.safetensors", checkpoint)
    flip_a_byte(checkpoint, "model.transformer.level_embed")
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = inference_command(name, checkpoint, shapes, tmp_path)
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=environment, timeout=300)
    line = assert_one_clean_line(done, 1)
    assert line.startswith(f"error: {checkpoint}: tensor model.transformer.level_embed {DAMAGED}"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.safetensors"]  # nothing written


def test_a_checkpoints_temporary_file_left_by_a_killed_save_is_removed_at_the_next_start(shapes, trained, tmp_path):
    output = run_copy(trained, tmp_path)
    partials = [output / "checkpoint.tmp.safetensors", output / "checkpoint_best.tmp.safetensors"]
    for partial in partials:
        partial.write_bytes(b"the first part of a checkpoint")  # what a SIGKILL during the save leaves
    done = run_train(shapes, output, "train.max_steps=2", "--resume", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for partial in partials:
        assert not partial.exists()
        assert f"removed {partial}: part of a checkpoint, left by a run stopped while saving it" in done.stdout
    assert progress_of(output / "checkpoint.safetensors")["global_step"] == 2
