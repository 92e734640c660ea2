"""Deformable DETR in MLX: a port of the authors' PyTorch model.

    from deformable_detr import Detector

    detector = Detector.load("hf://SenseTime/deformable-detr")  # or a weights file
    for result in detector.predict(["photo.jpg"], threshold=0.5):
        print(result.names, result.scores, result.boxes)

Importing the package sets up the process first (`runtime.py`: the BLAS under MLX's products, and
malloc), so import it before mlx. The names below are imported when first used.

Folders by role, each importing only those listed before it: `models/` (the network, its losses),
`data/`, `weights/` (files, conversion, the Hub), `inference/` (detection, evaluation, pictures),
`training/`; the commands (`predict`, `convert`, `export`) on top."""

from . import runtime

runtime.set_up()

import importlib  # noqa: E402

_HOMES = {
    "Detector": "inference.detector",
    "Config": "config",
    "load_config": "config",
    "DeformableDETR": "models",
    "build_model": "models",
    "post_process": "models",
    "SetCriterion": "models",
    "build_criterion": "models",
    "MSDeformAttn": "models",
}

__all__ = sorted(_HOMES)


def __getattr__(name):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
