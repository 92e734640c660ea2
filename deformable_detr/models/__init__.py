"""The network and its losses: `DeformableDETR` (backbone, position encoding, deformable transformer
with `MSDeformAttn`, heads) and `post_process`; `SetCriterion` with its Hungarian matcher."""

from .criterion import SetCriterion, build_criterion
from .deformable_detr import DeformableDETR, build_model, post_process
from .ms_deform_attn import MSDeformAttn

__all__ = ["DeformableDETR", "MSDeformAttn", "SetCriterion", "build_criterion", "build_model", "post_process"]
