"""Which model settings go together: `model_problem` states each rule that a model section must keep to be
built (and run), once; `check_model` raises its answer. The commands call it right after reading a
config, before any data, run directory or weights (train.py, Detector.config_for and Detector.load, so
eval, predict, serve and export): a usage error in one line naming both keys, exit 2; `build_model` and
`DeformableDETR` call it too, so a model built from Python is refused by the same rule (a UsageError is a
ValueError). A single key's range is config.py's (its fields' `range` metadata)."""

from ..config import ModelConfig
from ..errors import UsageError
from .backbones import BACKBONES, backbone_family, maps_taken, unknown_backbone

GROUPS = 32  # the input projections' group norm (the authors'): model.hidden_dim is a multiple of it


def model_problem(m: ModelConfig) -> str | None:
    """The first rule that the model section `m` breaks, in one line, or None."""
    if problem := unknown_backbone(m.backbone):
        return problem
    family = backbone_family(m.backbone)
    if m.dilation and not BACKBONES[family].dilation:
        return (
            f"model.dilation (DC5) dilates a ResNet's last stage; model.backbone {m.backbone} has none: "
            "set model.dilation=false"
        )
    if m.backbone_maps not in ("auto", 1, 3, 4):
        return f"model.backbone_maps {m.backbone_maps}: auto, 1 (the last map), 3 (strides 8, 16, 32) or 4 (and 4)"
    maps = maps_taken(m)
    if (maps == 1) != (m.num_feature_levels == 1) or m.num_feature_levels < maps:
        return (
            f"model.num_feature_levels {m.num_feature_levels} with model.backbone_maps {m.backbone_maps}: the levels "
            f"are the backbone's {maps} maps, then maps made from the last: 1 level takes 1 map, more take 3 or 4"
        )
    if m.hidden_dim % m.nheads:
        return (
            f"model.hidden_dim {m.hidden_dim} is not a multiple of model.nheads {m.nheads}: each head takes "
            "hidden_dim / nheads of the channels"
        )
    if m.hidden_dim % GROUPS:
        return f"model.hidden_dim {m.hidden_dim}: a multiple of {GROUPS}, the groups of the input projections' norm"
    if m.mixed_selection and not m.two_stage:
        return "model.mixed_selection needs model.two_stage: it mixes the encoder's proposals in"
    if m.look_forward_twice and not m.with_box_refine:
        return "model.look_forward_twice needs model.with_box_refine: it looks at the refined boxes"
    if m.architecture == "dino" and not (m.two_stage and m.with_box_refine and m.mixed_selection):
        return (
            "model.architecture dino needs model.two_stage, model.with_box_refine and model.mixed_selection (DINO's "
            "code builds only that: configs/dino_r50_4scale_12ep.yaml)"
        )
    if m.architecture == "dino" and m.num_queries_one2many:
        return "model.num_queries_one2many (H-Deformable-DETR's hybrid branch): not built with model.architecture dino"
    if m.decoder_heads != "auto" and m.architecture != "dino":
        return (
            f"model.decoder_heads {m.decoder_heads} is DINO's choice (model.architecture dino); the authors' heads are "
            "per layer exactly with model.with_box_refine: leave it auto"
        )
    if m.dn_number and m.architecture != "dino":
        return "model.dn_number (contrastive denoising) needs model.architecture dino"
    return None


def check_model(m: ModelConfig):
    """A UsageError (exit 2; a ValueError) where `model_problem` finds one."""
    if problem := model_problem(m):
        raise UsageError(problem)
