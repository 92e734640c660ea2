"""The evaluation's confusion matrix (inference/confusion.py, by supervision) on ground truth and
detections built by hand, whose matrix is known cell by cell: a correct detection, a wrong class, a
missed box, a false positive, one below the score threshold and one at it, one at IoU below 0.5 and
one at exactly 0.5 (not above it: no match), a duplicate, a right-class match preferred to a
wrong-class one of higher IoU, a detection over a crowd region and one of a class the set does not
have (both left out, as COCO AP leaves them). Without supervision: one line naming the extra."""

import sys

from deformable_detr.data.in_memory import coco_from_dict
from deformable_detr.inference import confusion
from deformable_detr.inference.confusion import confusion_matrix, draw_confusion_matrix

import numpy as np
import pytest

pytest.importorskip("supervision", reason="the confusion matrix is supervision's: pip install -e '.[confusion-matrix]'")

# Category ids with a gap (7): the matrix is in id order, by name
CATEGORIES = [{"id": 1, "name": "circle"}, {"id": 2, "name": "square"}, {"id": 3, "name": "triangle"}]
CATEGORIES += [{"id": 7, "name": "star"}]
CIRCLE, SQUARE, TRIANGLE, STAR = 1, 2, 3, 7
BOXES = [  # (image, category, [x, y, width, height], crowd)
    (1, CIRCLE, [10, 10, 20, 20], 0),  # G1: found
    (1, SQUARE, [50, 10, 20, 20], 0),  # G2: found as a circle
    (1, TRIANGLE, [10, 50, 20, 20], 0),  # G3: missed
    (2, CIRCLE, [0, 0, 20, 20], 0),  # G4: its detection scores below the threshold
    (2, SQUARE, [40, 0, 20, 20], 0),  # G5: its detection at IoU 1/3
    (2, STAR, [0, 40, 20, 20], 0),  # G6: its detection at IoU 0.5 exactly
    (2, TRIANGLE, [40, 40, 20, 20], 0),  # G7: its detection scores the threshold exactly
    (3, CIRCLE, [0, 0, 60, 60], 1),  # a crowd region
    (3, CIRCLE, [70, 0, 20, 20], 0),  # G8: found twice
    (5, SQUARE, [0, 0, 20, 20], 0),  # G9: a square detection and a triangle one of higher IoU
]
DETECTIONS = [  # (image, category, box, score)
    (1, CIRCLE, [11, 11, 20, 20], 0.9),  # G1, IoU 361/439
    (1, CIRCLE, [50, 10, 20, 20], 0.8),  # G2, the wrong class
    (1, SQUARE, [70, 70, 10, 10], 0.7),  # no box there
    (2, CIRCLE, [0, 0, 20, 20], 0.2),  # G4, below 0.3
    (2, SQUARE, [50, 0, 20, 20], 0.9),  # G5, IoU 200/600
    (2, STAR, [0, 40, 20, 10], 0.95),  # G6, IoU 200/400
    (2, TRIANGLE, [40, 40, 20, 20], 0.3),  # G7, at the threshold: counted
    (3, CIRCLE, [10, 10, 20, 20], 0.9),  # inside the crowd region: left out
    (3, 9, [70, 70, 10, 10], 0.9),  # category 9: not the set's, left out
    (3, CIRCLE, [70, 0, 20, 20], 0.9),  # G8
    (3, CIRCLE, [71, 0, 20, 20], 0.85),  # G8 again: a false positive
    (5, TRIANGLE, [0, 0, 20, 20], 0.9),  # G9, IoU 1, the wrong class
    (5, SQUARE, [1, 1, 20, 20], 0.5),  # G9, IoU 361/439, the right class: this one matches
]
# rows: the ground truth (circle, square, triangle, star, background); columns: predicted, the same order
EXPECTED = [
    [2, 0, 0, 0, 1],  # G1, G8 found; G4 missed (its detection below the threshold)
    [1, 1, 0, 0, 1],  # G2 as a circle; G9; G5 missed (IoU 1/3)
    [0, 0, 1, 0, 1],  # G7; G3 missed
    [0, 0, 0, 0, 1],  # G6 missed (IoU 0.5)
    [1, 2, 1, 1, 0],  # G8's duplicate; the square on nothing and G5's; G9's triangle; G6's star
]


def ground_truth():
    images = [{"id": i, "file_name": f"{i}.png", "width": 100, "height": 100} for i in (1, 2, 3, 4, 5)]
    annotations = [
        {"id": n, "image_id": image, "category_id": category, "bbox": box, "area": box[2] * box[3], "iscrowd": crowd}
        for n, (image, category, box, crowd) in enumerate(BOXES, 1)
    ]
    return coco_from_dict({"images": images, "annotations": annotations, "categories": CATEGORIES})


def detections():
    return [
        {"image_id": image, "category_id": category, "bbox": box, "score": score}
        for image, category, box, score in DETECTIONS
    ]


def test_each_count_is_the_one_built_in():
    record = confusion_matrix(ground_truth(), detections())
    assert record == {
        "classes": ["circle", "square", "triangle", "star", "background"],
        "rows": "ground truth",
        "columns": "predicted",
        "iou": 0.5,
        "threshold": 0.3,
        "counts": EXPECTED,
    }
    counts = np.array(record["counts"])
    boxes = [sum(1 for _, c, _, crowd in BOXES if c == category and not crowd) for category in (1, 2, 3, 7)]
    assert counts[:-1].sum(axis=1).tolist() == boxes  # each box once: found or missed


def test_the_threshold_decides_which_detections_count():
    counts = np.array(confusion_matrix(ground_truth(), detections(), threshold=0.1)["counts"])
    expected = np.array(EXPECTED)
    expected[0, 0], expected[0, 4] = 3, 0  # G4's detection, at 0.2, now finds it
    np.testing.assert_array_equal(counts, expected)
    counts = np.array(confusion_matrix(ground_truth(), detections(), threshold=0.31)["counts"])
    expected = np.array(EXPECTED)
    expected[2, 2], expected[2, 4] = 0, 2  # G7's detection, at 0.3, no longer counts
    np.testing.assert_array_equal(counts, expected)


def test_the_picture_is_drawn(tmp_path):
    record = confusion_matrix(ground_truth(), detections())
    picture = draw_confusion_matrix(record, tmp_path / "confusion_matrix.png")
    from PIL import Image

    written = Image.open(tmp_path / "confusion_matrix.png")
    assert written.size == picture.size and written.size[0] > written.size[1] > 300
    np.testing.assert_array_equal(np.array(written.convert("RGB")), np.array(picture))
    assert len(np.unique(np.array(picture).reshape(-1, 3), axis=0)) > 10  # drawn, not blank


def test_without_supervision_one_line_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "supervision", None)  # as if not installed
    confusion.supervision.cache_clear()
    try:
        assert confusion_matrix(ground_truth(), detections()) is None
        assert confusion_matrix(ground_truth(), detections()) is None
    finally:
        confusion.supervision.cache_clear()
    assert capsys.readouterr().err == (
        'confusion matrix left out: the confusion matrix needs supervision, in the "confusion-matrix" extra: '
        'pip install -e ".[confusion-matrix]"\n'
    )
