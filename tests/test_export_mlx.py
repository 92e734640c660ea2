"""Export to an MLX function file (.mlxfn): the file, loaded by `mx.import_function` in a process
that imports only mlx, against the MLX model, per variant, on small models with every weight moved
off its initial value; the C++ example's detections; `kernels.export_mode()`; the command and its
one-line errors."""

import shutil
import subprocess
import sys
from pathlib import Path

import kernels
from deformable_detr.deploy.inputs import canvas_inputs
from deformable_detr.deploy.mlxfn import export_mlx
from deformable_detr.export import main
from deformable_detr.models import post_process

import mlx.core as mx
import numpy as np
import pytest
from export_models import (
    CANVAS,
    SIZES,
    VARIANTS,
    assert_close,
    assert_post_processed,
    padded_batch,
    small_checkpoint,
    small_model,
)
from PIL import Image

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mlxfn"

# The user's side: a Python process with mlx and nothing of this package (asserted), numpy files in and out.
PLAIN_MLX = """
import sys
from pathlib import Path
import mlx.core as mx
function = mx.import_function(sys.argv[1])
outputs = function(**mx.load(sys.argv[2]))
assert not [m for m in sys.modules if m.split(".")[0] in ("deformable_detr", "kernels", "numpy")], "imported"
mx.savez(sys.argv[3], *outputs)
"""


def in_plain_mlx(path, inputs: dict, tmp_path) -> list:
    np.savez(tmp_path / "inputs.npz", **inputs)
    command = [sys.executable, "-I", "-c", PLAIN_MLX, str(path), str(tmp_path / "inputs.npz"), str(tmp_path / "out")]
    subprocess.run(command, check=True)
    outputs = np.load(tmp_path / "out.npz")
    return [outputs[f"arr_{i}"] for i in range(len(outputs.files))]


@pytest.mark.parametrize("variant", VARIANTS)
def test_file_gives_our_logits_and_boxes(variant, tmp_path):
    model, cfg = small_model(variant)
    path = tmp_path / "model.mlxfn"
    summary = export_mlx(model, cfg, path, size=CANVAS, batch_size=len(SIZES))
    assert summary.startswith(f"wrote {path}: ") and "canvas 96 x 128, batch 3" in summary
    images, mask = padded_batch()
    inputs = {"pixel_values": images.transpose(0, 3, 1, 2).copy(), "pixel_mask": (~mask).astype(np.int64)}
    logits, boxes = in_plain_mlx(path, inputs, tmp_path)

    ours = model(mx.array(images), mx.array(mask))
    for i, size in enumerate(SIZES):
        assert_close(ours["pred_logits"][i], logits[i], f"logits of the {size} image")
        assert_close(ours["pred_boxes"][i], boxes[i], f"boxes of the {size} image")


def photos_on_canvas(seed: int = 2):
    rng = np.random.default_rng(seed)
    photos = [Image.fromarray(rng.integers(0, 256, (h * 3, w * 3, 3), np.uint8)) for h, w in SIZES]
    return photos, canvas_inputs(photos, CANVAS, size=64, max_size=100)


@pytest.mark.parametrize("variant", ["r50", "r50_two_stage"])
def test_postprocess_file_gives_post_process_detections(variant, tmp_path):
    model, cfg = small_model(variant)
    export_mlx(model, cfg, tmp_path / "model.mlxfn", size=CANVAS, batch_size=len(SIZES), postprocess=True)
    photos, inputs = photos_on_canvas()
    target_sizes = np.array([[p.height, p.width] for p in photos], np.int64)
    scores, labels, boxes = in_plain_mlx(tmp_path / "model.mlxfn", {**inputs, "target_sizes": target_sizes}, tmp_path)

    assert_post_processed(model, inputs, target_sizes, (scores, labels, boxes))


