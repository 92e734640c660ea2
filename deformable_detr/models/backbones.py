"""The backbones a detector can have, by family (`BACKBONES`): the `model.backbone` names each builds, how it
builds them from the config's model section, and what of that section it takes. Every backbone is a
`BackboneBase` (backbone_base.py). Another family is another entry here, and a reader of its checkpoints'
bodies in weights/backbones.py; nothing else asks which family a name is of but through
`backbone_family`."""

from collections.abc import Callable
from dataclasses import dataclass

from ..config import ModelConfig
from .backbone import ARCHITECTURES, Backbone
from .backbone_base import BackboneBase
from .swin import SWIN_ARCHITECTURES, SwinBackbone


@dataclass(frozen=True)
class BackboneFamily:
    backbone: type[BackboneBase]  # its class
    names: tuple[str, ...]  # the model.backbone values it builds
    build: Callable[[ModelConfig], BackboneBase]  # the config's model section -> its backbone
    dilation: bool = False  # it takes model.dilation (DC5: the last stage dilated, not strided)


def _resnet(m: ModelConfig) -> Backbone:
    return Backbone(m.backbone, maps_taken(m), m.dilation, m.backbone_width)


def _swin(m: ModelConfig) -> SwinBackbone:  # H-Deformable-DETR's Swin backbones (DINO's are the same)
    return SwinBackbone(m.backbone, maps_taken(m), m.drop_path_rate)


BACKBONES = {
    "resnet": BackboneFamily(Backbone, tuple(ARCHITECTURES), _resnet, dilation=True),
    "swin": BackboneFamily(SwinBackbone, tuple(SWIN_ARCHITECTURES), _swin),
}


def backbone_names() -> list[str]:
    """Every model.backbone value, family by family."""
    return [name for family in BACKBONES.values() for name in family.names]


def backbone_family(name: str) -> str | None:
    """The BACKBONES key of the family that builds `name`, or None where none does."""
    return next((key for key, family in BACKBONES.items() if name in family.names), None)


def unknown_backbone(name: str) -> str | None:
    """What is wrong with `name` as model.backbone, in one line, or None where a family builds it."""
    if backbone_family(name) is None:
        return f"model.backbone {name}: expected one of {', '.join(backbone_names())}"
    return None


def maps_taken(m: ModelConfig) -> int:
    """How many of the backbone's maps, its coarsest, the model takes as levels: model.backbone_maps, where auto is
    1 with one level, else 3 (strides 8, 16, 32)."""
    if m.backbone_maps == "auto":
        return 1 if m.num_feature_levels == 1 else 3
    return m.backbone_maps


def build_backbone(m: ModelConfig) -> BackboneBase:
    """The backbone of the config's model section (the section checked by combinations.check_model)."""
    if problem := unknown_backbone(m.backbone):
        raise ValueError(problem)
    return BACKBONES[backbone_family(m.backbone)].build(m)
