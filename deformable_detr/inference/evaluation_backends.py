"""COCO box AP's two implementations: pycocotools (the reference, pure Python per image) and
faster-coco-eval (the same algorithm with its per-image matching and accumulation in C++: the same
12 numbers and precision array, several times faster; bench/evaluation.py measures both).
`evaluation.backend: auto` takes faster-coco-eval where it is installed (the `fast-eval` extra)."""

import importlib.util

from ..errors import UsageError, optional

BACKENDS = ("pycocotools", "faster_coco_eval")


def resolve_backend(name: str = "auto") -> str:
    """`auto` -> faster_coco_eval when importable, else pycocotools; a named one must be installed."""
    installed = importlib.util.find_spec("faster_coco_eval") is not None
    if name == "auto":
        return "faster_coco_eval" if installed else "pycocotools"
    if name not in BACKENDS:
        raise UsageError(f"evaluation.backend must be one of auto, {', '.join(BACKENDS)}, got {name!r}")
    if name == "faster_coco_eval" and not installed:
        optional("faster_coco_eval", "fast-eval", "evaluation.backend faster_coco_eval")  # (auto: pycocotools)
    return name


def run_cocoeval(coco_gt, detections: list, backend: str):
    """COCOeval (bbox) of `detections` (COCO results) against `coco_gt` (a pycocotools COCO), evaluated,
    accumulated and summarised (printing its summary) with `backend` (resolved: not `auto`). Either
    evaluator has `stats` (the 12 numbers), `eval["precision"]` (IoU x recall x category x area x
    max detections) and `params`."""
    if backend == "pycocotools":
        from pycocotools.cocoeval import COCOeval

        evaluator = COCOeval(coco_gt, coco_gt.loadRes(detections), "bbox")
    else:
        from faster_coco_eval import COCO, COCOeval_faster

        ground_truth = COCO(coco_gt.dataset)  # its own index of the same records
        evaluator = COCOeval_faster(ground_truth, ground_truth.loadRes(detections), "bbox", print_function=_silent)
    evaluator.evaluate()
    evaluator.accumulate()
    evaluator.summarize()
    if backend != "pycocotools":  # its summary has two more lines (AR at IoU 0.5, 0.75): print pycocotools' 12
        print("\n".join(summary_lines(evaluator.stats)))
    return evaluator


def _silent(*args):
    pass


def summary_lines(stats) -> list[str]:
    """pycocotools' 12 summary lines (bbox, its default parameters) of the 12 numbers."""
    rows = [(1, None, "all", 100), (1, 0.5, "all", 100), (1, 0.75, "all", 100)]
    rows += [(1, None, area, 100) for area in ("small", "medium", "large")]
    rows += [(0, None, "all", n) for n in (1, 10, 100)] + [
        (0, None, area, 100) for area in ("small", "medium", "large")
    ]
    lines = []
    for (ap, iou, area, max_dets), value in zip(rows, stats, strict=True):
        title, kind = ("Average Precision", "(AP)") if ap else ("Average Recall", "(AR)")
        iou = "0.50:0.95" if iou is None else f"{iou:0.2f}"
        lines.append(f" {title:<18} {kind} @[ IoU={iou:<9} | area={area:>6s} | maxDets={max_dets:>3d} ] = {value:0.3f}")
    return lines
