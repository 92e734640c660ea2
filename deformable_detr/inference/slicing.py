"""Sliced inference for small objects: the model on overlapping slices of an image at their own resolution,
the detections moved into the image's pixels and merged (`Detector.predict(..., slice=(W, H), overlap=0.2)`,
`predict --slice W,H [--overlap 0.2]`, the server's `slice` / `overlap`; docs/slicing.md).

A model resizes an image to its `data.val_size` (a 3000 x 2000 photo to a few hundred pixels), where a
20-pixel object becomes one or two pixels. Slices of about the size the model was trained at keep every
object at its own size; their overlap, at least the largest object, puts each object whole in some slice.

Built on supervision's `InferenceSlicer` (the `slice` extra): it lays the slices out (a slice every
size - overlap pixels, the last of a row or column moved back to end at the image's edge, so all are of
one size and batch; with no overlap the last is cut short there instead), calls the model on `batch_size`
slices at a time, moves each slice's boxes by its offset and merges them. Chosen over SAHI: supervision
is already here with `trackers` (the tracking feature's dependency), and its slicer takes a plain function
from slices to detections; SAHI 0.12 wants the model wrapped in its own `DetectionModel` subclass, and
brings OpenCV, Shapely, fire and click besides (its `Requires-Dist`), for the same slicing and merges.

The merge: supervision's non-max suppression, per class, at IoU 0.5 (`MERGE`), on the detections at or
above the threshold. Suppression, not non-max merging (NMM, which replaces a group by the union of its
boxes): every object is whole in some slice, so the best-scoring box of a group is already a whole box,
where a union grows by what a neighbour's half-box adds; and suppression only drops detections, so a
detection kept at one threshold is kept, unchanged, at any lower one (NMM's boxes depend on what
scored below). Per class: Deformable DETR gives a query's box under more than one class, each pair with
its own score (the config's evaluation.top_k best over queries x classes: 100, DINO's 300); suppression
across classes would take those away from the slices' own answers. bench/slicing.py measured them on the
small shapes set (bench/README.md#sliced-inference): AP 0.760 this way, the same across classes (with a
third fewer detections), 0.758 with IoS as the overlap, 0.666 / 0.689 merging (NMM, IoU / IoS), 0.632 with
no merge.

Boxes are clipped to their slice before the merge: the model saw nothing beyond it (and supervision warns
of boxes outside a slice, its sign of a callback run on the whole image). A slice larger than the image
on a side is cut to the image on that side: an image within one slice is one forward on the whole image,
the detections those of `predict` without slicing, clipped to the image. Each `Detections.queries`
entry is the decoder query of the slice's forward that found it."""

import re

import numpy as np
from PIL import Image

from ..errors import DECIMAL, UsageError, optional, quoted

OVERLAP = 0.2  # of the slice's width and height
# supervision's overlap filter, its metric, the IoU above which a lower-scoring box goes, class-agnostic or not
MERGE = {"filter": "non_max_suppression", "metric": "iou", "iou": 0.5, "class_agnostic": False}
SIZE_TEXT = re.compile(r"[0-9]{1,6},[0-9]{1,6}")  # W,H: ASCII digits alone (str.isdigit takes '²')


def supervision():
    """supervision, or a CommandError naming the extra that installs it."""
    return optional("supervision", "slice", "slicing")


def check_slice(
    size, overlap: float, name: str = "slice", overlap_name: str = "overlap"
) -> tuple[tuple[int, int], float]:
    """(width, height) of a slice in pixels and the overlap as a fraction of it, checked: a UsageError (a
    ValueError) naming `name` or `overlap_name` (the command's --slice, the server's query key) otherwise."""
    try:
        width, height = (int(v) if float(v) == int(v) else None for v in size)
    except (TypeError, ValueError, OverflowError):
        width = height = None
    if width is None or height is None or width < 1 or height < 1:
        raise UsageError(
            f"{name} {_shown(size)}: expected W,H, two whole numbers of pixels of at least 1, such as 256,256"
        )
    if isinstance(overlap, bool) or not isinstance(overlap, (int, float, np.floating)) or not 0 <= overlap < 1:
        raise UsageError(
            f"{overlap_name} {overlap!r}: expected a fraction of the slice from 0 up to (not including) 1, such as 0.2"
        )
    return (width, height), float(overlap)


def parse_slice(size: str | None, overlap: str | None, names=("slice", "overlap")) -> tuple | None:
    """The slice parameters as a command line or a query string gives them, text: `size` "W,H" (ASCII
    digits), `overlap` a decimal ("0.2", ".2"; None: OVERLAP) -> check_slice's ((W, H), overlap), or
    None where no slice is asked. A UsageError naming `names` (the command's --slice / --overlap, the
    server's keys) for a malformed value or an overlap without a slice; a MissingExtra where
    supervision (the `slice` extra) is not installed: both before any work. The one parser of both."""
    size_name, overlap_name = names
    if size is None:
        if overlap is not None:
            raise UsageError(f"{overlap_name} {quoted(overlap)}: the overlap of slices, with {size_name} W,H")
        return None
    if not SIZE_TEXT.fullmatch(size):
        raise UsageError(f"{size_name} {quoted(size)}: expected W,H, two whole numbers of pixels, such as 256,256")
    if overlap is not None and not DECIMAL.fullmatch(overlap):
        raise UsageError(f"{overlap_name} {quoted(overlap)}: expected a decimal from 0 up to (not including) 1: 0.2")
    width, height = (int(v) for v in size.split(","))
    checked = check_slice((width, height), OVERLAP if overlap is None else float(overlap), size_name, overlap_name)
    supervision()
    return checked


