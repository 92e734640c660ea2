"""COCO box AP of a model on a COCO-format split, with pycocotools: `evaluate`, for training and
eval.py alike."""

import contextlib
import io

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from .data import DataLoader
from .model import post_process

STAT_NAMES = ["AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl"]


def evaluate(model, dataset, batch_size: int = 2, num_workers: int = 2, verbose: bool = False) -> tuple[dict, list]:
    """COCO box AP of `model` on `dataset` (its val split) -> (the 12 summary numbers by name, the
    detections). `verbose` prints pycocotools' summary. The model is left in the mode it was in."""
    training = model.training
    detections = predict_detections(model, dataset, batch_size, num_workers)
    model.train(training)
    return coco_stats(dataset.coco, detections, verbose), detections


def evaluation_batch_size(cfg) -> int:
    """Images per forward when evaluating: `schedule.micro_batch_size`, or where that is `auto`, 2 (the
    authors' images per GPU). (AP moves a little with the batch: padding reaches the backbone.)"""
    micro = cfg.schedule.micro_batch_size
    return 2 if micro == "auto" else micro


def predict_detections(model, dataset, batch_size: int = 2, num_workers: int = 2, progress: bool = True) -> list:
    """Run the model over every image of `dataset` (a CocoDetection with its val transforms) -> COCO
    results: [{"image_id", "category_id", "bbox": [x, y, w, h] in original pixels, "score"}]."""
    loader = DataLoader(dataset, batch_size, shuffle=False, num_workers=num_workers, drop_last=False)
    model.eval()
    detections = []
    with contextlib.closing(loader.epoch(0)) as steps:  # closed early too: the loader's threads stop
        for [(images, mask, targets)] in tqdm(
            steps, total=loader.batches_per_epoch(), desc="evaluate", disable=not progress
        ):
            outputs = model(mx.array(images), mx.array(mask))
            detections += coco_results(post_process(outputs, np.stack([t["orig_size"] for t in targets])), targets)
    return detections


def coco_results(results: list, targets: list) -> list:
    """Post-processed detections of a batch -> COCO's results format (boxes x, y, width, height)."""
    records = []
    for target, result in zip(targets, results, strict=True):
        for score, label, (x0, y0, x1, y1) in zip(
            np.array(result["scores"]), np.array(result["labels"]), np.array(result["boxes"]), strict=True
        ):
            records.append(
                {
                    "image_id": int(target["image_id"]),
                    "category_id": int(label),
                    "bbox": [float(x0), float(y0), float(x1 - x0), float(y1 - y0)],
                    "score": float(score),
                }
            )
    return records


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
