"""COCO box AP of a model on a COCO-format split, with pycocotools."""

import contextlib
import io

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from .data import DataLoader
from .model import post_process

STAT_NAMES = ["AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl"]


def predict_detections(model, dataset, batch_size: int = 2, num_workers: int = 2, progress: bool = True) -> list:
    """Run the model over every image of `dataset` (a CocoDetection with its val transforms) -> COCO
    results: [{"image_id", "category_id", "bbox": [x, y, w, h] in original pixels, "score"}]."""
    loader = DataLoader(dataset, batch_size, shuffle=False, num_workers=num_workers, drop_last=False)
    model.eval()
    detections = []
    for images, mask, targets in tqdm(
        loader.epoch(0), total=loader.batches_per_epoch(), desc="evaluate", disable=not progress
    ):
        outputs = model(mx.array(images), mx.array(mask))
        sizes = np.stack([t["orig_size"] for t in targets])
        for target, result in zip(targets, post_process(outputs, sizes), strict=True):
            boxes = np.array(result["boxes"])
            for score, label, (x0, y0, x1, y1) in zip(
                np.array(result["scores"]), np.array(result["labels"]), boxes, strict=True
            ):
                detections.append(
                    {
                        "image_id": int(target["image_id"]),
                        "category_id": int(label),
                        "bbox": [float(x0), float(y0), float(x1 - x0), float(y1 - y0)],
                        "score": float(score),
                    }
                )
    return detections


def coco_stats(coco_gt, detections: list, verbose: bool = True) -> dict:
    """pycocotools' bbox evaluation: the 12 summary numbers by name (printed when verbose)."""
    from pycocotools.cocoeval import COCOeval

    known = set(coco_gt.getCatIds())
    detections = [d for d in detections if d["category_id"] in known]  # classes the set does not have
    if not detections:
        return dict.fromkeys(STAT_NAMES, 0.0)
    quiet = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())
    with quiet:
        coco_dt = coco_gt.loadRes(detections)
        evaluator = COCOeval(coco_gt, coco_dt, "bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return dict(zip(STAT_NAMES, (float(s) for s in evaluator.stats), strict=True))
