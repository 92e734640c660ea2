"""Deformable DETR in MLX: a port of the authors' PyTorch model."""

from .ms_deform_attn import MSDeformAttn

__all__ = ["MSDeformAttn"]
