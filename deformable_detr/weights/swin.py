"""ImageNet Swin weights into the Swin backbone's names (HDETR's, models/swin.py), from the two layouts
they come in:

- Microsoft's release (`swin_tiny_patch4_window7_224.pth`, ..., HDETR's `--pretrained_backbone_path`):
  `{"model": state}`, patch merging `layers.{i}.downsample.*` at the end of stage i, the classifier
  `head.*` and final `norm.*`, buffers `relative_position_index` and (classification models) `attn_mask`;
- timm's (>= 0.9, `model.safetensors` / `pytorch_model.bin` on the Hugging Face hub): the same names
  but patch merging at the start of the next stage (timm `layers.{i + 1}.downsample.*` is Microsoft's
  `layers.{i}.downsample.*`) and the classifier `head.fc.*`; no buffers. (timm before 0.9 wrote
  Microsoft's layout with `head.*`: read as Microsoft's.)

The classifier and final norm are dropped, the buffers too, the patch embedding's convolution goes
OIHW -> OHWI. `norm1`..`norm3` (the detection outputs' norms) are in neither file: they start at 1 and
0, as HDETR's init_weights leaves them before its non-strict load. The architecture is read from the
shapes (embed dim, blocks per stage, heads and window from the bias tables) and must be the one asked
for: HDETR's loader would resize a bias table of another window bicubically without a word; here it is
an error that says what the file holds."""

import re
from pathlib import Path

import numpy as np

from ..errors import ConversionError
from ..models.swin import (
    OUT_INDICES,
    SwinTransformer,
    architecture,
    describe,
    is_buffer,
    relative_position_index,
    window_of,
)
from .authors import expected_shapes as parameter_shapes
from .authors import read_checkpoint
from .backbones import detect_architecture

CLASSIFIER = re.compile(r"(head|norm)\.")  # the classifier (head.*, head.fc.*) and the final norm


def expected_shapes(name) -> dict:
    """{key: shape} of the Swin body's parameters (MLX layout), in HDETR's order, for an architecture
    (a SWIN_ARCHITECTURES name or a SwinArchitecture): those of the body, built for them (MLX is lazy: no
    weight is computed, but its initial values are drawn from MLX's random stream, as any model's)."""
    return parameter_shapes(SwinTransformer(name))


def _timm_layout(state: dict) -> bool:
    """timm >= 0.9 puts patch merging at the start of stages 1..3: no layers.0.downsample."""
    return "head.fc.weight" in state or (
        not any(k.startswith("layers.0.downsample.") for k in state)
        and any(k.startswith("layers.1.downsample.") for k in state)
    )


def swin_imagenet_to_body(state: dict, name, source: str = "checkpoint") -> dict:
    """An ImageNet Swin state (numpy arrays; Microsoft's or timm's names) -> the Swin body's weights
    ({HDETR key: array}, MLX layout, float32) for architecture `name`: every key mapped or refused."""
    asked = architecture(name)
    state = {k.removeprefix("module."): v for k, v in state.items()}
    timm = _timm_layout(state)
    renamed = {}
    for key, value in state.items():
        if is_buffer(key) or CLASSIFIER.match(key):
            continue
        if timm:  # timm layers.{i + 1}.downsample = Microsoft's (and HDETR's) layers.{i}.downsample
            key = re.sub(r"^layers\.(\d+)\.downsample\.", lambda m: f"layers.{int(m[1]) - 1}.downsample.", key)
        renamed[key] = value
    found = detect_architecture(renamed, source)
    if found[:4] != asked[:4]:
        wanted = name if isinstance(name, str) else describe(asked)
        raise ConversionError(f"{source}: holds {describe(found)}, not the {wanted} asked for")
    weights = {}
    for key, value in renamed.items():
        value = np.asarray(value, np.float32)
        if value.ndim == 4 and value.shape[1] == 3:  # the patch embedding, OIHW -> OHWI
            value = value.transpose(0, 2, 3, 1)
        weights[key] = np.ascontiguousarray(value)
    expected = expected_shapes(asked)
    for i in OUT_INDICES:  # not in ImageNet weights: HDETR's initial values
        weights.setdefault(f"norm{i}.weight", np.ones(expected[f"norm{i}.weight"], np.float32))
        weights.setdefault(f"norm{i}.bias", np.zeros(expected[f"norm{i}.bias"], np.float32))
    layout = "timm" if timm else "Microsoft"
    unexpected = [k for k in weights if k not in expected]
    missing = [k for k in expected if k not in weights]
    if unexpected or missing:
        raise ConversionError(
            f"{source}: not a {layout}-layout Swin state: {_first('unexpected', unexpected)}"
            f"{'; ' if unexpected and missing else ''}{_first('missing', missing)}"
        )
    for key, shape in expected.items():
        if weights[key].shape != shape:
            raise ConversionError(f"{source}: {key} has shape {weights[key].shape}; expected {shape}")
    return {key: weights[key] for key in expected}


def _first(what: str, keys: list, shown: int = 3) -> str:
    if not keys:
        return ""
    more = f" (and {len(keys) - shown} more)" if len(keys) > shown else ""
    return f"{what} keys {', '.join(keys[:shown])}{more}"


def read_swin_imagenet(path, name, prefix: str = "") -> dict:
    """A Swin ImageNet file (`.pth` / `.bin` read with torch, weights only; `.safetensors`; or a folder
    holding either) -> {prefix + key: array} for architecture `name`. `prefix`: "body." for a
    SwinBackbone, "backbone.0.body." for the detector."""
    state, _ = read_checkpoint(Path(path))
    return {prefix + k: v for k, v in swin_imagenet_to_body(state, name, str(path)).items()}


def swin_buffers(state: dict) -> dict:
    """The buffers a Swin's PyTorch modules (HDETR's, DINO's) hold beside its parameters, which they load strict
    only with: for each bias table in `state` (numpy, by key, any prefix), its block's `relative_position_index`
    (int64, as torch registers it), from the table's window."""
    buffers = {}
    for key, value in state.items():
        if key.endswith(".attn.relative_position_bias_table"):
            index = np.array(relative_position_index(window_of(value)), np.int64)
            buffers[key.removesuffix("relative_position_bias_table") + "relative_position_index"] = index
    return buffers
