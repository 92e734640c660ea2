"""Weight files: converted weights (`convert`) and training checkpoints (`train.py`), both
safetensors, both carrying their category names in the metadata. Loading them whole, and loading
them to fine-tune on other classes."""

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

CLASS_NAMES_KEY = "category_names"  # safetensors metadata: JSON {category id: name}
CLASS_HEAD = re.compile(r"class_embed\.\d+\.(weight|bias)$")


def class_names_metadata(names: dict) -> dict:
    """{category id: name} as safetensors metadata (strings only)."""
    return {CLASS_NAMES_KEY: json.dumps({str(k): v for k, v in sorted(names.items())})} if names else {}


def open_safetensors(path, kind: str = "weights", readable_as: str = "safetensors file") -> tuple[dict, dict]:
    """-> (arrays, metadata) of a safetensors file; a missing or unreadable one is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{kind} not found: {path}")
    try:
        return mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"{path}: not a readable {readable_as} ({error})") from None


def read_weights(path) -> tuple[dict, dict]:
    """-> (the model's tensors by parameter name, {category id: name} or {} when not recorded).
    A training checkpoint's optimizer state is left out."""
    weights, metadata = open_safetensors(path)
    if any(k.startswith("model.") for k in weights):  # a training checkpoint
        weights = {k[len("model.") :]: v for k, v in weights.items() if k.startswith("model.")}
    try:
        names = {int(k): str(v) for k, v in json.loads(metadata.get(CLASS_NAMES_KEY, "{}")).items()}
    except (ValueError, AttributeError):
        raise ValueError(f"{path}: unreadable {CLASS_NAMES_KEY} metadata") from None
    return weights, names


def read_class_names(path) -> dict:
    """{category id: name} recorded in a weights file, {} when none."""
    return read_weights(path)[1]


def num_classes_of(path) -> int:
    """The number of class outputs of the weights in `path` (for `model.num_classes: auto`)."""
    weights, _ = read_weights(path)
    if "class_embed.0.bias" not in weights:
        raise ValueError(f"{path}: no class_embed.0.bias, so model.num_classes cannot be read from it; set it")
    return weights["class_embed.0.bias"].shape[0]


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


def load_model_weights(model, path, strict: bool = True) -> int:
    """Load converted weights or the model part of a training checkpoint. Every tensor in the file
    must be a parameter of the model, of its shape; with `strict`, every parameter must be in the
    file too (without it, e.g. a backbone from `convert --backbone-only`, the rest keep their
    initialisation). Errors name the file and key. Returns the number of tensors loaded."""
    weights, _ = read_weights(path)
    check_keys(model, weights, path, strict)
    model.load_weights(list(weights.items()), strict=strict)
    return len(weights)


def load_for_finetuning(model, path, class_names: dict) -> str:
    """Load weights of any number of classes into `model`, whose class heads are for `class_names`
    ({category id: name}, the training set's). Every tensor but the class heads must match the
    model by name and shape (an error names the first that does not). In every class head, the row
    (weight and bias) of a category whose name equals, ignoring case, a category name recorded in
    the file is copied from that category's row; every other row keeps the model's own
    initialisation. Returns a one-line summary."""
    weights, source_names = read_weights(path)
    check_keys(model, weights, path, strict=True, any_class_count=True)
    params = dict(tree_flatten(model.parameters()))
    num_classes = params["class_embed.0.bias"].shape[0]
    source_classes = weights["class_embed.0.bias"].shape[0]
    source_ids = {}
    for category, name in sorted(source_names.items()):
        if category < source_classes:
            source_ids.setdefault(name.casefold(), category)
    carried = {
        category: source_ids[name.casefold()]
        for category, name in sorted(class_names.items())
        if 0 <= category < num_classes and name.casefold() in source_ids
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
