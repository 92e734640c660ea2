"""The evaluation's ground truth is what training keeps: a detector that finds every box training is
shown scores pycocotools' AP 1.0 against it (and not against the file's ground truth, with the boxes
training drops), with what was left out counted in the evaluation's stats."""

import json

from deformable_detr.config import load_config
from deformable_detr.data import build_dataset
from deformable_detr.data.ground_truth import box_counts, dropped_line, evaluation_ground_truth, split_summary
from deformable_detr.inference.evaluation import STAT_NAMES, score_detections

from PIL import Image
from test_evaluate import coco_stats

# (image id, category, [x, y, w, h], iscrowd) on three 64 x 48 images; the third's size is not recorded
ANNOTATIONS = [
    (1, 1, [4, 4, 20, 16], 0),
    (1, 2, [30, 10, 20, 30], 0),
    (1, 1, [10, 10, 0, 12], 0),  # zero width: dropped
    (1, 2, [0, 0, 40, 40], 1),  # crowd: evaluated as crowd, not trained on
    (2, 1, [50, 30, 30, 30], 0),  # partly outside: kept (clipped in training), evaluated as recorded
    (2, 2, [70, 5, 10, 10], 0),  # right of the 64-wide image: dropped
    (3, 1, [8, 8, 16, 16], 0),
    (3, 2, [5, 60, 10, 10], 0),  # below the 48-high image (its header's size): dropped
]
KEPT = [0, 1, 4, 6]
COUNTS = {"boxes": 4, "crowd": 1, "dropped": {"zero size": 1, "outside the image": 2}}


def write_coco(root, annotations=ANNOTATIONS):
    """root/val2017/*.png (64 x 48) and root/annotations/instances_val2017.json, written by hand."""
    (root / "val2017").mkdir(parents=True)
    (root / "annotations").mkdir()
    images = []
    for image_id in (1, 2, 3):
        name = f"{image_id:012d}.png"
        Image.new("RGB", (64, 48), (90, 120, 150)).save(root / "val2017" / name)
        recorded = {"width": 64, "height": 48} if image_id < 3 else {}
        images.append({"id": image_id, "file_name": name, **recorded})
    records = [
        {
            "id": i + 1,
            "image_id": image,
            "category_id": category,
            "bbox": box,
            "area": box[2] * box[3],
            "iscrowd": crowd,
        }
        for i, (image, category, box, crowd) in enumerate(annotations)
    ]
    categories = [{"id": 1, "name": "circle"}, {"id": 2, "name": "square"}]
    data = {"images": images, "annotations": records, "categories": categories}
    (root / "annotations" / "instances_val2017.json").write_text(json.dumps(data))
    return root


def found_perfectly(annotations, kept) -> list:
    """Detections: each of the `kept` annotations' boxes exactly, score 1."""
    return [
        {"image_id": image, "category_id": category, "bbox": box, "score": 1.0}
        for image, category, box, _ in (annotations[i] for i in kept)
    ]


def coco_set(root):
    return build_dataset("val", load_config(None, [f"data.path={root}"]).data)


def test_every_kept_box_found_scores_ap_one_against_the_kept_ground_truth(tmp_path):
    dataset = coco_set(write_coco(tmp_path))
    detections = found_perfectly(ANNOTATIONS, KEPT)
    on_file = coco_stats(dataset.coco, detections, verbose=False)
    assert on_file["AP"] < 0.9 and on_file["AR100"] < 0.9  # the dropped boxes count as missed there
    kept = coco_stats(evaluation_ground_truth(dataset), detections, verbose=False)
    assert kept["AP"] == 1.0 and kept["AP50"] == 1.0 and kept["AR100"] == 1.0
    assert {name: v["gt"] for name, v in kept["per_class"].items()} == {"circle": 3, "square": 1}
    assert evaluation_ground_truth(dataset) is evaluation_ground_truth(dataset)  # built once per dataset
    kept_boxes = [a["bbox"] for a in evaluation_ground_truth(dataset).dataset["annotations"]]
    assert kept_boxes == [ANNOTATIONS[i][2] for i in (0, 1, 3, 4, 6)]  # as recorded (the crowd box kept too)


def test_the_evaluation_counts_what_it_left_out(tmp_path, capsys):
    dataset = coco_set(write_coco(tmp_path))
    evaluation = score_detections(dataset, found_perfectly(ANNOTATIONS, KEPT), verbose=True)
    assert list(evaluation.stats) == [*STAT_NAMES, "per_class", "ground_truth"]
    assert evaluation.stats["ground_truth"] == COUNTS and evaluation.stats["AP"] == 1.0
    line = "ground truth: 3 box(es) training drops left out of the evaluation (1 zero size, 2 outside the image)"
    assert f"{line}; 4 evaluated, 1 crowd" in capsys.readouterr().out
    summary = split_summary(dataset, "val")
    assert summary == {"split": "val", "images": 3, **COUNTS, "classes": 2, "notes": [], "problems": []}


def test_where_nothing_is_dropped_the_ground_truth_is_the_files(tmp_path):
    annotations = [ANNOTATIONS[i] for i in (0, 1, 3, 4, 6)]
    dataset = coco_set(write_coco(tmp_path, annotations))
    assert evaluation_ground_truth(dataset) is dataset.coco
    assert box_counts(dataset).as_record() == {
        "boxes": 4,
        "crowd": 1,
        "dropped": {"zero size": 0, "outside the image": 0},
    }
    assert dropped_line(box_counts(dataset).as_record()) is None
    evaluation = score_detections(dataset, found_perfectly(annotations, [0, 1, 3, 4]))
    assert evaluation.stats["AP"] == 1.0


def write_yolo(root):
    """A YOLO val split by hand: two 64 x 48 images; labels normalised `class cx cy w h`."""
    (root / "images" / "val").mkdir(parents=True)
    (root / "labels" / "val").mkdir(parents=True)
    labels = {
        "a": ["0 0.25 0.25 0.2 0.3", "1 0.5 0.5 0.0 0.2"],  # the second of zero width
        "b": ["1 0.6 0.6 0.3 0.3", "0 1.5 0.5 0.2 0.2"],  # the second right of the image
    }
    for stem, lines in labels.items():
        Image.new("RGB", (64, 48), (40, 80, 120)).save(root / "images" / "val" / f"{stem}.png")
        (root / "labels" / "val" / f"{stem}.txt").write_text("\n".join(lines) + "\n")
    (root / "data.yaml").write_text("path: .\ntrain: images/val\nval: images/val\nnames: [circle, square]\n")
    return root


def test_a_yolo_set_is_evaluated_on_the_boxes_it_trains_on(tmp_path):
    dataset = build_dataset("val", load_config(None, ["data.dataset=yolo", f"data.path={write_yolo(tmp_path)}"]).data)
    on_file = dataset.coco.dataset["annotations"]
    detections = [
        {"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 1.0}
        for a in (on_file[0], on_file[2])
    ]
    assert coco_stats(dataset.coco, detections, verbose=False)["AP"] < 0.9
    evaluation = score_detections(dataset, detections)
    assert evaluation.stats["AP"] == 1.0 and evaluation.stats["AR100"] == 1.0
    assert evaluation.stats["ground_truth"] == {
        "boxes": 2,
        "crowd": 0,
        "dropped": {"zero size": 1, "outside the image": 1},
    }
