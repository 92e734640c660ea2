"""Which backbone a state dict holds: the `model.backbone` name that its keys and shapes show. One reader
per family of models/backbones.py (`READERS`; tests/test_backbone_registry.py checks that each family has
one), each given the body's keys with their prefix (`backbone.0.body.` in a detector, none in ImageNet
weights) removed."""

from collections.abc import Callable
from typing import NamedTuple

from ..errors import ConversionError
from ..models.backbone import ARCHITECTURES
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
