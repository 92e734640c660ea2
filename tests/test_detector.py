"""`Detector`, the one object the commands are built on: its results are the predict command's JSON
(a folder, a single image with its sampling points) and eval.py's files; every kind of input gives the
same detections, which are the model's own post-processed outputs at or above the threshold."""

import dataclasses
import io
import json
from pathlib import Path

import kernels
from deformable_detr import Detector
from deformable_detr.commands.eval import parse_args as eval_arguments
from deformable_detr.data.loader import collate
from deformable_detr.data.transforms import normalize, resize
from deformable_detr.errors import UsageError
from deformable_detr.models import post_process
from deformable_detr.models.precision import Precision, resolve_precision
from deformable_detr.predict import main as predict_main
from kernels.precision import BfloatRule

import mlx.core as mx
import numpy as np
import pytest
from dataset_writers import write_yolo
from PIL import Image
from test_evaluate import trained  # noqa: F401  (the fixture: a tiny model trained a few epochs)

import eval as eval_script

CONFIGS = Path(__file__).parent.parent / "configs"


@pytest.fixture(scope="module")
def detector(trained):  # noqa: F811
    _, output = trained
    return Detector.load(output / "checkpoint.safetensors", precision="float32")


def test_results_are_the_predict_commands_json_for_a_folder(trained, detector, tmp_path):  # noqa: F811
    root, output = trained
    argv = [
        "--checkpoint",
        str(output / "checkpoint.safetensors"),
        "--output-dir",
        str(tmp_path),
        "--threshold",
        "0",
        "--precision",
        "float32",
    ]
    predict_main([*argv, "--batch-size", "2", str(root / "val2017")])
    results = detector.predict(root / "val2017", threshold=0.0, batch_size=2)
    assert [r.path.name for r in results] == sorted(p.name for p in (root / "val2017").iterdir())
    for result in results:
        assert len(result) == 100  # threshold 0: every one of the top 100
        assert result.to_json() == json.loads((tmp_path / f"{result.path.stem}.json").read_text())


def test_a_single_image_with_its_sampling_points(trained, detector, tmp_path):  # noqa: F811
    root, output = trained
    image = sorted((root / "val2017").iterdir())[1]
    argv = [
        "--checkpoint",
        str(output / "checkpoint.safetensors"),
        "--output-dir",
        str(tmp_path),
        "--precision",
        "float32",
    ]
    predict_main([*argv, "--threshold", "0.05", "--attention", str(image)])
    [result] = detector.predict(str(image), threshold=0.05, attention=True)
    written = json.loads((tmp_path / f"{image.stem}.json").read_text())
    assert result.to_json() == written and len(written) > 0
    assert all(len(record["sampling_points"]) == detector.cfg.model.nheads for record in written)
    assert all(record["score"] >= 0.05 for record in written)


def test_every_kind_of_input_gives_the_models_own_detections(trained, detector):  # noqa: F811
    root, _ = trained
    path = sorted((root / "val2017").iterdir())[0]
    image = Image.open(path).convert("RGB")
    found = [detector.predict(item, threshold=0.02)[0] for item in (image, np.asarray(image), str(path), path)]
    for other in found[1:]:
        np.testing.assert_array_equal(other.boxes, found[0].boxes)
        np.testing.assert_array_equal(other.scores, found[0].scores)
        assert other.names == found[0].names

    # the reference: the model's forward on the evaluation resize, post-processed, kept at the threshold
    empty = {"boxes": np.zeros((0, 4), np.float32), "labels": np.zeros(0, np.int64)}
    data = detector.cfg.data
    pixels, mask, _ = collate([normalize(*resize(image, empty, data.val_size, data.max_size))])
    [expected] = post_process(detector.model(mx.array(pixels), mx.array(mask)), [[image.height, image.width]])
    kept = np.array(expected["scores"]) >= 0.02
    assert kept.any()
    np.testing.assert_allclose(found[0].boxes, np.array(expected["boxes"])[kept], rtol=1e-6, atol=1e-4)
    np.testing.assert_array_equal(found[0].labels, np.array(expected["labels"])[kept])
    assert found[0].names == [detector.class_names[int(label)] for label in found[0].labels]
    assert found[0].image_size == image.size


def test_evaluate_is_eval_py(trained, detector, tmp_path):  # noqa: F811
    root, output = trained
    stats = detector.evaluate(root, output_dir=tmp_path / "api")
    checkpoint = str(output / "checkpoint.safetensors")
    argv = ["--checkpoint", checkpoint, "--coco-path", str(root), "--output-dir", str(tmp_path)]
    eval_script.main([*argv, "--precision", "float32"])  # asked, as the detector's (the default is said so)
    assert stats == json.loads((tmp_path / "eval_results.json").read_text())
    assert stats == json.loads((tmp_path / "api" / "eval_results.json").read_text())
    assert stats["AR100"] > 0 and set(stats["per_class"]) == set(detector.class_names.values())
    for name in ("detections_val.json", "pr_curves.png"):
        assert (tmp_path / "api" / name).read_bytes() == (tmp_path / name).read_bytes()


