"""Datasets and batching.

A dataset is what a registered builder returns for a split ("train" or "val") and a config's `data`
section. Everything else (the loader, training, evaluation, the memory check, the pictures) asks it
only for this:

- `len(dataset)`; `dataset.sample(index, rng)` -> (pixels (H, W, 3) float32 normalised, target
  with `boxes` (N, 4) cx, cy, w, h in [0, 1], `labels` (N,) category ids, `image_id`, `orig_size`
  (height, width), `size` (the pixels' height, width)), augmented with the numpy Generator `rng`;
  a missing or unreadable image raises `BadImageError`, skipped when `dataset.skip_bad_images`;
- `dataset.load(index)` -> (PIL image, target in pixels x0, y0, x1, y1), unaugmented;
- `dataset.image_sizes()` -> (width, height) of every image (for the memory check);
- `dataset.class_names()` -> {category id: name}; `dataset.max_category_id()`, the largest id of
  the labels and the names; `dataset.annotation_file`, where the labels come from (for messages);
- `dataset.coco`: a pycocotools `COCO` of the split's ground truth, for COCO AP.

`CocoDetection` (`coco.py`) reads any set in COCO's layout; `register_dataset` adds another kind.
"""

from pathlib import Path

from ..cli import UsageError
from .coco import COCO_CATEGORY_NAMES, CocoDetection
from .loader import BadImageError, DataLoader, collate
from .transforms import make_transforms

DATASETS = {}


def register_dataset(name: str):
    """Decorator: `builder(split, data_cfg, prepare)` becomes `data.dataset: name`. With `prepare`
    a builder may write its files first (the shapes set); without, absent files are an error."""

    def register(builder):
        DATASETS[name] = builder
        return builder

    return register


@register_dataset("coco")
def coco(split: str, data_cfg, prepare: bool = True):
    return CocoDetection(data_cfg.coco_path, split, make_transforms(split, data_cfg), data_cfg.skip_bad_images)


@register_dataset("shapes")
def shapes(split: str, data_cfg, prepare: bool = True):
    """The built-in synthetic set, generated under `coco_path` when absent."""
    if prepare and not (Path(data_cfg.coco_path) / "annotations").exists():
        from .shapes import generate

        generate(data_cfg.coco_path)
    return coco(split, data_cfg)


def build_dataset(split: str, data_cfg, prepare: bool = True):
    """The `split` of the dataset a config's data section names."""
    if data_cfg.dataset not in DATASETS:
        raise UsageError(f"data.dataset {data_cfg.dataset!r}: expected one of {', '.join(sorted(DATASETS))}")
    return DATASETS[data_cfg.dataset](split, data_cfg, prepare)


def num_classes_for(dataset, num_classes) -> int:
    """`model.num_classes` checked against the labels before any model is built: `auto` becomes the
    largest category id + 1; an explicit value must exceed every category id (a label indexes the
    class outputs)."""
    largest = dataset.max_category_id()
    if num_classes == "auto":
        if largest < 0:
            raise ValueError(
                f"{dataset.annotation_file}: no categories, so model.num_classes=auto has nothing to count"
            )
        return largest + 1
    if largest >= num_classes:
        raise ValueError(
            f"{dataset.annotation_file}: category id {largest} is not below model.num_classes ({num_classes}); "
            f"set model.num_classes={largest + 1} or model.num_classes=auto"
        )
    return num_classes


__all__ = [
    "COCO_CATEGORY_NAMES",
    "BadImageError",
    "CocoDetection",
    "DataLoader",
    "build_dataset",
    "collate",
    "num_classes_for",
    "register_dataset",
]
