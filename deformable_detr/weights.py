"""Every weights file: training checkpoints (`train.py`), converted weights (`convert`), exported ones
(`export`). One writer makes each of them appear whole or not at all; one reader opens the
safetensors ones, whose metadata carry the category names (and, in a checkpoint, the progress and
config). Loading a trained model, loading some of a model's weights, and loading weights of other
classes to fine-tune are here too."""

import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .config import Config, config_to_dict

CLASS_NAMES_KEY = "category_names"  # safetensors metadata: JSON {category id: name}
MODEL_OPTIONS_KEY = "model_options"  # converted weights: JSON of the ModelConfig fields they need
CONFIG_FILE_KEY = "config_file"  # converted weights: the configs/ file of the authors' they match
CLASS_HEAD = re.compile(r"class_embed\.\d+\.(weight|bias)$")


# ---------------------------------------------------------------------------------------------
# writing and reading files


@contextmanager
def atomic_write(path):
    """Yield a temporary path beside `path` to write the file to; then flush it to the disk and
    rename it over `path`, and sync the directory: a crash, a kill or a power cut at any moment
    leaves either the previous file or the new one, never a part of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.tmp{path.suffix}")  # the same suffix: mx.save_safetensors insists on it
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync(path: Path):
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_safetensors(path, arrays: dict, metadata: dict):
    """`arrays` (MLX or numpy, by name) and string `metadata` as one safetensors file, atomically."""
    arrays = {k: v if isinstance(v, mx.array) else mx.array(np.ascontiguousarray(v)) for k, v in arrays.items()}
    with atomic_write(path) as tmp:
        mx.save_safetensors(str(tmp), arrays, metadata=metadata)


def open_safetensors(path) -> tuple[dict, dict]:
    """-> (arrays, metadata) of a safetensors file; a missing or unreadable one is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        return mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error})") from None


@dataclass
class WeightsFile:
    """What a weights file holds: the model's tensors by parameter name (the EMA of the weights where
    the file has one, unless read `raw`), the category names ({id: name}, {} when not recorded) and,
    in a training checkpoint, the optimizer state, progress, config, and the EMA with its updates."""

    path: Path
    tensors: dict
    class_names: dict
    model_options: dict | None = None  # converted weights: what model they are
    config_file: str | None = None
    optimizer_state: dict | None = None
    progress: dict | None = None
    config: dict | None = None
    ema: dict | None = None
    ema_updates: int = 0


def read_weights(path, raw: bool = False) -> WeightsFile:
    """`path`: a file, or `hf://ORG/NAME[@REVISION]` (converted once, hub.local_weights)."""
    from .hub import local_weights

    path = local_weights(path)
    arrays, metadata = open_safetensors(path)
    try:
        names = {int(k): str(v) for k, v in json.loads(metadata.get(CLASS_NAMES_KEY, "{}")).items()}
    except (ValueError, AttributeError):
        raise ValueError(f"{path}: unreadable {CLASS_NAMES_KEY} metadata") from None
    if "progress" not in metadata:  # converted weights: the model's tensors alone
        options = json.loads(metadata[MODEL_OPTIONS_KEY]) if MODEL_OPTIONS_KEY in metadata else None
        return WeightsFile(Path(path), arrays, names, options, metadata.get(CONFIG_FILE_KEY))

    def part(prefix):
        return {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}

    ema = part("ema.") or None
    tensors = part("model.") if raw or ema is None else ema
    config = json.loads(metadata["config"]) if "config" in metadata else None
    updates = json.loads(metadata.get("ema", "{}")).get("updates", 0)
    state = tree_unflatten(list(part("optimizer.").items()))
    progress = json.loads(metadata["progress"])
    return WeightsFile(
        Path(path),
        tensors,
        names,
        optimizer_state=state,
        progress=progress,
        config=config,
        ema=ema,
        ema_updates=updates,
    )


def class_names_metadata(names: dict) -> dict:
    """{category id: name} as safetensors metadata (strings only)."""
    return {CLASS_NAMES_KEY: json.dumps({str(k): v for k, v in sorted(names.items())})} if names else {}


def save_weights(path, tensors: dict, class_names: dict | None = None, metadata: dict | None = None):
    """Converted weights: the model's tensors by parameter name, with their category names."""
    write_safetensors(path, tensors, {**class_names_metadata(class_names or {}), **(metadata or {})})


# ---------------------------------------------------------------------------------------------
# training checkpoints: the model and optimizer, with the progress and config as metadata. No RNG
# state: each step seeds MLX's generator from (seed, step), and the data order and augmentations
# come from (seed, epoch, index), so a resumed run draws what the uninterrupted one would.


def save_checkpoint(path, model, optimizer, cfg: Config, progress: dict, class_names: dict, ema=None):
    """`progress` (JSON-able: epoch, step, global_step, ...) and `class_names` (the training set's
    {id: name}, for prediction and fine-tuning) travel with the weights, and the `ema` (engine.EMA)."""
    arrays = {f"model.{k}": v for k, v in tree_flatten(model.parameters())}
    arrays.update({f"optimizer.{k}": v for k, v in tree_flatten(optimizer.state)})
    metadata = {
        "progress": json.dumps(progress),
        "config": json.dumps(config_to_dict(cfg)),
        **class_names_metadata(class_names),
    }
    if ema is not None:
        arrays.update({f"ema.{k}": v for k, v in ema.weights.items()})
        metadata["ema"] = json.dumps({"updates": ema.updates, "decay": ema.decay})
    write_safetensors(path, arrays, metadata)


def load_checkpoint(path, trainer) -> dict:
    """Restore the model, optimizer and EMA of `trainer` from a training checkpoint; return its
    progress."""
    weights = read_weights(path, raw=True)
    if weights.progress is None:
        raise ValueError(
            f"{path}: not a training checkpoint (no progress metadata); to start from weights, use --weights"
        )
    check_keys(trainer.model, weights.tensors, path, strict=True)
    trainer.model.load_weights(list(weights.tensors.items()))
    trainer.optimizer.state = weights.optimizer_state
    if trainer.ema is not None:  # the file's, or one starting here
        if weights.ema is not None:
            check_keys(trainer.model, weights.ema, path, strict=True)
        trainer.ema.start(trainer.model, weights.ema and dict(weights.ema), weights.ema_updates)
    return weights.progress


# ---------------------------------------------------------------------------------------------
# weights into a model


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
    from .cli import UsageError
    from .config import CONFIGS_DIR, load_config
    from .convert import overrides as model_overrides

    weights = read_weights(path)
    if weights.config is not None:
        return load_config(None, overrides, base=weights.config, base_source=f"{path}'s config")
    if weights.model_options is not None:
        return load_config(CONFIGS_DIR / weights.config_file, model_overrides(weights.model_options) + list(overrides))
    raise UsageError(f"{path} does not say which model it holds (converted by an older version?): give --config")


def load_trained_model(path, cfg: Config, raw: bool = False):
    """The model of `cfg` with every weight of `path` (converted weights or a training checkpoint: its
    EMA where it has one, unless `raw`), in evaluation mode; `model.num_classes: auto` takes the class
    count from the weights. -> (model, the category names the file records)."""
    from .model import build_model

    weights = read_weights(path, raw)
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
    weights = read_weights(path).tensors
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
    source = read_weights(path)
    weights, source_names = dict(source.tensors), source.class_names
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
