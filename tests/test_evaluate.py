"""eval.py against pycocotools called directly; predictions drawn; bad image paths named."""

import contextlib
import io
import json

from deformable_detr.data.shapes import generate
from deformable_detr.inference.evaluation import PER_CLASS_NAMES, STAT_NAMES, coco_evaluator, summary
from deformable_detr.predict import main as predict_main

import numpy as np
import pytest
from test_train import TINY

import eval as eval_script
import train


def coco_stats(coco_gt, detections: list, verbose: bool = True, backend: str = "auto") -> dict:
    """The 12 numbers by name and "per_class" of `detections` (COCO's results format) on `coco_gt`, a
    pycocotools COCO: evaluation's evaluator and summary, as `score_detections` has them of a dataset."""
    return summary(coco_evaluator(coco_gt, detections, verbose, backend), coco_gt)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained for a few epochs on a small generated set (so its AP is not all zeros)."""
    root = generate(tmp_path_factory.mktemp("shapes"), 16, 6, seed=11, height=(64, 64), width=(64, 64), max_size=40)
    output = tmp_path_factory.mktemp("run")
    train.main(
        [
            "--config",
            str(TINY),
            "--output-dir",
            str(output),
            f"data.path={root}",
            "schedule.epochs=3",
            "model.num_queries=20",
        ]
    )
    return root, output


def test_eval_equals_pycocotools_on_the_detections_it_wrote(trained, tmp_path):
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    root, output = trained
    stats = eval_script.main(
        [
            "--config",
            str(TINY),
            "--checkpoint",
            str(output / "checkpoint.safetensors"),
            "--coco-path",
            str(root),
            "--output-dir",
            str(tmp_path),
            "model.num_queries=20",
        ]
    )
    written = json.loads((tmp_path / "eval_results.json").read_text())
    assert written == stats
    assert list(written) == [*STAT_NAMES, "per_class", "ground_truth", "confusion_matrix", "precision"]
    assert written["precision"] == {"ran": "float32", "asked": "float32", "reason": "the default"}  # eval's
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(root / "annotations" / "instances_val2017.json"))
        evaluator = COCOeval(gt, gt.loadRes(str(tmp_path / "detections_val.json")), "bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    np.testing.assert_allclose([stats[k] for k in STAT_NAMES], evaluator.stats, rtol=0, atol=1e-12)
    assert stats["AR100"] > 0  # the model finds something: the comparison is not of zeros
    detections = json.loads((tmp_path / "detections_val.json").read_text())
    assert len(detections) == 6 * 100  # top 100 per image


def test_ground_truth_as_detections_scores_ap_one(trained):
    from pycocotools.coco import COCO

    root, _ = trained
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(root / "annotations" / "instances_val2017.json"))
    detections = [
        {"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 1.0}
        for a in gt.dataset["annotations"]
    ]
    stats = coco_stats(gt, detections, verbose=False)
    assert stats["AP"] == pytest.approx(1.0) and stats["AP50"] == pytest.approx(1.0)


def test_predict_draws_and_names_bad_images(trained, tmp_path, capsys):
    root, output = trained
    image = root / "val2017" / "000000000001.png"
    args = [
        "--config",
        str(TINY),
        "--checkpoint",
        str(output / "checkpoint.safetensors"),
        "--output-dir",
        str(tmp_path),
        "--threshold",
        "0.0",
        "model.num_queries=20",  # a config override, among the inputs
    ]
    with pytest.raises(SystemExit, match=f"error: {tmp_path / 'nothing.png'}: no such image file"):
        predict_main([*args, str(image), str(tmp_path / "nothing.png")])
    (tmp_path / "broken.png").write_bytes(b"not an image")
    with pytest.raises(SystemExit, match=r"broken\.png: cannot read image"):
        predict_main([*args, str(tmp_path / "broken.png")])
    predict_main([*args, str(image)])
    records = json.loads((tmp_path / "000000000001.json").read_text())
    assert len(records) == 100 and {"label", "name", "score", "box"} <= set(records[0])
    from PIL import Image

    assert Image.open(tmp_path / "000000000001.png").size == Image.open(image).size


def test_training_writes_eval_results_and_pictures(trained):
    _, output = trained
    stats = json.loads((output / "eval_results.json").read_text())
    assert list(stats) == [*STAT_NAMES, "per_class", "ground_truth", "confusion_matrix"]
    for picture in ("predictions.png", "curves.png", "pr_curves.png", "confusion_matrix.png"):
        assert (output / picture).stat().st_size > 1000


def test_per_class_ap_is_pycocotools_on_that_category_alone(trained, tmp_path):
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    root, output = trained
    argv = ["--config", str(TINY), "--checkpoint", str(output / "checkpoint.safetensors"), "--coco-path", str(root)]
    stats = eval_script.main([*argv, "--output-dir", str(tmp_path), "model.num_queries=20"])
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(root / "annotations" / "instances_val2017.json"))
        detections = gt.loadRes(str(tmp_path / "detections_val.json"))
    assert sorted(stats["per_class"]) == sorted(c["name"] for c in gt.cats.values())
    for category in gt.getCatIds():
        with contextlib.redirect_stdout(io.StringIO()):
            alone = COCOeval(gt, detections, "bbox")
            alone.params.catIds = [category]
            alone.evaluate()
            alone.accumulate()
            alone.summarize()
        got = stats["per_class"][gt.cats[category]["name"]]
        np.testing.assert_allclose([got[k] for k in PER_CLASS_NAMES], alone.stats[:6], rtol=0, atol=1e-12)
        assert got["gt"] == len(gt.getAnnIds(catIds=[category], iscrowd=False)) > 0
    assert any(v["AP"] > 0 for v in stats["per_class"].values())


def test_the_best_checkpoint_is_the_evaluation_of_highest_ap(trained, tmp_path):
    """Its AP, evaluated again from the file, is the highest of the epochs' evaluations."""
    from deformable_detr.weights.files import read_weights

    root, output = trained
    records = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    aps = [r["eval"]["AP"] for r in records if "eval" in r]
    best = read_weights(output / "checkpoint_best.safetensors").progress
    assert len(aps) == 3 and best["best_ap"] == max(aps) and best["epoch"] == aps.index(max(aps)) + 1
    argv = [
        "--config",
        str(TINY),
        "--checkpoint",
        str(output / "checkpoint_best.safetensors"),
        "--coco-path",
        str(root),
    ]
    again = eval_script.main([*argv, "--output-dir", str(tmp_path), "model.num_queries=20"])
    assert again["AP"] == pytest.approx(max(aps), abs=1e-12)


