"""What a split's boxes are to training and to its evaluation, counted once per dataset.

Training drops crowd boxes and boxes degenerate once clipped to the image (`CocoDetection.load`, whose
rule `dropped_reason` states). The evaluation's ground truth is the split's annotations without the
boxes training drops: otherwise a box the model was never shown stays a positive it cannot find
(a detector finding every kept box scored AP 0.95, not 1). Crowd boxes stay in it, as crowd (COCO AP
ignores them); kept boxes stay exactly as the file records them (not clipped: the authors evaluate
COCO against the file's boxes), and where nothing is dropped it is `dataset.coco` itself, so COCO AP
is what pycocotools gives on the file.

    counts = box_counts(dataset)               # boxes kept, crowd, dropped by reason
    coco_gt = evaluation_ground_truth(dataset)  # a pycocotools COCO for COCOeval
    record = split_summary(dataset, "train")    # what train.py prints and logs of a split"""

import math
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field

from .coco import dropped_reason, image_size
from .images import UnreadableImageError
from .in_memory import coco_from_dict

DROP_REASONS = ("zero size", "outside the image")  # dropped_reason's answers, in the order reported
_COUNTS = "_box_counts"  # the attributes the dataset caches them in: evaluated every few epochs
_GROUND_TRUTH = "_evaluation_ground_truth"


@dataclass
class BoxCounts:
    """A split's annotations as training sees them."""

    boxes: int = 0  # kept: training's targets, the evaluation's positives
    crowd: int = 0  # iscrowd (VOC: difficult): evaluated as crowd, not trained on
    dropped: Counter = field(default_factory=Counter)  # reason -> boxes
    dropped_at: set = field(default_factory=set)  # their places in the annotation list
    first_dropped: dict = field(default_factory=dict)  # reason -> where the first such box is (for messages)
    per_class: Counter = field(default_factory=Counter)  # category id -> kept boxes
    images_per_class: dict = field(default_factory=dict)  # category id -> ids of the images with a kept box

    def as_record(self) -> dict:
        """{"boxes", "crowd", "dropped": {reason: count}}, every reason named (0 where none)."""
        return {"boxes": self.boxes, "crowd": self.crowd, "dropped": {r: self.dropped[r] for r in DROP_REASONS}}


def image_bounds(dataset, info: dict) -> tuple[float, float]:
    """`coco.image_size` of the image; unbounded where it cannot be had (an unreadable image: only a box
    of zero size is known to be dropped then)."""
    try:
        return image_size(dataset.image_dir, info, getattr(dataset, "exif_orientation", "auto"))
    except (FileNotFoundError, UnreadableImageError):
        return math.inf, math.inf


def box_counts(dataset) -> BoxCounts:
    """Boxes kept, crowd, and dropped by reason, over the annotations of `dataset.coco`'s file (its
    list: the boxes training reads, `imgToAnns`) on the split's images; computed once per dataset."""
    cached = getattr(dataset, _COUNTS, None)
    if cached is not None:
        return cached
    counts, sizes = BoxCounts(), {}
    for place, annotation in enumerate(dataset.coco.dataset.get("annotations", [])):
        info = _image_of(dataset, annotation)
        if info is None:
            continue  # malformed (a problem the readers list), or of an image the split does not list
        if annotation.get("iscrowd", 0):
            counts.crowd += 1
            continue
        if info["id"] not in sizes:
            sizes[info["id"]] = image_bounds(dataset, info)
        reason = dropped_reason(annotation["bbox"], *sizes[info["id"]])
        if reason is None:
            counts.boxes += 1
            counts.per_class[annotation["category_id"]] += 1
            counts.images_per_class.setdefault(annotation["category_id"], set()).add(info["id"])
        else:
            counts.dropped[reason] += 1
            counts.dropped_at.add(place)
            where = annotation.get("where") or f"{dataset.annotation_file}: annotation id {annotation.get('id')!r}"
            counts.first_dropped.setdefault(reason, where)
    setattr(dataset, _COUNTS, counts)
    return counts


def _image_of(dataset, annotation) -> dict | None:
    """The listed image of a well-formed annotation (an integer category, four box values), else None:
    what the check command reads with every problem kept may hold any JSON."""
    if not isinstance(annotation, dict):
        return None
    box, image_id = annotation.get("bbox"), annotation.get("image_id")
    if not (isinstance(annotation.get("category_id"), int) and isinstance(box, list) and len(box) == 4):
        return None
    return dataset.coco.imgs.get(image_id) if isinstance(image_id, Hashable) else None


def evaluation_ground_truth(dataset):
    """`dataset.coco` without the boxes training drops (a new pycocotools COCO), or `dataset.coco`
    itself where it drops none; computed once per dataset."""
    cached = getattr(dataset, _GROUND_TRUTH, None)
    if cached is not None:
        return cached
    dropped = box_counts(dataset).dropped_at
    coco_gt = dataset.coco
    if dropped:
        data = coco_gt.dataset
        kept = [a for place, a in enumerate(data["annotations"]) if place not in dropped]
        coco_gt = coco_from_dict({**data, "annotations": kept})
    setattr(dataset, _GROUND_TRUTH, coco_gt)
    return coco_gt


def dropped_line(counts: dict) -> str | None:
    """One line where the evaluation's ground truth left boxes out (`BoxCounts.as_record`), else None."""
    dropped = {reason: n for reason, n in counts["dropped"].items() if n}
    if not dropped:
        return None
    listed = ", ".join(f"{n} {reason}" for reason, n in dropped.items())
    return (
        f"ground truth: {sum(dropped.values())} box(es) training drops left out of the evaluation ({listed}); "
        f"{counts['boxes']} evaluated, {counts['crowd']} crowd"
    )


def split_summary(dataset, split: str) -> dict:
    """What a split trains (or is evaluated) on: images, boxes (training's targets), classes, crowd
    boxes, boxes dropped by reason, and the readers' notes (images left out) and problems."""
    return {
        "split": split,
        "images": len(dataset),
        **box_counts(dataset).as_record(),
        "classes": len(dataset.class_names()),
        "notes": list(getattr(dataset, "notes", [])),
        "problems": list(getattr(dataset, "problems", [])),
    }


def summary_lines(summary: dict) -> list[str]:
    """`split_summary` as printed: one line, then a line per note and problem."""
    dropped = ", ".join(f"{n} {reason}" for reason, n in summary["dropped"].items() if n) or "none"
    head = (
        f"{summary['split']}: {summary['images']} images, {summary['boxes']} boxes, {summary['classes']} classes; "
        f"{summary['crowd']} crowd (evaluated, not trained on); dropped: {dropped}"
    )
    notes = [f"{summary['split']}: note: {note}" for note in summary["notes"]]
    return [head, *notes, *(f"{summary['split']}: problem: {p}" for p in summary["problems"])]
