"""Deformable DETR in MLX: a port of the authors' PyTorch model."""

from .config import Config, load_config
from .model import DeformableDETR, build_model, post_process
from .ms_deform_attn import MSDeformAttn

__all__ = ["Config", "DeformableDETR", "MSDeformAttn", "build_model", "load_config", "post_process"]
