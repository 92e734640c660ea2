"""Which backbone a state dict holds: the `model.backbone` name that its keys and shapes show. One reader
per family of models/backbones.py (`READERS`; tests/test_backbone_registry.py checks that each family has
one), each given the body's keys with their prefix (`backbone.0.body.` in a detector, none in ImageNet
weights) removed.

DINO's checkpoints (IDEA-Research/DINO) name their backbones and place their bodies their own way: one table
of names (`DINO_BACKBONES`) and one of places (`DINO_BODY`), each read both ways (`backbone_from_dino`,
`backbone_to_dino`, `key_from_dino`, `key_to_dino`)."""

from collections.abc import Callable
from typing import NamedTuple

from ..errors import ConversionError
from ..models.backbone import ARCHITECTURES
from ..models.backbones import backbone_family
from ..models.swin import SwinArchitecture, architecture_name, window_of

BODY = "backbone.0.body."  # the backbone's parameters in a detector's state (the authors' Joiner)
# (bottleneck blocks, blocks in layer3) -> the torchvision ResNet of that shape: each one's are unlike
RESNETS = {(kind == "bottleneck", depths[2]): name for name, (kind, depths) in ARCHITECTURES.items()}


def resnet_name(body: dict) -> str:
    """The torchvision ResNet of a ResNet body's blocks, or "unknown"."""
    blocks = len({k.split(".")[1] for k in body if k.startswith("layer3.")})
    return RESNETS.get(("layer1.0.conv3.weight" in body, blocks), "unknown")


def swin_name(body: dict) -> str:
    """The SWIN_ARCHITECTURES name of a Swin body's shapes, or "unknown" for a Swin of no known name."""
    return architecture_name(detect_architecture(body)) or "unknown"


class Reader(NamedTuple):
    marker: str  # a key that a body of this family has, and no other family's
    name: Callable[[dict], str]  # a body of this family -> its model.backbone name, "unknown" for none


READERS = {  # a family of models/backbones.py's BACKBONES -> how its bodies are told
    "resnet": Reader("layer1.0.conv1.weight", resnet_name),
    "swin": Reader("patch_embed.proj.weight", swin_name),
}


def backbone_family_in(body: dict) -> str | None:
    """The family (a READERS key) whose body `body` (its keys without a prefix) is, or None."""
    return next((family for family, reader in READERS.items() if reader.marker in body), None)


def backbone_in(state: dict, prefix: str = BODY) -> str:
    """The `model.backbone` name of the backbone under `prefix` in `state`; "unknown" where no family
    knows its keys or shapes."""
    body = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    family = backbone_family_in(body)
    return "unknown" if family is None else READERS[family].name(body)


def detect_architecture(state: dict, source: str = "checkpoint") -> SwinArchitecture:
    """The Swin architecture that a Swin body's shapes show (Microsoft's, timm's or HDETR's names; buffers
    and classifier ignored): embed dim, blocks and heads per stage, the window (from the first bias table)."""
    if "patch_embed.proj.weight" not in state:
        raise ConversionError(f"{source}: not a Swin state: no patch_embed.proj.weight")
    depths, heads, windows = [], [], []
    while (table := state.get(f"layers.{len(depths)}.blocks.0.attn.relative_position_bias_table")) is not None:
        blocks = {k.split(".")[3] for k in state if k.startswith(f"layers.{len(depths)}.blocks.")}
        depths.append(len(blocks))
        heads.append(int(table.shape[1]))
        windows.append(window_of(table))
    if not depths:
        raise ConversionError(f"{source}: not a Swin state: no layers.0.blocks.0.attn.relative_position_bias_table")
    embed = int(state["patch_embed.proj.weight"].shape[0])
    return SwinArchitecture(embed, tuple(depths), tuple(heads), windows[0])


# DINO's backbone names (its args.backbone) -> model.backbone. Its Swins are HDETR's architectures (the same
# code, models/swin.py) under names that also say their ImageNet pretraining (1k, 22k: the weights', not the
# model's) and their pretrain_img_size (224, 384: read only by an absolute position embedding, off in both).
# DINO builds no other (its ConvNeXt aside: not built here).
DINO_BACKBONES = {
    "resnet50": "resnet50",
    "resnet101": "resnet101",
    "swin_T_224_1k": "swin_tiny",
    "swin_B_224_22k": "swin_base",
    "swin_B_384_22k": "swin_base_window12",
    "swin_L_224_22k": "swin_large",
    "swin_L_384_22k": "swin_large_window12",
}
# Where DINO's Joiner puts each family's body in its state: its ResNet under `body` (an IntermediateLayerGetter,
# as the authors'); its SwinTransformer is backbone.0 itself. The names below the prefix are ours.
DINO_BODY = {"resnet": BODY, "swin": "backbone.0."}


def backbone_from_dino(name: str, source: str = "checkpoint") -> str:
    """DINO's backbone name -> the model.backbone that builds it; a ConversionError for one not built here."""
    if name not in DINO_BACKBONES:
        known = ", ".join(DINO_BACKBONES)
        raise ConversionError(f"{source}: DINO's backbone {name} is not built here (DINO's {known} are)")
    return DINO_BACKBONES[name]


def backbone_to_dino(name: str) -> str:
    """A model.backbone -> DINO's name of it; a ConversionError for one DINO's code does not build."""
    named = [dino for dino, ours in DINO_BACKBONES.items() if ours == name]
    if not named:
        known = ", ".join(DINO_BACKBONES.values())
        raise ConversionError(f"model.backbone {name}: DINO's code builds no such backbone (it builds {known})")
    return named[0]


def key_from_dino(key: str, backbone: str) -> str:
    """A key of a DINO state whose backbone is model.backbone `backbone` -> ours (the body under BODY); a key
    outside the backbone as it is."""
    prefix = DINO_BODY[backbone_family(backbone)]
    return BODY + key.removeprefix(prefix) if key.startswith(prefix) else key


def key_to_dino(key: str, backbone: str) -> str:
    """`key_from_dino`'s inverse: one of our keys -> DINO's."""
    return DINO_BODY[backbone_family(backbone)] + key.removeprefix(BODY) if key.startswith(BODY) else key


def backbone_in_dino(state: dict) -> str:
    """The model.backbone of the body in a DINO state (its keys; `backbone_in` of each family's place), "unknown"
    where none is there."""
    for family, prefix in DINO_BODY.items():
        body = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
        if backbone_family_in(body) == family:
            return READERS[family].name(body)
    return "unknown"
