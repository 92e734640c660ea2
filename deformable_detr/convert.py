"""Convert PyTorch Deformable DETR weights to this port's safetensors.

    python -m deformable_detr.convert SRC DST.safetensors [--backbone-only]

SRC is one of
- the authors' checkpoint (`.pth`: a dict with `model`, as released, usually also `args`,
  `optimizer`, `epoch`; or a bare state_dict);
- Hugging Face `DeformableDetrForObjectDetection` weights (`model.safetensors` or
  `pytorch_model.bin`, or the folder holding one);
- with `--backbone-only`, torchvision ResNet ImageNet weights (`resnet50-*.pth`), written as a
  backbone-only file that training starts from.

Every key is mapped or refused: an unknown or missing key is an error naming it. Tied keys (the
authors repeat a shared head under several names) are checked equal and stored once. `.pth` files
are read with `torch.load(weights_only=True)`, allowing only `argparse.Namespace` beyond tensors.
torch is needed only for `.pth` / `.bin` input (`pip install -e ".[convert]"`).
"""

import re
from pathlib import Path

import numpy as np


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message says which file and key."""


# ---------------------------------------------------------------------------------------------
# reading


def read_checkpoint(path: Path) -> tuple[dict, dict]:
    """-> (state_dict of numpy arrays, args as a dict or {})."""
    path = Path(path)
    if path.is_dir():
        candidates = [path / "model.safetensors", path / "pytorch_model.bin"]
        found = [c for c in candidates if c.is_file()]
        if not found:
            raise ConversionError(f"{path}: no model.safetensors or pytorch_model.bin in this folder")
        path = found[0]
    if not path.is_file():
        raise ConversionError(f"{path}: no such file")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        try:
            return load_file(str(path)), {}
        except (SafetensorError, OSError, ValueError) as error:
            raise ConversionError(f"{path}: not a readable safetensors file ({error})") from None
    return _read_torch(path)


def _read_torch(path: Path) -> tuple[dict, dict]:
    try:
        import torch
    except ImportError:
        raise ConversionError(
            f"{path}: reading .pth / .bin files needs PyTorch; install it with pip install -e '.[convert]'"
        ) from None
    import argparse as argparse_module
    import pickle
    import zipfile

    try:
        with torch.serialization.safe_globals([argparse_module.Namespace]):
            checkpoint = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        unsafe = re.search(r"GLOBAL ([\w.]+)", str(error))
        what = f"the global {unsafe.group(1)}" if unsafe else "a disallowed object"
        raise ConversionError(
            f"{path}: refused: the pickle asks for {what}; only tensors and argparse.Namespace are allowed"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConversionError(
            f"{path}: not a readable PyTorch checkpoint (truncated or corrupt?): {first_line}"
        ) from None
    if not isinstance(checkpoint, dict):
        raise ConversionError(
            f"{path}: expected a dict (a state_dict or a checkpoint with 'model'), got {type(checkpoint).__name__}"
        )
    args = checkpoint.get("args")
    args = vars(args) if isinstance(args, argparse_module.Namespace) else {}
    state = checkpoint.get("model", checkpoint)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConversionError(f"{path}: expected tensors in its state_dict")
    return {k: v.detach().cpu().numpy() for k, v in state.items()}, args


# ---------------------------------------------------------------------------------------------
# the authors' layout -> this port


def detect_variant(state: dict, args: dict | None = None) -> dict:
    """Model options that the authors' state_dict keys (and `args`, when the checkpoint has them)
    imply: two_stage, with_box_refine, num_feature_levels, dilation, backbone, sizes."""
    args = args or {}
    levels = len({k.split(".")[1] for k in state if k.startswith("input_proj.")})
    dec_layers = len({k.split(".")[3] for k in state if k.startswith("transformer.decoder.layers.")})
    layer3_blocks = len({k.split(".")[4] for k in state if k.startswith("backbone.0.body.layer3.")})
    bottleneck = "backbone.0.body.layer1.0.conv3.weight" in state
    backbone = {(True, 6): "resnet50", (True, 23): "resnet101", (False, 6): "resnet34", (False, 2): "resnet18"}.get(
        (bottleneck, layer3_blocks), "unknown"
    )
    return {
        "backbone": backbone,
        "two_stage": "transformer.enc_output.weight" in state,
        "with_box_refine": any(k.startswith("transformer.decoder.bbox_embed.") for k in state),
        "num_feature_levels": levels,
        "dilation": bool(args.get("dilation", False)),
        "num_classes": int(state["class_embed.0.weight"].shape[0]) if "class_embed.0.weight" in state else None,
        "num_queries": int(state["query_embed.weight"].shape[0])
        if "query_embed.weight" in state
        else args.get("num_queries", 300),
        "dec_layers": dec_layers,
    }


def config_for(variant: dict) -> str:
    """The configs/ file of the authors' configuration a variant matches."""
    if variant["two_stage"]:
        return "configs/r50_two_stage.yaml"
    if variant["with_box_refine"]:
        return "configs/r50_box_refine.yaml"
    if variant["num_feature_levels"] == 1:
        return "configs/r50_single_scale_dc5.yaml" if variant["dilation"] else "configs/r50_single_scale.yaml"
    return "configs/r50.yaml"


