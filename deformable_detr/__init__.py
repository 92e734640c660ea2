"""Deformable DETR in MLX: a port of the authors' PyTorch model."""

from .config import Config, load_config
from .criterion import SetCriterion, build_criterion
from .model import DeformableDETR, build_model, post_process
from .ms_deform_attn import MSDeformAttn

__all__ = [
    "Config",
    "DeformableDETR",
    "MSDeformAttn",
    "SetCriterion",
    "build_criterion",
    "build_model",
    "load_config",
    "post_process",
]
