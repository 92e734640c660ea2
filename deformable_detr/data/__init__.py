"""Data: COCO-format detection sets, the authors' augmentations, batching."""

from .coco import BadImageError, CocoDetection, DataLoader, build_dataset, collate

__all__ = ["BadImageError", "CocoDetection", "DataLoader", "build_dataset", "collate"]
