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

`CocoDetection` (`coco.py`) reads any set in COCO's layout; `yolo.py`, `voc.py` and `createml.py` read
YOLO's, Pascal VOC's and Create ML's into COCO's format in memory (`in_memory.py`); `register_dataset`
adds another kind. Where a set is: `data.path`. The built-in readers check every
annotation before anything trains (`strict`; `audit.check_split`, the check command's, lists every
problem).
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from .coco import COCO_CATEGORY_NAMES, CocoDetection
from .createml import read_createml
from .images import BadImageError
from .in_memory import InMemoryDetection
from .loader import DataLoader, collate
from .transforms import make_transforms
from .voc import read_voc
from .yolo import read_yolo


@dataclass(frozen=True)
class DatasetKind:
    """A registered `data.dataset`: its `builder`; what `data.path` names (`reads`: "folder", "yaml"
    (a YAML file, or the folder holding it: YOLO's data.yaml), None: not said); `takes_strict`: the
    builder takes `strict=False` (every problem kept in `dataset.problems`, not the first raised)."""

    builder: Callable
    reads: str | None = None
    takes_strict: bool = False


DATASETS: dict[str, DatasetKind] = {}  # the one list of dataset kinds: build_dataset, the check and Detector ask it


def register_dataset(name: str, reads: str | None = None, takes_strict: bool = False):
    """Decorator: `builder(split, data_cfg, prepare)` becomes `data.dataset: name`. With `prepare`
    a builder may write its files first (the shapes set); without, absent files are an error.
    `reads` and `takes_strict`: as `DatasetKind`'s (`Detector.evaluate` names a path of the wrong kind
    by `reads`; the check lists every problem of a builder that `takes_strict`)."""

    def register(builder):
        DATASETS[name] = DatasetKind(builder, reads, takes_strict)
        return builder

    return register


def dataset_reads(name: str) -> str | None:
    """What `data.path` names for the dataset kind `name`: "folder", "yaml", or None (not said, or no
    such kind)."""
    kind = DATASETS.get(name)
    return kind.reads if kind else None


def data_path(data_cfg) -> str:
    """Where the set is: `data.path`."""
    return data_cfg.path


@register_dataset("coco", reads="folder", takes_strict=True)
def coco(split: str, data_cfg, prepare: bool = True, strict: bool = True):
    transforms = make_transforms(split, data_cfg)
    orientation = data_cfg.exif_orientation
    return CocoDetection(data_path(data_cfg), split, transforms, data_cfg.skip_bad_images, strict, orientation)


@register_dataset("shapes", reads="folder", takes_strict=True)
def shapes(split: str, data_cfg, prepare: bool = True, strict: bool = True):
    """The built-in synthetic set, generated under the data path when absent."""
    if prepare and not (Path(data_path(data_cfg)) / "annotations").exists():
        from .shapes import generate

        generate(data_path(data_cfg))
    return coco(split, data_cfg, strict=strict)


@register_dataset("small_shapes", reads="folder", takes_strict=True)
def small_shapes(split: str, data_cfg, prepare: bool = True, strict: bool = True):
    """Small shapes on large canvases (train: tiles; val: whole canvases), generated when absent."""
    if prepare and not (Path(data_path(data_cfg)) / "annotations").exists():
        from .small_shapes import generate

        generate(data_path(data_cfg))
    return coco(split, data_cfg, strict=strict)


@register_dataset("yolo", reads="yaml", takes_strict=True)
def yolo(split: str, data_cfg, prepare: bool = True, strict: bool = True):
    """Ultralytics' layout: `data.path` is the data.yaml or its folder (`yolo.py`)."""
    parsed = read_yolo(data_path(data_cfg), split, data_cfg.skip_bad_images, data_cfg.exif_orientation)
    return InMemoryDetection(parsed, make_transforms(split, data_cfg), data_cfg.skip_bad_images, strict)


@register_dataset("voc", reads="folder", takes_strict=True)
def voc(split: str, data_cfg, prepare: bool = True, strict: bool = True):
    """Pascal VOC's layout: `data.path` holds Annotations/, ImageSets/Main/, JPEGImages/ (`voc.py`)."""
    parsed = read_voc(data_path(data_cfg), split, data_cfg.exif_orientation)
    return InMemoryDetection(parsed, make_transforms(split, data_cfg), data_cfg.skip_bad_images, strict)


@register_dataset("createml", reads="folder", takes_strict=True)
def createml(split: str, data_cfg, prepare: bool = True, strict: bool = True):
    """Apple's Create ML JSON as Roboflow exports it: `data.path` holds train/ and valid/ (`createml.py`)."""
    parsed = read_createml(data_path(data_cfg), split, data_cfg.skip_bad_images, data_cfg.exif_orientation)
    return InMemoryDetection(parsed, make_transforms(split, data_cfg), data_cfg.skip_bad_images, strict)


def build_dataset(split: str, data_cfg, prepare: bool = True, strict: bool = True):
    """The `split` of the dataset a config's data section names. `strict=False`: every problem kept in
    `dataset.problems` where the kind `takes_strict` (the others are built as training builds them)."""
    if data_cfg.dataset not in DATASETS:
        raise UsageError(f"data.dataset {data_cfg.dataset!r}: expected one of {', '.join(sorted(DATASETS))}")
    kind = DATASETS[data_cfg.dataset]
    if not strict and kind.takes_strict:
        return kind.builder(split, data_cfg, prepare, strict=False)
    return kind.builder(split, data_cfg, prepare)


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
    "DatasetKind",
    "build_dataset",
    "collate",
    "data_path",
    "dataset_reads",
    "num_classes_for",
    "register_dataset",
]
