"""Sliced inference on the small shapes set: COCO box AP, AP50, AP_small and AR@100 (pycocotools' COCOeval
on the val canvases) and seconds per canvas, without slicing (the model at its val size, as `predict`
runs it; and at the canvas's full resolution) and with slicing: its merge as shipped and the other ways
supervision merges the same slices' detections, one slice a forward against --batch-size, no overlap, and
slices twice the size.

    python bench/slicing.py [--checkpoint output/small_shapes/checkpoint.safetensors] [--data data/small_shapes]
                            [--slice 256,256] [--overlap 0.2] [--batch-size 4] [--threshold 0.05]
                            [--no-full-resolution] [--output bench/results/slicing_cpu.txt]

The checkpoint is the one `python -m deformable_detr.train --config small_shapes --finetune
output/shapes/checkpoint.safetensors` writes (docs/slicing.md); the set is generated under --data where
absent (deformable_detr/data/small_shapes.py). Sliced rows keep the detections at or above --threshold
(the merge's input), rows without slicing each canvas's top 100 whatever their scores; COCOeval takes each
canvas's best 100. The rows "merged otherwise" merge the slices' detections of the
shipped row again (the model is not run again): their seconds are the shipped row's forwards plus their
own merge. The MLX peak is `mx.get_peak_memory()` over each row's canvases.
"""

import contextlib
import datetime
import io
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
from deformable_detr import Detector  # noqa: E402
from deformable_detr.data.small_shapes import OBJECT_SIZES, TILE, generate  # noqa: E402
from deformable_detr.errors import ArgumentParser, entry_point  # noqa: E402
from deformable_detr.inference import slicing  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from common import cpu_model, load_average, report  # noqa: E402
from PIL import Image  # noqa: E402

# the other merges of the same slices: supervision's suppression (NMS) or merging (NMM), IoU or
# intersection over the smaller box (IoS), per class or across classes
OTHER_MERGES = {
    "NMS across classes, IoU 0.5": dict(slicing.MERGE, class_agnostic=True),
    "NMS per class, IoS 0.5": dict(slicing.MERGE, metric="ios"),
    "NMM per class, IoU 0.5": dict(slicing.MERGE, filter="non_max_merge"),
    "NMM per class, IoS 0.5": dict(slicing.MERGE, filter="non_max_merge", metric="ios"),
    "none (every slice's detections)": dict(slicing.MERGE, filter="none"),
}


def coco_stats(gt, found: dict) -> dict:
    """pycocotools' bbox COCOeval of {image id: detect dict} -> AP, AP50, APs, AR100."""
    from pycocotools.cocoeval import COCOeval

    results = [
        {"image_id": image_id, "category_id": int(label), "bbox": [x0, y0, x1 - x0, y1 - y0], "score": float(score)}
        for image_id, one in found.items()
        for (x0, y0, x1, y1), score, label in zip(one["boxes"].tolist(), one["scores"], one["labels"], strict=True)
    ]
    if not results:
        return {"AP": 0.0, "AP50": 0.0, "APs": 0.0, "AR100": 0.0}
    with contextlib.redirect_stdout(io.StringIO()):  # its tables: the numbers are taken below
        evaluation = COCOeval(gt, gt.loadRes(results), "bbox")
        evaluation.params.imgIds = sorted(found)
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    stats = evaluation.stats
    return {"AP": stats[0], "AP50": stats[1], "APs": stats[3], "AR100": stats[8]}


def timed(run, canvases: dict) -> tuple[dict, float, float]:
    """run(image) on each canvas -> ({image id: its result}, seconds per canvas, MLX's peak in MiB)."""
    mx.reset_peak_memory()
    found, start = {}, time.perf_counter()
    for image_id, image in canvases.items():
        found[image_id] = run(image)
    seconds = (time.perf_counter() - start) / len(canvases)
    return found, seconds, mx.get_peak_memory() / 2**20


def as_found(result) -> dict:
    return {"boxes": result.boxes, "scores": result.scores, "labels": result.labels}


