"""Weights from PyTorch into this port's safetensors (`convert`, `save_converted`), and back out to
the authors' layout and Hugging Face's (`export_torch`, `export_huggingface`). Every key is mapped or
refused: an unknown or missing key is an error naming it, and an export is converted back and
checked to give every tensor unchanged before it is written."""

import json
from pathlib import Path

import numpy as np

from ..config import CONFIGS_DIR, ModelConfig, load_config, model_overrides
from ..data.coco import COCO_CATEGORY_NAMES
from ..errors import ConversionError, optional
from ..models import build_model
from ..models.backbones import build_backbone
from ..models.swin import architecture_name, describe
from . import dino, huggingface
from .authors import (
    authors_args,
    config_for,
    expected_shapes,
    model_options,
    read_checkpoint,
    sanitize,
    to_authors,
    torchvision_resnet_to_backbone,
)
from .backbones import backbone_family_in, backbone_in, detect_architecture
from .files import CONFIG_FILE_KEY, MODEL_OPTIONS_KEY, atomic_write, save_weights, write_safetensors
from .swin import swin_imagenet_to_body


def convert(src: Path, backbone_only: bool = False, dilation: bool = False, source=None) -> tuple[dict, dict, str]:
    """Read, map and check a checkpoint (`source`: its name in messages, default `src`): the authors'
    `.pth` (or a bare state_dict; H-Deformable-DETR's too), Hugging Face weights (a file or its folder), or with
    `backbone_only` ImageNet weights: torchvision's ResNets, Swin Transformers in Microsoft's or timm's layout.
    Returns the weights (for `model.load_weights`), the model options they need (`model_overrides(options)` for
    `load_config`) and a message naming the variant and the config."""
    state, ckpt_args = read_checkpoint(src)
    source = str(source or src)
    imagenet = {k.removeprefix("module."): v for k, v in state.items()} if backbone_only else {}
    if backbone_family_in(imagenet) == "swin":
        arch = detect_architecture(imagenet, source)
        name = architecture_name(arch)
        if name is None:
            raise ConversionError(f"{source}: holds {describe(arch)}: no backbone of this project has its shape")
        body = {f"backbone.0.body.{k}": v for k, v in swin_imagenet_to_body(state, name, source).items()}
        return body, {"backbone": name}, f"backbone: {name} (ImageNet weights: {describe(arch)})"
    if backbone_only:
        state = torchvision_resnet_to_backbone(state, source)
        name = backbone_in(state)
        if name == "unknown":
            raise ConversionError(f"{source}: not a ResNet-18/34/50/101 state_dict")
        body = build_backbone(ModelConfig(backbone=name)).body
        expected = {f"backbone.0.body.{k}": v for k, v in expected_shapes(body).items()}
        return sanitize(state, expected, source), {"backbone": name}, f"backbone: {name} (backbone-only weights)"
    if huggingface.is_huggingface(state):
        ckpt_args = huggingface.read_config(Path(src))
        state = huggingface.untie_heads(huggingface.huggingface_to_authors(state, source), ckpt_args)
    detrex = dino.is_detrex(state)
    state = dino.from_detrex(state, source) if detrex else state
    layout = dino if dino.is_dino(state) else None  # DINO's main.py layout (detrex's mapped to it), or the authors'
    options = dino.model_options(state, ckpt_args, source, detrex) if layout else model_options(state, ckpt_args)
    options["dilation"] = options.get("dilation", False) or dilation
    model = build_model(load_config(None, model_overrides(options)))
    weights = (dino.sanitize if layout else sanitize)(state, expected_shapes(model), source)
    config_name = config_file_for(options)
    file_options = load_config(CONFIGS_DIR / config_name).model
    differing = {k: v for k, v in options.items() if getattr(file_options, k) != v}
    kind = "DINO, " if layout else ""
    kind += ("two-stage, " if options["two_stage"] else "") + ("box refinement, " if options["with_box_refine"] else "")
    message = (
        f"variant: {options['backbone']}, {kind}{options['num_feature_levels']} feature level(s)"
        f"{', DC5' if options['dilation'] else ''}\nconfig: configs/{config_name}"
        + (f" with {' '.join(model_overrides(differing))}" if differing else "")
    )
    return weights, options, message


def config_file_for(options: dict) -> str:
    """The configs/ file a converted model's options match: DINO's recipe for a DINO model, else the authors' (or
    H-Deformable-DETR's) configuration."""
    return dino.config_for(options) if options.get("architecture") == "dino" else config_for(options)