def overlap_pixels(size: tuple[int, int], overlap: float) -> tuple[int, int]:
    """The overlap in pixels, rounded down: below the slice's size for any overlap under 1."""
    return int(size[0] * overlap), int(size[1] * overlap)


def _axis(length: int, side: int, overlap_px: int) -> tuple[range, list[int]]:
    """Where slices start on one axis, as supervision's InferenceSlicer lays them out: a start every
    side - overlap_px pixels (a range), then one more, moved back to end at the image's edge; with no
    overlap, none more (the range's last slice is cut short at the edge instead); an image within one
    slice: one slice from 0."""
    if length <= side:
        return range(1), []
    stride = side - overlap_px
    if stride == side:
        return range(0, length, stride), []
    return range(0, length - side, stride), [length - side]


def _axes(image_size: tuple[int, int], size: tuple[int, int], overlap: float) -> tuple[tuple, tuple]:
    """`_axis` across (x) and down (y) for `size` slices overlapping by `overlap` on an `image_size` image."""
    (width, height), (overlap_w, overlap_h) = image_size, overlap_pixels(size, overlap)
    return _axis(width, size[0], overlap_w), _axis(height, size[1], overlap_h)


def slice_boxes(image_size: tuple[int, int], size: tuple[int, int], overlap: float) -> list[tuple[int, int, int, int]]:
    """The slices `sliced_detect` runs on an image of `image_size` (W, H): (left, top, right, bottom)
    in pixels, row by row, each cut to the image (supervision's layout: `_axis`)."""
    width, height = image_size
    lefts, tops = ([*regular, *last] for regular, last in _axes(image_size, size, overlap))
    return [(x, y, min(x + size[0], width), min(y + size[1], height)) for y in tops for x in lefts]


def slice_count(image_size: tuple[int, int], size: tuple[int, int], overlap: float) -> int:
    """len(slice_boxes(...)), counted without making them, so that a server can refuse a request before any
    work (a 1 x 1 slice of a 3000 x 2000 image: 6 million)."""
    across, down = (len(regular) + len(last) for regular, last in _axes(image_size, size, overlap))
    return across * down


def sliced_detect(
    detector,
    image: Image.Image,
    size: tuple[int, int],
    overlap: float,
    threshold: float,
    batch_size: int = 1,
    merge: dict = MERGE,
) -> dict:
    """`image`'s detections at or above `threshold` from `size` (W, H) slices overlapping by `overlap`,
    `batch_size` slices a forward (slices of one size: one forward each batch), merged as `merge` says
    -> `Detector.detect`'s dict (boxes, scores, labels, queries; numpy) in the image's pixels, best first."""
    sv = supervision()

    def batch(tiles: list) -> list:
        found = detector.detect([Image.fromarray(np.ascontiguousarray(tile)) for tile in tiles])
        return [_in_slice(one, threshold, tile.shape[1], tile.shape[0]) for one, tile in zip(found, tiles, strict=True)]

    slicer = sv.InferenceSlicer(
        callback=batch if batch_size > 1 else lambda tile: batch([tile])[0],
        slice_wh=size,
        overlap_wh=overlap_pixels(size, overlap),
        # the merge below: InferenceSlicer's own suppression is per class only
        overlap_filter="none",
        # the calling thread alone runs the model: MLX's streams belong to the thread that made them (the
        # server's worker), and one forward of a batch already takes every core
        thread_workers=1,
        batch_size=batch_size,
    )
    return merged_detections(slicer(np.asarray(image)), merge)


def merged_detections(detections, merge: dict = MERGE) -> dict:
    """supervision `Detections` of overlapping slices (in the image's pixels), merged as `merge` says (MERGE's
    keys; filter "none": as they are) -> `Detector.detect`'s dict (boxes, scores, labels, queries), best first."""
    sv = supervision()
    if merge["filter"] != "none" and len(detections):
        options = dict(
            class_agnostic=merge["class_agnostic"], overlap_metric=sv.OverlapMetric.from_value(merge["metric"])
        )
        if merge["filter"] == "non_max_suppression":
            detections = detections.with_nms(merge["iou"], **options)
        else:
            detections = detections.with_nmm(merge["iou"], **options)
    if not len(detections):
        empty = {"boxes": np.zeros((0, 4), np.float32), "scores": np.zeros(0, np.float32)}
        return empty | {"labels": np.zeros(0, np.int64), "queries": np.zeros(0, np.int64)}
    best = np.argsort(-detections.confidence, kind="stable")
    return {
        "boxes": detections.xyxy[best].astype(np.float32),
        "scores": detections.confidence[best].astype(np.float32),
        "labels": detections.class_id[best].astype(np.int64),
        "queries": detections.data["query"][best].astype(np.int64),
    }


def as_supervision(found: dict):
    """`Detector.detect`'s dict (boxes, scores, labels, queries) as supervision `Detections`."""
    return supervision().Detections(
        xyxy=found["boxes"].reshape(-1, 4),
        confidence=found["scores"],
        class_id=found["labels"].astype(np.int64),
        data={"query": found["queries"].astype(np.int64)},
    )


def _in_slice(found: dict, threshold: float, width: int, height: int):
    """One slice's `detect` result at or above `threshold`, boxes clipped to the slice, as sv.Detections."""
    kept = found["scores"] >= threshold
    boxes = np.clip(found["boxes"][kept], 0, [width, height, width, height]).astype(np.float32)
    return as_supervision({"boxes": boxes} | {key: found[key][kept] for key in ("scores", "labels", "queries")})


def _shown(value) -> str:
    return ",".join(str(v) for v in value) if isinstance(value, (tuple, list)) else repr(value)