def sanitize(state: dict, expected: dict | None = None, source: str = "checkpoint") -> dict:
    """The authors' state_dict (numpy arrays) -> this port's weights.

    Drops tied duplicates after checking them equal (shared heads without refinement; the decoder's
    references to the top-level heads), drops `num_batches_tracked`, transposes convolution weights
    OIHW -> OHWI (idempotent: only 4-d weights whose last axis is not already the input channels).
    With `expected` ({key: shape} of the model), every key must match: missing and unknown keys are
    errors that name them."""
    variant = detect_variant(state)
    out = {}
    for key, value in state.items():
        if key.endswith("num_batches_tracked"):
            continue
        twin = _tied_twin(key, variant)
        if twin is not None:
            if twin not in state:
                raise ConversionError(f"{source}: {key} is tied to {twin}, which is missing")
            if not np.array_equal(state[twin], value):
                raise ConversionError(f"{source}: {key} should be tied to {twin} but differs from it")
            continue
        if value.ndim == 4 and expected is not None and key in expected:
            if tuple(expected[key]) != tuple(value.shape):
                value = value.transpose(0, 2, 3, 1)
        elif value.ndim == 4 and expected is None:
            value = value.transpose(0, 2, 3, 1)
        out[key] = np.ascontiguousarray(value)
    if expected is not None:
        check_keys(out, expected, source)
    return out


def _tied_twin(key: str, variant: dict) -> str | None:
    """The key a tied duplicate shares its value with, or None for a key stored as it is."""
    match = re.match(r"transformer\.decoder\.(class_embed|bbox_embed)\.(.*)", key)
    if match:
        return f"{match.group(1)}.{match.group(2)}"
    match = re.match(r"(class_embed|bbox_embed)\.(\d+)\.(.*)", key)
    if match and not variant["with_box_refine"] and match.group(2) != "0":
        return f"{match.group(1)}.0.{match.group(3)}"
    return None


def check_keys(weights: dict, expected: dict, source: str):
    missing = sorted(set(expected) - set(weights))
    unknown = sorted(set(weights) - set(expected))
    if unknown:
        raise ConversionError(
            f"{source}: unknown key {unknown[0]}" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
        )
    if missing:
        raise ConversionError(
            f"{source}: missing key {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    for key, shape in expected.items():
        if tuple(weights[key].shape) != tuple(shape):
            raise ConversionError(f"{source}: {key} has shape {tuple(weights[key].shape)}; expected {tuple(shape)}")


def expected_shapes(model) -> dict:
    from mlx.utils import tree_flatten

    return {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
