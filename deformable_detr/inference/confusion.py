"""The confusion matrix of an evaluation (eval_results.json's "confusion_matrix", confusion_matrix.png),
by supervision's `sv.ConfusionMatrix` (the `confusion-matrix` extra):

    {"classes": [the dataset's category names in id order..., "background"],
     "rows": "ground truth", "columns": "predicted", "iou": 0.5, "threshold": 0.3,
     "counts": [[...], ...]}

counts[i][j]: the ground-truth boxes of classes[i] matched to a detection of classes[j]; the last
column ("background" predicted): the boxes no detection matched (missed); the last row ("background"
ground truth): the detections matched to no box (false positives, by their predicted class). Only
detections scoring at least `threshold` (default the pictures', predictions.png's) take part; a
detection and a box match where their IoU is above `iou` (0.5), greedily: pairs of the same class
first, then by IoU, each box and detection once (supervision's rule). The ground truth is the one COCO
AP is computed on (data/ground_truth.py: without the boxes training drops); crowd regions are no
boxes to find, and a detection lying over one (more than `iou` of its area) is left out, as COCO AP
leaves it out; so are detections of a class the dataset does not have.

supervision's rather than faster-coco-eval's (`PreviewResults.compute_confusion_matrix`): that one
needs a second, class-agnostic COCOeval run over the detections, returns categories x (categories + 2)
with false positives and misses as two columns (no background row), and draws with plotly; supervision's
is the square matrix with a background row and column, and draws it with matplotlib (its dependency)."""

import functools
import sys
import warnings
from collections import defaultdict

import numpy as np
from PIL import Image

from ..errors import MissingExtra, optional

IOU = 0.5  # a detection and a box match above this IoU
THRESHOLD = 0.3  # the score a detection needs to be counted: the pictures' (predictions.png), supervision's default
EXTRA, NEEDED_FOR = "confusion-matrix", "the confusion matrix"  # `optional`'s words for supervision


@functools.cache
def supervision():
    """The supervision package, or None: then `optional`'s line (once a process), the matrix left out."""
    try:
        return optional("supervision", EXTRA, NEEDED_FOR)
    except MissingExtra as missing:
        print(f"confusion matrix left out: {missing}", file=sys.stderr)
        return None


def confusion_matrix(coco_gt, detections: list, threshold: float = THRESHOLD, iou: float = IOU) -> dict | None:
    """The record of the module's docstring for `detections` (COCO's results format, the dataset's
    category ids) against `coco_gt` (a pycocotools COCO), or None without supervision."""
    sv = supervision()
    if sv is None:
        return None
    from pycocotools import mask as coco_mask

    categories = sorted(coco_gt.getCatIds())
    index = {category: i for i, category in enumerate(categories)}
    found = defaultdict(list)
    for d in detections:
        if d["category_id"] in index:
            found[d["image_id"]].append(d)
    targets, predictions = [], []
    for image_id in sorted(coco_gt.getImgIds()):
        annotations = coco_gt.loadAnns(coco_gt.getAnnIds(imgIds=[image_id]))
        boxes = [a for a in annotations if not a.get("iscrowd", 0)]
        crowd = [a["bbox"] for a in annotations if a.get("iscrowd", 0)]
        ours = found.get(image_id, [])
        if crowd and ours:  # pycocotools' crowd IoU: the intersection over the detection's area
            over = coco_mask.iou([d["bbox"] for d in ours], crowd, [1] * len(crowd)).max(axis=1)
            ours = [d for d, covered in zip(ours, over, strict=True) if covered <= iou]
        targets.append(np.array([[*corners(a["bbox"]), index[a["category_id"]]] for a in boxes], float).reshape(-1, 5))
        rows = [[*corners(d["bbox"]), index[d["category_id"]], d["score"]] for d in ours]
        predictions.append(np.array(rows, float).reshape(-1, 6))
    names = [coco_gt.cats[category]["name"] for category in categories]
    matrix = sv.ConfusionMatrix.from_tensors(predictions, targets, names, conf_threshold=threshold, iou_threshold=iou)
    return {
        "classes": [*names, "background"],
        "rows": "ground truth",
        "columns": "predicted",
        "iou": iou,
        "threshold": threshold,
        "counts": matrix.matrix.astype(int).tolist(),
    }


def corners(box) -> list:
    """COCO's x, y, width, height -> x0, y0, x1, y1."""
    x, y, width, height = box
    return [x, y, x + width, y + height]


def draw_confusion_matrix(record: dict, path=None) -> Image.Image:
    """The counts of `record` (`confusion_matrix`'s) drawn by supervision (rows: the ground truth, its
    last "FP": false positives; columns: predicted, the last "FN": missed boxes); saved to `path` where
    given, returned. A record is made where supervision is: without it, `optional`'s MissingExtra."""
    sv = optional("supervision", EXTRA, NEEDED_FOR)
    from matplotlib import pyplot

    names = record["classes"][:-1]
    matrix = sv.ConfusionMatrix(np.array(record["counts"]), names, record["threshold"], record["iou"])
    side = min(max(5.0, 0.4 * len(record["classes"]) + 3.0), 30.0)  # inches: room for the counts and names
    title = f"IoU > {record['iou']:g}, score >= {record['threshold']:g}"
    with warnings.catch_warnings():  # all zeros (no box, no detection): its colour scale warns of an all-NaN slice
        warnings.simplefilter("ignore", RuntimeWarning)
        figure = matrix.plot(title=title, fig_size=(side * 1.2, side))
    try:  # its pixels as drawn, at 100 dpi on white: no PNG encoded to be decoded again
        figure.set_dpi(100)
        figure.set_facecolor("white")
        figure.canvas.draw()
        image = Image.fromarray(np.asarray(figure.canvas.buffer_rgba())).convert("RGB")
    finally:
        pyplot.close(figure)  # pyplot keeps every figure it made until closed
    if path is not None:
        image.save(path)
    return image
