"""Which model settings go together: `model_problem` states each rule that a model section must keep to be
built (and run), once; `check_model` raises its answer. The commands call it right after reading a
config, before any data, run directory or weights (train.py, Detector.config_for and Detector.load, so
eval, predict, serve and export): a usage error in one line naming both keys, exit 2; `build_model` and
`DeformableDETR` call it too, so a model built from Python is refused by the same rule (a UsageError is a
ValueError). A single key's range is config.py's (its fields' `range` metadata)."""

from ..config import ModelConfig
from ..errors import UsageError
from .backbones import BACKBONES, backbone_family, unknown_backbone

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
    maps = len(BACKBONES[family].backbone.STRIDES)
    if 1 < m.num_feature_levels < maps:
        return (
            f"model.num_feature_levels {m.num_feature_levels}: model.backbone {m.backbone} gives {maps} maps, each a "
            f"level: 1 (its last only), or at least {maps} (the rest made from the last)"
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
    return None


def check_model(m: ModelConfig):
    """A UsageError (exit 2; a ValueError) where `model_problem` finds one."""
    if problem := model_problem(m):
        raise UsageError(problem)