def size_argument(text: str) -> tuple[int, int]:
    return slicing.parse_slice(text, None, ("--slice", "--overlap"))[0]


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "output" / "small_shapes" / "checkpoint.safetensors")
    parser.add_argument("--data", type=Path, default=Path("data/small_shapes"))
    parser.add_argument("--slice", type=size_argument, default=TILE, metavar="W,H")
    parser.add_argument("--overlap", type=float, default=slicing.OVERLAP)
    parser.add_argument("--batch-size", type=int, default=4, help="slices a forward")
    parser.add_argument("--threshold", type=float, default=0.05)
    parser.add_argument("--no-full-resolution", action="store_true", help="leave out the full-resolution row")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "slicing_cpu.txt")
    args = parser.parse_args(argv)
    from pycocotools.coco import COCO

    if not (args.data / "annotations").exists():
        generate(args.data)
    annotations = args.data / "annotations" / "instances_val2017.json"
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(annotations))
    listed = json.loads(annotations.read_text())
    canvases = {
        image["id"]: Image.open(args.data / "val2017" / image["file_name"]).convert("RGB") for image in listed["images"]
    }
    detector = Detector.load(args.checkpoint)
    names = {c["id"]: c["name"] for c in listed["categories"]}
    if {k: detector.class_names.get(k) for k in names} != names:
        raise SystemExit(f"the model's classes {detector.class_names} are not the set's {names}")
    data = detector.cfg.data
    first = next(iter(canvases.values()))
    detector.predict(first.crop((0, 0, *args.slice)), threshold=1.0)  # MLX's first run, outside the timings
    size, overlap, threshold = args.slice, args.overlap, args.threshold
    rows = []  # (what, stats, seconds, detections a canvas, peak MiB)

    def row(what: str, found: dict, seconds: float, peak: float):
        count = np.mean([len(one["scores"]) for one in found.values()])
        rows.append((what, coco_stats(gt, found), seconds, count, peak))
        print(f"{what}: {rows[-1][1]}, {seconds:.2f} s a canvas", file=sys.stderr)

    # without slicing, every row's top 100 whatever their scores (threshold 0): the most COCOeval can take
    found, seconds, peak = timed(lambda image: as_found(detector.predict(image, 0.0)[0]), canvases)
    shrunk = detector.batch_key(first)
    row(f"without slicing, at the val size ({shrunk[1]} x {shrunk[0]}; `predict`)", found, seconds, peak)

    # the slices' detections before the merge, kept to merge again each other way
    raw, forwards, peak = timed(
        lambda image: slicing.sliced_detect(
            detector, image, size, overlap, threshold, args.batch_size, {"filter": "none"}
        ),
        canvases,
    )
    merges = {f"{size[0]} x {size[1]} slices, overlap {overlap:g}: NMS per class, IoU 0.5 (shipped)": slicing.MERGE}
    merges |= {f"the same slices merged otherwise: {what}": merge for what, merge in OTHER_MERGES.items()}
    for what, merge in merges.items():
        start = time.perf_counter()
        found = {i: slicing.merged_detections(slicing.as_supervision(one), merge) for i, one in raw.items()}
        row(what, found, forwards + (time.perf_counter() - start) / len(raw), peak)
    shipped = rows[1]
    # the shipped merge through Detector.predict, as a user runs it: its seconds are the shipped row's
    found, seconds, peak = timed(
        lambda image: as_found(
            detector.predict(image, threshold, batch_size=args.batch_size, slice=size, overlap=overlap)[0]
        ),
        canvases,
    )
    if coco_stats(gt, found) != shipped[1]:
        raise SystemExit("Detector.predict(slice=...) and the shipped merge of the slices disagree")
    rows[1] = (shipped[0], shipped[1], seconds, shipped[3], peak)

    # the shipped merge on other slices: no overlap (objects cut on the seams), and slices twice the
    # size the model was trained at (the model shrinks each to its val size, and the objects with it)
    others = [(size, overlap, 1), (size, 0.0, args.batch_size), ((2 * size[0], 2 * size[1]), overlap, args.batch_size)]
    for other_size, other_overlap, batch in others:
        found, seconds, peak = timed(
            lambda image, s=other_size, o=other_overlap, b=batch: as_found(
                detector.predict(image, threshold, batch_size=b, slice=s, overlap=o)[0]
            ),
            canvases,
        )
        what = f"{other_size[0]} x {other_size[1]} slices, overlap {other_overlap:g}"
        row(what + (", 1 slice a forward" if batch == 1 else ""), found, seconds, peak)

    if not args.no_full_resolution:
        full = Detector.load(
            args.checkpoint, overrides=[f"data.val_size={first.height}", f"data.max_size={first.width}"]
        )
        found, seconds, peak = timed(lambda image: as_found(full.predict(image, 0.0)[0]), canvases)
        row(f"without slicing, at full resolution ({first.width} x {first.height})", found, seconds, peak)

    gt_boxes = len(listed["annotations"])
    lines = [
        f"Sliced inference on the small shapes set: {len(canvases)} val canvases of {first.width} x {first.height}, "
        f"{gt_boxes} objects of {OBJECT_SIZES[0]}-{OBJECT_SIZES[1]} px "
        f"(deformable_detr/data/small_shapes.py); {os.path.relpath(args.checkpoint)}, "
        f"val size {data.val_size} (max {data.max_size}), {detector.precision}; threshold {threshold:g}, "
        f"{args.batch_size} slices a forward",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_model(count=True)}, "
        f"load average at the end {load_average()}; mlx {mx.__version__}",
        "",
        "| inference | AP | AP50 | AP_small | AR@100 | s / canvas | detections / canvas | MLX peak MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for what, stats, seconds, count, peak in rows:
        numbers = f"{stats['AP']:.3f} | {stats['AP50']:.3f} | {stats['APs']:.3f} | {stats['AR100']:.3f}"
        lines.append(f"| {what} | {numbers} | {seconds:.2f} | {count:.0f} | {peak:.0f} |")
    report(lines, args.output)


if __name__ == "__main__":
    main()