def test_bad_input_is_named(detector, tmp_path):
    with pytest.raises(ValueError, match=r"an image array must be .* got \(4, 4, 3\) float64"):
        detector.predict(np.zeros((4, 4, 3)))
    with pytest.raises(FileNotFoundError, match="nothing.png: no such image file"):
        detector.predict(tmp_path / "nothing.png")
    (tmp_path / "broken.png").write_bytes(b"not an image")
    with pytest.raises(ValueError, match="broken.png: cannot read image"):
        detector.predict(tmp_path / "broken.png")
    with pytest.raises(ValueError, match="export to 'onnx-ish': expected"):
        detector.export("onnx-ish", tmp_path / "out")


def a_folder_with_unreadable_files(root, folder):
    """folder/: 1.jpg and 3.png readable, 2.png not an image, 4.jpg a JPEG cut in half -> the readable two."""
    folder.mkdir()
    first, second = sorted((root / "val2017").iterdir())[:2]
    good = [folder / "1.jpg", folder / "3.png"]
    Image.open(first).save(good[0])
    Image.open(second).save(good[1])
    (folder / "2.png").write_bytes(b"\x89PNG truncated")
    whole = io.BytesIO()
    Image.open(second).convert("RGB").save(whole, "JPEG", quality=95)
    (folder / "4.jpg").write_bytes(whole.getvalue()[: len(whole.getvalue()) // 2])
    return good


def test_skip_unreadable_returns_every_readable_image(trained, detector, tmp_path, monkeypatch):  # noqa: F811
    root, _ = trained
    good = a_folder_with_unreadable_files(root, tmp_path / "photos")
    alone = detector.predict(good, threshold=0.02, batch_size=2)
    forwards = []  # the images of each forward: the unreadable ones leave no gap in a batch
    run = detector._forward
    monkeypatch.setattr(detector, "_forward", lambda images, *rest: forwards.append(len(images)) or run(images, *rest))
    with pytest.warns(UserWarning) as warned:
        results = detector.predict(tmp_path / "photos", threshold=0.02, batch_size=2, skip_unreadable=True)
    assert forwards == [2]
    assert [r.path for r in results] == good
    for result, reference in zip(results, alone, strict=True):
        assert len(result) > 0
        np.testing.assert_array_equal(result.boxes, reference.boxes)
        np.testing.assert_array_equal(result.scores, reference.scores)
    broken, truncated = tmp_path / "photos" / "2.png", tmp_path / "photos" / "4.jpg"
    assert [path for path, _ in results.skipped] == [broken, truncated]
    assert results.skipped[0][1].startswith("cannot read image: not a format Pillow")
    assert "truncated" in results.skipped[1][1]
    assert [str(w.message) for w in warned] == [f"skipped: {path}: {reason}" for path, reason in results.skipped]
    assert {w.filename for w in warned} == {__file__}  # the warning points at the caller's line


def test_an_unreadable_image_stops_predict_without_skip(trained, detector, tmp_path):  # noqa: F811
    root, _ = trained
    a_folder_with_unreadable_files(root, tmp_path / "photos")
    with pytest.raises(ValueError, match=r"2\.png: cannot read image: .*; skip_unreadable=True leaves such images out"):
        detector.predict(tmp_path / "photos", batch_size=2)
    assert detector.predict(tmp_path / "photos" / "1.jpg").skipped == []


def test_evaluate_names_a_config_file_or_a_file_that_is_no_dataset(detector, tmp_path):
    for config in (CONFIGS / "shapes.yaml", CONFIGS / "r50.yaml"):
        with pytest.raises(UsageError) as stopped:
            detector.evaluate(config)
        message = str(stopped.value)
        assert message.startswith(f"{config}: a config file, not a dataset; evaluate takes a dataset: a folder")
        assert "\n" not in message
    with pytest.raises(UsageError, match=r"^[^\n]*README\.md: a file, not a dataset; evaluate takes"):
        detector.evaluate(CONFIGS / "README.md")


def test_evaluate_takes_a_yolo_data_yaml(trained, detector, tmp_path):  # noqa: F811
    root, _ = trained
    data_yaml = write_yolo(root, tmp_path / "yolo") / "data.yaml"
    with pytest.raises(UsageError, match=r"data\.yaml: a YAML file, but data\.dataset coco reads a folder; .*=yolo"):
        detector.evaluate(data_yaml)
    cfg = detector.cfg
    yolo = Detector(
        detector.model,
        dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataset="yolo")),
        detector.class_names,
        precision=detector.precision,
    )
    stats = yolo.evaluate(data_yaml)
    assert stats["AR100"] > 0 and stats == detector.evaluate(root)  # the same images and boxes: the same AP