def class_names_for(weights: dict, src) -> tuple[dict, str]:
    """({category id: name}, where they come from): a Hugging Face config.json's `id2label` where it
    names them (not transformers' placeholders LABEL_i, nor "N/A" for COCO's unused ids); else COCO's
    when the weights have COCO's 91 class outputs (the authors' released checkpoints); else none."""
    labels = huggingface.read_config(Path(src)).get("id2label", {}) if Path(src).exists() else {}
    named = {int(i): str(n) for i, n in labels.items() if str(n) not in {f"LABEL_{i}", "N/A"}}
    if named:
        return named, f"the {len(named)} of config.json's id2label"
    head = weights.get("class_embed.0.bias")
    if head is not None and head.shape[0] == 91:
        return dict(COCO_CATEGORY_NAMES), f"the {len(COCO_CATEGORY_NAMES)} COCO categories at their ids"
    return {}, ""


def save_converted(dst, weights: dict, options: dict, src) -> tuple[dict, str]:
    """Converted weights with what they are: their category names and, for a whole model, its options
    and the config it matches (so eval and predict need no --config). -> class_names_for's answer."""
    names, where = class_names_for(weights, src)
    model = "two_stage" in options  # not backbone-only weights
    metadata = {MODEL_OPTIONS_KEY: json.dumps(options), CONFIG_FILE_KEY: config_file_for(options)} if model else {}
    save_weights(dst, weights, names, metadata)
    return names, where


def _check_round_trip(back: dict, weights: dict, source):
    if back.keys() != weights.keys() or any(not np.array_equal(back[k], weights[k]) for k in weights):
        raise ConversionError(f"{source}: the exported weights do not convert back to the same weights")


def export_torch(weights: dict, model_config: dict, dst: Path, source="the model") -> str:
    """This port's `weights` (numpy, by parameter name) of a model of `model_config` (ModelConfig as a
    dict) -> `dst`, `{"model": state_dict, "args": Namespace}` as the authors' `main.py` saves it (DINO's main.py
    for a DINO model): their key names, convolutions OIHW, the tied keys restored; `args` the model options the
    keys cannot show (DINO's: all their build_dino reads). Needs PyTorch. -> a one-line summary."""
    torch = optional("torch", "convert", "exporting to PyTorch")
    layout = dino if model_config.get("architecture") == "dino" else None
    state = dino.to_dino(weights) if layout else to_authors(weights)
    _check_round_trip((dino.sanitize if layout else sanitize)(state, source=str(source)), weights, source)
    checkpoint = {"model": {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}}
    checkpoint["args"] = dino.dino_args(model_config, weights) if layout else authors_args(model_config)
    with atomic_write(dst) as tmp:
        torch.save(checkpoint, tmp)
    whose = "DINO's" if layout else "the authors'"
    return f"wrote {len(state)} tensors ({len(weights)} distinct) in {whose} layout to {dst}"


def export_huggingface(weights: dict, config: dict, names: dict, out_dir: Path, backbone="timm", source="the model"):
    """This port's `weights` of a model of `config` (a Config as a dict) with its category `names` ->
    `out_dir`/config.json, preprocessor_config.json and model.safetensors for transformers'
    `DeformableDetrForObjectDetection.from_pretrained(out_dir)` and its pipelines; the ResNet under
    timm's names (`backbone="timm"`, as the Hub's SenseTime models) or transformers' own. -> a summary."""
    model = {**config["model"], "num_classes": int(weights["class_embed.0.bias"].shape[0])}
    if model.get("architecture") == "dino":
        raise ConversionError(
            f"{source}: transformers has no DINO model (its request is open): --to torch writes DINO's layout, which "
            "their main.py loads"
        )
    if model.get("mixed_selection") or model.get("num_queries_one2many"):
        raise ConversionError(
            f"{source}: transformers' DeformableDetr has no H-Deformable-DETR model (mixed selection, the hybrid "
            "branch's queries): --to torch writes their layout, which their main.py loads"
        )
    hf_config = huggingface.config_json(model, names, backbone)
    processor = huggingface.image_processor_config(config["data"])
    hf_state = huggingface.to_huggingface(to_authors(weights), backbone)
    _check_round_trip(sanitize(huggingface.huggingface_to_authors(hf_state), source=str(source)), weights, source)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, content in (("config.json", hf_config), ("preprocessor_config.json", processor)):
        with atomic_write(out_dir / name) as tmp:
            tmp.write_text(json.dumps(content, indent=2))
    write_safetensors(out_dir / "model.safetensors", hf_state, {"format": "pt"})
    files = "config.json, preprocessor_config.json and model.safetensors"
    return f"wrote {files} ({len(hf_state)} tensors, {backbone}'s ResNet names) to {out_dir}"
