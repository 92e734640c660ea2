"""Weights into a model: a trained model with its config (`load_trained_model`, `config_from_weights`),
some of a model's weights (`load_model_weights`), weights of other classes to fine-tune
(`load_for_finetuning`). Wherever weights are taken, `hf://ORG/NAME[@REVISION]` works (`hub.py`)."""

import re

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..config import CONFIGS_DIR, Config, load_config, model_overrides
from ..data.classes import class_key
from ..errors import UsageError
from ..models import build_model
from .files import WeightsFile, read_weights
from .hub import local_weights

# The tensors with a row per class: the class heads (DINO's encoder's too) and DINO's label embedding (its rows beyond
# the classes' never read), whose rows fine-tuning carries by category name
CLASS_HEAD = re.compile(
    r"(class_embed\.\d+\.(weight|bias)|transformer\.enc_out_class_embed\.(weight|bias)|label_enc\.weight)$"
)


def open_weights(reference, raw: bool = False, verify: bool = True) -> WeightsFile:
    """A weights file, or `hf://ORG/NAME[@REVISION]` (converted once, `hub.local_weights`); `verify`:
    as `read_weights`."""
    return read_weights(local_weights(reference), raw, verify)


def open_model_weights(reference, raw: bool = False, verify: bool = True) -> WeightsFile:
    """`open_weights` of a whole Deformable DETR (not, say, backbone-only weights): else an error naming it."""
    weights = open_weights(reference, raw, verify)
    if "class_embed.0.weight" not in weights.tensors or "transformer.level_embed" not in weights.tensors:
        raise ValueError(
            f"{reference}: not Deformable DETR weights (no class_embed.0.weight / transformer.level_embed)"
        )
    return weights


def check_keys(model, weights: dict, path, strict: bool, any_class_count: bool = False):
    """Every tensor of `weights` must be a parameter of `model`, of its shape (with
    `any_class_count`, the class heads of any number of rows); with `strict`, every parameter must
    be there. The error names the file and the first key, in sorted order, that does not match."""
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    for key, value in sorted(weights.items()):
        if key not in shapes:
            raise ValueError(f"{path}: {key} is not a parameter of this config's model")
        other_classes_allowed = any_class_count and CLASS_HEAD.match(key)
        compared = slice(1, None) if other_classes_allowed else slice(None)
        if value.shape[compared] != shapes[key][compared]:
            other_classes = CLASS_HEAD.match(key) and not any_class_count and value.shape[1:] == shapes[key][1:]
            hint = "; weights for other classes: fine-tune from them with train.py --finetune" if other_classes else ""
            raise ValueError(f"{path}: {key} has shape {tuple(value.shape)}; the model's is {tuple(shapes[key])}{hint}")
    missing = sorted(set(shapes) - set(weights))
    if strict and missing:
        raise ValueError(f"{path}: missing key {missing[0]}; is it the checkpoint of this config's model?")


def config_from_weights(path, overrides=()) -> Config:
    """The config a weights file says its model has, for commands given no --config: a training
    checkpoint's own; for converted weights, the authors' configs/ file they match with their model
    options; then `overrides`. Weights that say neither: a UsageError asking for --config."""
    weights = open_model_weights(path, verify=False)  # its header alone: the tensors are checked where read
    if weights.config is not None:
        return load_config(None, overrides, base=weights.config, base_source=f"{path}'s config")
    if weights.model_options is not None:
        return load_config(CONFIGS_DIR / weights.config_file, model_overrides(weights.model_options) + list(overrides))
    raise UsageError(f"{path} does not say which model it holds (converted by an older version?): give --config")


def load_trained_model(path, cfg: Config, raw: bool = False):
    """The model of `cfg` with every weight of `path` (converted weights or a training checkpoint: its
    EMA where it has one, unless `raw`), in evaluation mode; `model.num_classes: auto` takes the class
    count from the weights. -> (model, the category names the file records)."""
    weights = open_model_weights(path, raw)
    if cfg.model.num_classes == "auto":
        if "class_embed.0.bias" not in weights.tensors:
            raise ValueError(f"{path}: no class_embed.0.bias, so model.num_classes cannot be read from it; set it")
        cfg.model.num_classes = weights.tensors["class_embed.0.bias"].shape[0]
    model = build_model(cfg)
    check_keys(model, weights.tensors, path, strict=True)
    model.load_weights(list(weights.tensors.items()))
    model.eval()
    return model, weights.class_names


def load_model_weights(model, path, strict: bool = True) -> int:
    """Load converted weights or the model part of a training checkpoint. Every tensor in the file
    must be a parameter of the model, of its shape; with `strict`, every parameter must be in the
    file too (without it, e.g. a backbone from `convert --backbone-only`, the rest keep their
    initialisation). Errors name the file and key. Returns the number of tensors loaded."""
    weights = open_weights(path).tensors
    check_keys(model, weights, path, strict)
    model.load_weights(list(weights.items()), strict=strict)
    return len(weights)


def load_for_finetuning(model, path, class_names: dict) -> str:
    """Load weights of any number of classes into `model`, whose class heads are for `class_names`
    ({category id: name}, the training set's). Every tensor but the class heads must match the
    model by name and shape (an error names the first that does not). In every class head, the row
    (weight and bias) of a category whose name equals a category name recorded in the file (ignoring
    case and surrounding space: `data.classes.class_key`) is copied from that category's row; every
    other row keeps the model's own initialisation. Returns a one-line summary."""
    source = open_weights(path)
    weights, source_names = dict(source.tensors), source.class_names
    check_keys(model, weights, path, strict=True, any_class_count=True)
    params = dict(tree_flatten(model.parameters()))
    num_classes = params["class_embed.0.bias"].shape[0]
    source_classes = weights["class_embed.0.bias"].shape[0]
    source_ids = {}
    for category, name in sorted(source_names.items()):
        if category < source_classes:
            source_ids.setdefault(class_key(name), category)
    carried = {
        category: source_ids[class_key(name)]
        for category, name in sorted(class_names.items())
        if 0 <= category < num_classes and class_key(name) in source_ids
    }
    targets, sources = np.array(list(carried), np.int32), np.array(list(carried.values()), np.int32)
    for key in (k for k in params if CLASS_HEAD.match(k)):
        rows = np.array(params[key])
        rows[targets] = np.array(weights[key])[sources]
        weights[key] = mx.array(rows)
    model.load_weights(list(weights.items()))

    old = ", ".join(f"{class_names[t]} ({s} -> {t})" for t, s in carried.items()) or "none"
    new = ", ".join(f"{n} ({c})" for c, n in sorted(class_names.items()) if c not in carried) or "none"
    unnamed = "" if source_names else " (the weights record no category names)"
    return (
        f"fine-tuning from {path}: {len(weights)} tensors loaded, class heads rebuilt for {num_classes} outputs; "
        f"carried over by name (id -> id): {old}; new: {new}{unnamed}"
    )