@pytest.mark.parametrize("command", [["-m", "deformable_detr.predict"], ["eval.py"], ["train.py"]])
def test_scripts_start_with_the_blas_preloaded(command):
    """The scripts re-execute themselves once with the BLAS preloaded (where it is installed); the
    re-executed process must be the same command, `-m module` included."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, *command, "--help"], capture_output=True, text=True, cwd=root, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout


def test_eval_and_predict_take_the_config_the_checkpoint_records(trained, tmp_path):
    """No --config: the run's own (its num_queries=20 and data.path), as given to train.py."""
    root, output = trained
    checkpoint = str(output / "checkpoint.safetensors")
    given = eval_script.main(
        [
            "--config",
            str(TINY),
            "--checkpoint",
            checkpoint,
            "--output-dir",
            str(tmp_path / "a"),
            f"data.path={root}",
            "model.num_queries=20",
        ]
    )
    recorded = eval_script.main(["--checkpoint", checkpoint, "--output-dir", str(tmp_path / "b")])
    assert recorded == given
    image = str(root / "val2017" / "000000000001.png")
    predict_main(["--checkpoint", checkpoint, "--output-dir", str(tmp_path / "p"), "--threshold", "0", image])
    assert len(json.loads((tmp_path / "p" / "000000000001.json").read_text())) == 100  # top 100 of 20 x 6


def test_eval_writes_the_confusion_matrix_of_its_detections(trained, tmp_path, capsys):
    """Its counts against the files: each box of the annotations counted once (found or missed: the
    rows), each detection of detections_val.json at --threshold once (matched or not: the columns);
    the picture drawn from the JSON's counts."""
    from deformable_detr.inference.confusion import draw_confusion_matrix

    from PIL import Image

    root, output = trained
    argv = ["--config", str(TINY), "--checkpoint", str(output / "checkpoint.safetensors"), "--coco-path", str(root)]
    annotations = json.loads((root / "annotations" / "instances_val2017.json").read_text())
    names = {c["id"]: c["name"] for c in annotations["categories"]}
    ids = sorted(names)
    for threshold in ("0.3", "0.05"):
        folder = tmp_path / threshold
        stats = eval_script.main([*argv, "--output-dir", str(folder), "--threshold", threshold, "model.num_queries=20"])
        record = json.loads((folder / "eval_results.json").read_text())["confusion_matrix"]
        assert record == stats["confusion_matrix"]
        assert record["classes"] == [names[i] for i in ids] + ["background"]
        assert (record["rows"], record["iou"], record["threshold"]) == ("ground truth", 0.5, float(threshold))
        counts = np.array(record["counts"])
        boxes = [sum(a["category_id"] == i and not a.get("iscrowd") for a in annotations["annotations"]) for i in ids]
        assert counts[:-1].sum(axis=1).tolist() == boxes
        found = json.loads((folder / "detections_val.json").read_text())
        kept = [sum(d["category_id"] == i and d["score"] >= float(threshold) for d in found) for i in ids]
        assert counts[:, :-1].sum(axis=0).tolist() == kept
        drawn = np.array(Image.open(folder / "confusion_matrix.png").convert("RGB"))
        np.testing.assert_array_equal(drawn, np.array(draw_confusion_matrix(record)))
        assert f"{folder / 'confusion_matrix.png'}" in capsys.readouterr().out
    assert sum(kept) > 0 and np.trace(counts[:-1, :-1]) > 0  # at 0.05 it finds some: not a matrix of misses alone


def test_eval_without_supervision_is_the_rest_of_the_evaluation(trained, tmp_path, monkeypatch, capsys):
    import sys

    from deformable_detr.inference import confusion

    root, output = trained
    argv = ["--config", str(TINY), "--checkpoint", str(output / "checkpoint.safetensors"), "--coco-path", str(root)]
    monkeypatch.setitem(sys.modules, "supervision", None)  # as if not installed
    confusion.supervision.cache_clear()
    try:
        stats = eval_script.main([*argv, "--output-dir", str(tmp_path), "model.num_queries=20"])
    finally:
        confusion.supervision.cache_clear()
    assert list(stats) == [*STAT_NAMES, "per_class", "ground_truth", "precision"] and stats["AR100"] > 0
    assert not (tmp_path / "confusion_matrix.png").exists() and (tmp_path / "pr_curves.png").is_file()
    err = capsys.readouterr().err
    assert err.count("confusion matrix left out") == 1
    assert (
        'confusion matrix left out: the confusion matrix needs supervision, in the "confusion-matrix" extra: '
        'pip install -e ".[confusion-matrix]"\n'
    ) in err
