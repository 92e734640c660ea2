"""The detectors by `model.architecture`: `build_model` builds a config's."""

from ..config import Config
from .backbones import build_backbone
from .combinations import check_model
from .deformable_detr import DeformableDETR
from .deformable_transformer import DeformableTransformer
from .dino import DINO, DINOTransformer

ARCHITECTURES = {"deformable_detr": (DeformableDETR, DeformableTransformer), "dino": (DINO, DINOTransformer)}


def build_model(cfg: Config) -> DeformableDETR:
    check_model(cfg.model)  # before any part is built: their own checks would say less
    detector, transformer = ARCHITECTURES[cfg.model.architecture]
    model = detector(build_backbone(cfg.model), transformer(cfg.model), cfg.model)
    model.set_activation_checkpointing(cfg.train.activation_checkpointing is True)  # auto: the memory check sets it
    return model