@pytest.fixture(scope="module")
def detect(tmp_path_factory):
    """examples/mlxfn built with CMake against this environment's MLX wheel."""
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"building the C++ example needs {' and '.join(missing)}, not found on the PATH")
    build = tmp_path_factory.mktemp("mlxfn_build")
    python = f"-DPython_EXECUTABLE={sys.executable}"
    subprocess.run(["cmake", "-S", str(EXAMPLE), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", python], check=True)
    subprocess.run(["cmake", "--build", str(build)], check=True)
    return build / "detect"


def test_cpp_example_prints_our_detections(detect, tmp_path):
    model, cfg = small_model("r50_box_refine")
    path = tmp_path / "model.mlxfn"
    export_mlx(model, cfg, path, size=CANVAS, postprocess=True)
    photos, inputs = photos_on_canvas(seed=5)
    h, w = int(inputs["pixel_mask"][0].any(1).sum()), int(inputs["pixel_mask"][0].any(0).sum())
    inputs["pixel_values"][0, :, :h, :w].transpose(1, 2, 0).astype(np.float32).tofile(tmp_path / "image.f32")
    size = [str(photos[0].height), str(photos[0].width)]
    done = subprocess.run(
        [str(detect), str(path), str(tmp_path / "image.f32"), str(h), str(w), "--original-size", *size],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = np.array([line.split() for line in done.stdout.splitlines()], np.float64)

    images = mx.array(inputs["pixel_values"][:1].transpose(0, 2, 3, 1))
    ours = post_process(model(images, mx.array(inputs["pixel_mask"][:1] == 0)), [[photos[0].height, photos[0].width]])
    assert lines.shape == (60, 6)  # label score x0 y0 x1 y1 of every (query, class) pair
    np.testing.assert_array_equal(lines[:, 0], np.array(ours[0]["labels"]))
    assert_close(ours[0]["scores"], lines[:, 1].astype(np.float32), "scores")
    assert_close(ours[0]["boxes"], lines[:, 2:].astype(np.float32), "boxes in pixels")

    (tmp_path / "large.f32").write_bytes(np.zeros((97, 50, 3), np.float32).tobytes())
    done = subprocess.run([str(detect), str(path), str(tmp_path / "large.f32"), "97", "50"], capture_output=True)
    assert done.returncode == 1 and not done.stdout
    assert done.stderr.decode() == (
        f"error: {tmp_path / 'large.f32'}: 97 x 50 does not fit the 96 x 128 canvas {path} was exported for; "
        "resize it or export with a larger --size\n"
    )


def kernels_forward(value, locations, weights, image):
    """Every kernels op the model's forward uses, C++ primitives or custom functions outside export mode."""
    attended = kernels.ms_deform_attn(value, ((4, 5), (2, 3)), None, locations, weights)
    normed = kernels.layer_norm(kernels.softmax(attended), mx.ones((6,)), mx.zeros((6,)), 1e-5)
    sampled = kernels.grid_sample(image, locations.reshape(1, -1, 3, 2) * 2 - 1)
    return normed, sampled, kernels.patches(image, 3, 1, 1, 2)


def test_export_mode_writes_kernels_ops_that_import_and_match(tmp_path):
    rng = np.random.default_rng(0)
    inputs = [
        rng.standard_normal((1, 26, 2, 3)),
        rng.uniform(0, 1, (1, 7, 2, 2, 3, 2)),
        rng.uniform(0, 1, (1, 7, 2, 2, 3)),
    ]
    inputs = [mx.array(a.astype(np.float32)) for a in (*inputs, rng.standard_normal((1, 6, 7, 4)))]
    with pytest.raises(ValueError, match="Unable to serialize primitive"):  # the custom VJPs, C++ primitives
        mx.export_function(str(tmp_path / "plain.mlxfn"), kernels_forward, *inputs)
    with kernels.export_mode():
        assert kernels.exporting()
        mx.export_function(str(tmp_path / "kernels.mlxfn"), kernels_forward, *inputs)
    assert not kernels.exporting()
    imported = mx.import_function(str(tmp_path / "kernels.mlxfn"))
    for theirs, ours in zip(imported(*inputs), kernels_forward(*inputs), strict=True):
        assert_close(ours, theirs, "kernels ops")


def test_command_writes_the_file_after_checking_it(tmp_path, capsys):
    path, model = small_checkpoint(tmp_path)
    out = tmp_path / "model.mlxfn"
    main(["--to", "mlx", "--checkpoint", str(path), str(out), "--size", "96", "128", "--postprocess"])
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"wrote {out}: ") and "canvas 96 x 128, batch 1" in line
    assert "outputs scores, labels, boxes; mx.import_function in a process with only mlx: its scores and boxes" in line
    _, metadata = mx.import_function(str(out), return_metadata=True)
    assert metadata == (
        '{"canvas": [96, 128], "batch": 1, "inputs": ["pixel_values", "pixel_mask", "target_sizes"], '
        '"outputs": ["scores", "labels", "boxes"], "num_classes": 5}'
    )


def test_a_failed_check_leaves_no_file(tmp_path, monkeypatch):
    from deformable_detr.deploy import mlxfn

    path, _ = small_checkpoint(tmp_path, "r50_single_scale")
    monkeypatch.setattr(mlxfn, "TOLERANCE", -1.0)  # no difference passes: the check must fail
    out = tmp_path / "model.mlxfn"
    with pytest.raises(SystemExit, match=rf"^error: {out}: mx.import_function .* over -1: the export is wrong") as stop:
        main(["--to", "mlx", "--checkpoint", str(path), str(out), "--size", "64", "64"])
    assert "\n" not in str(stop.value.code)
    assert not list(tmp_path.glob("model*.mlxfn"))


@pytest.mark.parametrize(
    "options,message",
    [
        (["--sampler", "grid_sample"], "--sampler is for --to onnx, not --to mlx (an .mlxfn file samples with MLX's"),
        (["--size", "8", "8"], "two-stage takes the top 12 of the encoder's proposals, and this canvas gives 4"),
        (["--batch-size", "0"], "--size 800 1333 --batch-size 0: each must be at least 1"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, options, message):
    path, _ = small_checkpoint(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["--to", "mlx", "--checkpoint", str(path), str(tmp_path / "model.mlxfn"), *options])
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1
    with pytest.raises(SystemExit) as stop:
        main(["--to", "mlx", "--checkpoint", str(path), str(tmp_path / "model.bin")])
    assert stop.value.code == 2 and "model.bin: an MLX function file's name ends in .mlxfn" in capsys.readouterr().err
