"""COCO box AP's two backends on a COCO-sized synthetic val: pycocotools against faster-coco-eval, in
one run, with the numbers they give compared.

    python bench/evaluation.py [--images 5000] [--detections 100] [--repeats 3]
                               [--output bench/results/evaluation_cpu.txt]

The val: `--images` images of 640 x 480, COCO's 80 category ids, 7.3 boxes an image (COCO val2017:
36,781 boxes on 5,000 images), a third each small, medium and large, 1% crowd, masks' areas below
the boxes'; `--detections` an image (COCO's limit, what the model's post-processing returns): the
boxes jittered, some of another class, the rest false positives. Each backend's time is
`coco_evaluator` (what training's and eval.py's evaluation calls): the detections' index, evaluate,
accumulate, summarise; median of `--repeats`, the backends alternating, each on a fresh copy."""

import copy
import datetime
import os
import platform
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

from deformable_detr.data import COCO_CATEGORY_NAMES
from deformable_detr.data.in_memory import coco_from_dict
from deformable_detr.errors import ArgumentParser, entry_point
from deformable_detr.inference.evaluation import STAT_NAMES, coco_evaluator

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("pycocotools", "faster_coco_eval")


def ground_truth_box(rng) -> list[float]:
    side = float(rng.choice([rng.uniform(6, 31), rng.uniform(33, 95), rng.uniform(97, 400)]))
    w, h = min(side * rng.uniform(0.6, 1.4), 639), min(side * rng.uniform(0.6, 1.4), 479)
    return [float(rng.uniform(0, 640 - w)), float(rng.uniform(0, 480 - h)), w, h]


def synthetic_val(images: int, per_image: int, seed: int = 0):
    """-> (the ground truth as a pycocotools COCO, the detections in COCO's results format)."""
    rng = np.random.default_rng(seed)
    categories = list(COCO_CATEGORY_NAMES)
    data = {
        "images": [],
        "annotations": [],
        "categories": [{"id": c, "name": n} for c, n in COCO_CATEGORY_NAMES.items()],
    }
    detections = []
    for image_id in range(1, images + 1):
        data["images"].append({"id": image_id, "file_name": f"{image_id:012d}.jpg", "width": 640, "height": 480})
        found = []
        for _ in range(int(rng.poisson(7.3))):
            box, category = ground_truth_box(rng), int(rng.choice(categories))
            area = box[2] * box[3] * rng.uniform(0.5, 0.9)
            crowd = int(rng.uniform() < 0.01)
            annotation = {"id": len(data["annotations"]) + 1, "image_id": image_id, "category_id": category}
            data["annotations"].append({**annotation, "bbox": box, "area": area, "iscrowd": crowd})
            x, y, w, h = box
            label = int(rng.choice(categories)) if rng.uniform() < 0.2 else category
            found.append(
                [x + rng.normal(0, 0.08 * w), y + rng.normal(0, 0.08 * h), w * rng.uniform(0.8, 1.2), h, label]
            )
        scores = np.concatenate([rng.uniform(0.3, 1, len(found)), rng.uniform(0, 0.6, max(per_image - len(found), 0))])
        while len(found) < per_image:  # false positives, mostly scored below the boxes found
            found.append([*ground_truth_box(rng), int(rng.choice(categories))])
        detections += [
            {"image_id": image_id, "category_id": int(f[4]), "bbox": [float(v) for v in f[:4]], "score": float(s)}
            for f, s in zip(found[:per_image], scores[:per_image], strict=True)
        ]
    return coco_from_dict(data), detections


def time_backends(coco_gt, detections, repeats: int) -> tuple[dict, dict]:
    """-> ({backend: [seconds, ...]}, {backend: its 12 numbers})."""
    times, stats = {b: [] for b in BACKENDS}, {}
    for _ in range(repeats):
        for backend in BACKENDS:
            fresh = copy.deepcopy(detections)  # loadRes adds keys to them
            start = time.perf_counter()
            evaluator = coco_evaluator(coco_gt, fresh, verbose=False, backend=backend)
            times[backend].append(time.perf_counter() - start)
            stats[backend] = np.array(evaluator.stats, np.float64)
            print(f"{backend}: {times[backend][-1]:.2f} s", flush=True)
    return times, stats


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--detections", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "evaluation_cpu.txt")
    args = parser.parse_args(argv)
    coco_gt, detections = synthetic_val(args.images, args.detections)
    times, stats = time_backends(coco_gt, detections, args.repeats)
    medians = {b: statistics.median(t) for b, t in times.items()}
    versions = ", ".join(f"{p} {version(p)}" for p in ("pycocotools", "faster-coco-eval", "numpy"))
    lines = [
        f"COCO box AP of a synthetic val: {args.images} images, {len(coco_gt.anns)} boxes "
        f"({sum(a['iscrowd'] for a in coco_gt.anns.values())} crowd), {len(detections)} detections",
        f"{datetime.date.today()}; {cpu_model()}, {len(os.sched_getaffinity(0))} cores; "
        f"Python {platform.python_version()}, {versions}",
        f"seconds: coco_evaluator (index, evaluate, accumulate, summarise), median of {args.repeats}",
        "",
        "| backend | seconds | runs | ratio (pycocotools / it) |",
        "| --- | ---: | --- | ---: |",
    ]
    for backend in BACKENDS:
        runs = ", ".join(f"{t:.2f}" for t in times[backend])
        lines.append(
            f"| {backend} | {medians[backend]:.2f} | {runs} | {medians['pycocotools'] / medians[backend]:.2f} |"
        )
    difference = np.abs(stats["pycocotools"] - stats["faster_coco_eval"]).max()
    given = ", ".join(f"{n} {v:.4f}" for n, v in zip(STAT_NAMES, stats["pycocotools"], strict=True))
    lines += ["", f"the 12 numbers: {given}", f"largest difference between the backends: {difference:.3g}"]
    report(lines, args.output)


if __name__ == "__main__":
    main()
