"""Inference at bfloat16 against float32 (`--precision`, models/precision.py) on a trained checkpoint:
COCO AP of both on its val set, and each val image's detections at both: the largest box difference in pixels and
score difference of float32's detections above a score (0.5, 0.3, 0.1) from bfloat16's nearest box of
the same class.

    python bench/inference_precision.py [--checkpoint output/shapes/checkpoint.safetensors]
                                        [--output bench/results/inference_precision_cpu.txt]

The default is the quick start's checkpoint (`python train.py --config configs/shapes.yaml`). Both
precisions in one process, on the same weights (a Detector's weights stay float32 at either). Where
bfloat16 products are not fast (kernels.bfloat16_products), `--precision bfloat16` runs float32: the
script says so and stops, as there is nothing to compare.
"""

import datetime
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
from deformable_detr import Detector  # noqa: E402
from deformable_detr.errors import ArgumentParser, entry_point  # noqa: E402

import numpy as np  # noqa: E402
from common import cpu_model, report  # noqa: E402

PRECISIONS = ("float32", "bfloat16")


def detections(detector: Detector, images: list) -> dict:
    """{image name: (boxes, scores, labels)} of every image's top 100."""
    return {r.path.name: (r.boxes, r.scores, r.labels) for r in detector.predict(images, threshold=0.0)}


def largest_differences(wide: dict, narrow: dict, least_score: float) -> tuple[float, float, int]:
    """Over float32's detections scoring at least `least_score`, each matched to bfloat16's nearest box
    of its class (two-stage's queries are the encoder's top proposals, whose order near-ties change):
    (the largest box difference in pixels, the largest score difference, how many)."""
    box = score = 0.0
    count = 0
    for name, (boxes, scores, labels) in wide.items():
        boxes16, scores16, labels16 = narrow[name]
        for b, s, label in zip(boxes, scores, labels, strict=True):
            if s < least_score:
                continue
            same = np.flatnonzero(labels16 == label)
            nearest = same[np.abs(boxes16[same] - b).max(axis=1).argmin()]
            box = max(box, float(np.abs(boxes16[nearest] - b).max()))
            score = max(score, abs(float(scores16[nearest]) - float(s)))
            count += 1
    return box, score, count


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "output" / "shapes" / "checkpoint.safetensors")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "inference_precision_cpu.txt")
    args = parser.parse_args(argv)
    import kernels
    from kernels import onednn

    import mlx.core as mx

    fast, why = kernels.bfloat16_products()
    if not fast:
        print(f"bfloat16 products are not fast here ({why}): --precision bfloat16 runs float32; nothing to compare")
        return
    detectors = {p: Detector.load(args.checkpoint, precision=p) for p in PRECISIONS}
    stats = {p: d.evaluate() for p, d in detectors.items()}
    data = detectors["float32"].cfg.data
    val = Path(data.path) / "val2017"
    images = sorted(val.iterdir())
    found = {p: detections(d, images) for p, d in detectors.items()}
    lines = [
        f"Inference at bfloat16 against float32, {os.path.relpath(args.checkpoint)} on its val set "
        f"({len(images)} images); "
        f"{datetime.date.today()}, {cpu_model()}, bfloat16 products: {why}; mlx {mx.__version__}, "
        f"{onednn.describe()}; auto picks bfloat16 here",
        "",
        "| precision | AP | AP50 | AP75 |",
        "| --- | ---: | ---: | ---: |",
    ]
    for p in PRECISIONS:
        lines.append(f"| {p} | {stats[p]['AP']:.4f} | {stats[p]['AP50']:.4f} | {stats[p]['AP75']:.4f} |")
    lines += [
        "",
        f"AP difference: {stats['bfloat16']['AP'] - stats['float32']['AP']:+.4f}",
        "float32's detections, each against bfloat16's nearest box of its class:",
        "",
        "| float32 score at least | detections | largest box difference (px) | largest score difference |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for least in (0.5, 0.3, 0.1):
        box, score, count = largest_differences(found["float32"], found["bfloat16"], least)
        lines.append(f"| {least} | {count} | {box:.3f} | {score:.4f} |")
    report(lines, args.output)


if __name__ == "__main__":
    main()
