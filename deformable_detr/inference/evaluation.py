"""COCO box AP of a model on a COCO-format split, with pycocotools or faster-coco-eval
(`evaluation_backends.py`): `evaluate`, for training and eval.py alike, overall and per category,
against the ground truth training keeps (`data/ground_truth.py`: without the boxes it drops), and the
confusion matrix at a score threshold (`confusion.py`)."""

import contextlib
import io
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ..data import DataLoader
from ..data.classes import to_dataset_classes
from ..data.ground_truth import box_counts, dropped_line, evaluation_ground_truth
from ..models import post_process
from .confusion import THRESHOLD, confusion_matrix
from .evaluation_backends import resolve_backend, run_cocoeval

STAT_NAMES = ["AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl"]
PER_CLASS_NAMES = ["AP", "AP50", "AP75", "APs", "APm", "APl"]  # pycocotools' first six, for one category


@dataclass
class Evaluation:
    # STAT_NAMES, "per_class": {category name: PER_CLASS_NAMES and "gt", the boxes}, "ground_truth":
    # {"boxes": positives, "crowd": n, "dropped": {reason: boxes left out, as training drops them}}, and
    # from `evaluate`, "confusion_matrix" (confusion.py's record; not where supervision is not installed)
    stats: dict
    detections: list  # COCO's results format
    curves: dict  # {category name: precision at 101 recalls, IoU 0.5, -1 where undefined}


def evaluate(
    model,
    dataset,
    cfg,
    batch_size: int | None = None,
    verbose: bool = False,
    class_map: dict | None = None,
    threshold: float = THRESHOLD,
) -> Evaluation:
    """COCO box AP of `model` on `dataset` (its val split), and the confusion matrix of its detections
    scoring at least `threshold`. `cfg`: the run's config (its data.num_workers, evaluation.backend, and
    evaluation_batch_size where `batch_size` is None). `verbose` prints the 12-line summary; `class_map`:
    {model's category id: dataset's} (data/classes.py, the classes met by name; None: the same ids). The
    model is left in the mode it was in."""
    batch_size, training = batch_size or evaluation_batch_size(cfg), model.training
    detections = predict_detections(model, dataset, batch_size, cfg.data.num_workers, top_k=cfg.evaluation.top_k)
    detections = to_dataset_classes(detections, class_map)
    model.train(training)
    evaluation = score_detections(dataset, detections, verbose, cfg.evaluation.backend)
    matrix = confusion_matrix(evaluation_ground_truth(dataset), detections, threshold)
    if matrix is not None:
        evaluation.stats["confusion_matrix"] = matrix
    return evaluation


def score_detections(dataset, detections: list, verbose: bool = False, backend: str = "auto") -> Evaluation:
    """COCO AP of `detections` (COCO's results format, the dataset's category ids) on `dataset`'s
    ground truth without the boxes training drops; `verbose` prints a line where it dropped any, and
    pycocotools' summary."""
    coco_gt, counts = evaluation_ground_truth(dataset), box_counts(dataset).as_record()
    if verbose and (line := dropped_line(counts)):
        print(line)
    evaluator = coco_evaluator(coco_gt, detections, verbose, backend)
    stats = {**summary(evaluator, coco_gt), "ground_truth": counts}
    return Evaluation(stats, detections, precision_at_50(evaluator, coco_gt))


def evaluation_batch_size(cfg) -> int:
    """Images per forward when evaluating: `schedule.micro_batch_size`, or where that is `auto`, 2 (the
    authors' images per GPU). (AP moves a little with the batch: padding reaches the backbone.)"""
    micro = cfg.schedule.micro_batch_size
    return 2 if micro == "auto" else micro


def predict_detections(
    model, dataset, batch_size: int = 2, num_workers: int = 2, progress: bool = True, top_k: int = 100
) -> list:
    """Run the model over every image of `dataset` (a CocoDetection with its val transforms) -> COCO
    results: [{"image_id", "category_id", "bbox": [x, y, w, h] in original pixels, "score"}], the `top_k`
    best of each image."""
    loader = DataLoader(dataset, batch_size, shuffle=False, num_workers=num_workers, drop_last=False)
    model.eval()
    detections = []
    with contextlib.closing(loader.epoch(0)) as steps:  # closed early too: the loader's threads stop
        for [(images, mask, targets)] in tqdm(
            steps, total=loader.batches_per_epoch(), desc="evaluate", disable=not progress
        ):
            outputs = model(mx.array(images), mx.array(mask))
            sizes = np.stack([t["orig_size"] for t in targets])
            detections += coco_results(post_process(outputs, sizes, top_k), targets)
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


def coco_evaluator(coco_gt, detections: list, verbose: bool = True, backend: str = "auto"):
    """COCOeval (bbox) of `backend` (evaluation.backend), evaluated, accumulated and summarised; None
    without detections of the set's categories."""
    backend = resolve_backend(backend)
    known = set(coco_gt.getCatIds())
    detections = [d for d in detections if d["category_id"] in known]  # classes the set does not have
    if not detections:
        return None
    quiet = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())
    with quiet:
        evaluator = run_cocoeval(coco_gt, detections, backend)
    return evaluator


def summary(evaluator, coco_gt) -> dict:
    """The 12 numbers, and per category what pycocotools' first six are for that category alone
    (its slice of the accumulated precision: categories are evaluated independently)."""
    if evaluator is None:
        return {**dict.fromkeys(STAT_NAMES, 0.0), "per_class": {}}
    stats = dict(zip(STAT_NAMES, (float(s) for s in evaluator.stats), strict=True))
    precision, params = evaluator.eval["precision"], evaluator.params  # (IoU, recall, category, area, max dets)
    per_class = {}
    for k, category in enumerate(params.catIds):
        slices = {
            "AP": precision[:, :, k, 0, -1],
            "AP50": precision[params.iouThrs == 0.5, :, k, 0, -1],
            "AP75": precision[params.iouThrs == 0.75, :, k, 0, -1],
            "APs": precision[:, :, k, 1, -1],
            "APm": precision[:, :, k, 2, -1],
            "APl": precision[:, :, k, 3, -1],
        }
        values = {name: float(np.mean(p[p > -1])) if (p > -1).any() else -1.0 for name, p in slices.items()}
        values["gt"] = len(coco_gt.getAnnIds(catIds=[category], iscrowd=False))
        per_class[coco_gt.cats[category]["name"]] = values
    return {**stats, "per_class": per_class}


def precision_at_50(evaluator, coco_gt) -> dict:
    """{category name: precision at pycocotools' 101 recall points, IoU 0.5, 100 detections}."""
    if evaluator is None:
        return {}
    precision, params = evaluator.eval["precision"], evaluator.params
    at_50 = precision[params.iouThrs == 0.5][0]
    return {coco_gt.cats[c]["name"]: at_50[:, k, 0, -1] for k, c in enumerate(params.catIds)}


def per_class_table(stats: dict) -> str:
    """The per-category numbers as a text table."""
    rows = [f"{'category':<20} {'gt':>6} {'AP':>6} {'AP50':>6} {'AP75':>6} {'APs':>6} {'APm':>6} {'APl':>6}"]
    for name, v in stats["per_class"].items():
        rows.append(f"{name:<20} {v['gt']:>6} " + " ".join(f"{v[k]:>6.3f}" for k in PER_CLASS_NAMES))
    return "\n".join(rows)