def test_bfloat16_products_keep_the_float32_detections(trained, detector, capsys):  # noqa: F811
    """--precision bfloat16 where bfloat16 products are fast: the same weights, the convolutions' and
    linears' products in bfloat16 (the heads' float32); each float32 detection scoring >= 0.05 has a
    bfloat16 one of its class within 0.5 px. Where they are not fast (a CPU without AMX or AVX512-BF16,
    or ONEDNN_MAX_CPU_ISA below them), float32 runs: the detections are float32's, and the precision line
    and eval_results.json say so, with why."""
    root, output = trained
    fast, why = kernels.bfloat16_products()
    narrow = Detector.load(output / "checkpoint.safetensors", precision="bfloat16")
    said = f"bfloat16 (asked for: {why})" if fast else f"float32 (bfloat16 asked for, but {why})"
    assert str(narrow.precision) == said and narrow.precision.asked == "bfloat16"
    images = sorted((root / "val2017").iterdir())
    compared = 0
    for wide, thin in zip(detector.predict(images, 0.05), narrow.predict(images, 0.0), strict=True):
        for box, label in zip(wide.boxes, wide.labels, strict=True):
            same = thin.boxes[thin.labels == label]
            assert np.abs(same - box).max(axis=1).min() <= (0.5 if fast else 1e-4)
            compared += 1
    assert compared > 0
    checkpoint = str(output / "checkpoint.safetensors")
    predict_main(
        ["--checkpoint", checkpoint, "--precision", "bfloat16", "--output-dir", str(root.parent / "bf16")]
        + [str(images[0])]
    )
    assert f"precision: {said}" in capsys.readouterr().err
    argv = ["--checkpoint", checkpoint, "--data-path", str(root), "--precision", "bfloat16"]
    stats = eval_script.main([*argv, "--output-dir", str(root.parent / "bf16")])
    written = json.loads((root.parent / "bf16" / "eval_results.json").read_text())
    assert written["precision"] == stats["precision"] == narrow.precision.to_json()
    assert written["precision"]["ran"] == ("bfloat16" if fast else "float32")
    assert f"precision: {said}" in capsys.readouterr().err


@pytest.mark.skipif(
    not kernels.bfloat16_products()[0], reason=f"bfloat16 runs float32 here: {kernels.bfloat16_products()[1]}"
)
def test_the_attention_view_at_auto_is_float32s_and_bfloat16s_only_when_asked(trained, detector):  # noqa: F811
    """Where the model looks is shown as float32 computes it at `auto` (its sampling points the float32
    detector's, bit for bit), while auto's detections without the view take its bfloat16 products; asked for,
    bfloat16 moves the points (models/precision.py: up to 4.2 px at 800 x 1066). The auto here runs every
    product in bfloat16 (a rule for which every size pays), so that the two differ wherever bfloat16 does."""
    root, output = trained
    image = sorted((root / "val2017").iterdir())[0]
    every = BfloatRule(0, 0, "every product")
    auto = Detector(
        detector.model, detector.cfg, detector.class_names, precision=Precision("bfloat16", "auto", "a test's", every)
    )
    asked = Detector(detector.model, detector.cfg, detector.class_names, precision=resolve_precision("bfloat16"))
    [wide] = detector.predict(image, threshold=0.0, attention=True)
    [seen] = auto.predict(image, threshold=0.0, attention=True)
    [narrow] = asked.predict(image, threshold=0.0, attention=True)
    assert all(np.array_equal(seen.attention[k], wide.attention[k]) for k in wide.attention)
    assert not np.array_equal(narrow.attention["points"], wide.attention["points"])
    [plain] = auto.predict(image, threshold=0.0)  # no view: auto's bfloat16, as asked's
    assert np.array_equal(plain.boxes, narrow.boxes) and not np.array_equal(plain.boxes, wide.boxes)


def test_precision_is_checked_before_the_weights_are_read(tmp_path):
    with pytest.raises(ValueError, match="precision 'fp16': expected one of auto, float32, bfloat16"):
        Detector.load(tmp_path / "missing.safetensors", precision="fp16")
    with pytest.raises(UsageError, match="--precision: invalid choice: 'fp16'"):
        eval_arguments(["--checkpoint", "x", "--precision", "fp16"])
    assert eval_arguments(["--checkpoint", "x"]).precision == "float32"  # AP is a reference number
