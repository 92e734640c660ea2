"""train.py says what it trains on: each split's images, boxes, classes and what was dropped, printed
and in log.jsonl (a resumed run's too), and each bad image skipped as a log record naming it."""

import json
import re

from deformable_detr.config import load_config
from deformable_detr.data import DataLoader, build_dataset
from deformable_detr.data.shapes import generate

import pytest
from test_train import TINY

import train

ADDED = [  # (bbox, iscrowd) added to the first train image: what training leaves out, one of each kind
    ([2, 2, 30, 30], 1),
    ([10, 10, 0, 8], 0),  # zero width
    ([70, 10, 8, 8], 0),  # right of the 64-wide image
]


def add_boxes_training_drops(root) -> dict:
    """The train split's annotation file with ADDED; -> the file as written."""
    path = root / "annotations" / "instances_train2017.json"
    data = json.loads(path.read_text())
    image = data["images"][0]["id"]
    for box, crowd in ADDED:
        data["annotations"].append(
            {
                "id": len(data["annotations"]) + 1000,
                "image_id": image,
                "category_id": data["categories"][0]["id"],
                "bbox": box,
                "area": box[2] * box[3],
                "iscrowd": crowd,
            }
        )
    path.write_text(json.dumps(data))
    return data


def records(output) -> list[dict]:
    return [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]


def test_the_splits_and_each_skipped_image_are_logged_on_a_resumed_run_too(tmp_path, capsys):
    root = generate(tmp_path / "shapes", 4, 2, seed=3, height=(64, 64), width=(64, 64), max_size=40)
    train_file = add_boxes_training_drops(root)
    val_file = json.loads((root / "annotations" / "instances_val2017.json").read_text())
    overrides = [f"data.path={root}", "data.skip_bad_images=true"]
    cfg = load_config(TINY, overrides)
    dataset = build_dataset("train", cfg.data)
    second_step = DataLoader(dataset, cfg.schedule.batch_size, seed=cfg.seed)._steps(0)[1]
    index = second_step[0][0]  # its first image: unreadable, skipped in the resumed run's step
    image_id = dataset.ids[index]
    bad = dataset.image_dir / dataset.coco.imgs[image_id]["file_name"]
    bad.write_bytes(b"not a PNG")

    output = tmp_path / "run"
    argv = ["--config", str(TINY), "--output-dir", str(output), *overrides]
    train.main([*argv, "train.max_steps=1"])
    with pytest.warns(UserWarning, match=f"skipping {re.escape(str(bad))}: cannot read image"):
        train.main([*argv, "train.max_steps=2", "--resume"])

    generated = len(train_file["annotations"]) - len(ADDED)  # shapes inside their images: all kept
    train_summary = {
        "split": "train",
        "images": 4,
        "boxes": generated,
        "crowd": 1,
        "dropped": {"zero size": 1, "outside the image": 1},
        "classes": len(train_file["categories"]),
        "notes": [],
        "problems": [],
    }
    val_counts = {
        "boxes": len(val_file["annotations"]),
        "crowd": 0,
        "dropped": {"zero size": 0, "outside the image": 0},
    }
    classes = len(val_file["categories"])
    val_summary = {"split": "val", "images": 2, **val_counts, "classes": classes, "notes": [], "problems": []}
    logged = records(output)
    assert [r for r in logged if "split" in r] == [train_summary, val_summary] * 2  # each start, before its steps
    assert [r["global_step"] for r in logged if "grad_norm" in r] == [1, 2]
    [skipped] = [r for r in logged if "skipped_image" in r]
    assert skipped["skipped_image"].startswith(f"{bad}: cannot read image")
    assert skipped["skipped_image"].endswith(f"(image id {image_id})")
    assert (skipped["epoch"], skipped["global_step"]) == (0, 2)
    printed = capsys.readouterr().out
    dropped = "1 crowd (evaluated, not trained on); dropped: 1 zero size, 1 outside the image"
    assert f"train: 4 images, {generated} boxes, {classes} classes; {dropped}" in printed
    assert json.loads((output / "eval_results.json").read_text())["ground_truth"] == val_counts
