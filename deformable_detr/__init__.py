"""Deformable DETR in MLX: a port of the authors' PyTorch model.

The names below are imported when first used, so that `deformable_detr.runtime` can be imported
(and set up the BLAS for MLX) before MLX itself is."""

import importlib

_HOMES = {
    "Config": "config",
    "load_config": "config",
    "SetCriterion": "criterion",
    "build_criterion": "criterion",
    "DeformableDETR": "model",
    "build_model": "model",
    "post_process": "model",
    "MSDeformAttn": "ms_deform_attn",
}

__all__ = sorted(_HOMES)


def __getattr__(name):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
