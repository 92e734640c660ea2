"""The network and its losses: `DeformableDETR` (backbone, position encoding, deformable transformer
with `MSDeformAttn`, heads), `DINO` over it, and `post_process`; `SetCriterion` with its Hungarian matcher."""

from .criterion import SetCriterion, build_criterion
from .deformable_detr import DeformableDETR, post_process
from .detectors import build_model
from .dino import DINO
from .ms_deform_attn import MSDeformAttn

__all__ = ["DINO", "DeformableDETR", "MSDeformAttn", "SetCriterion", "build_criterion", "build_model", "post_process"]
