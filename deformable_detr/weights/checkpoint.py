"""Training checkpoints: the model and optimizer (and the EMA of the weights), with the progress and
config as metadata. No RNG state: each step seeds MLX's generator from (seed, step), and the data
order and augmentations come from (seed, epoch, index), so a resumed run draws what the uninterrupted
one would."""

import json

from mlx.utils import tree_flatten

from ..config import Config, config_to_dict
from .files import class_names_metadata, read_metadata, read_weights, write_safetensors
from .loading import check_keys

CONFIG_CHANGES_KEY = "config_changes"


def save_checkpoint(path, model, optimizer, cfg: Config, progress: dict, class_names: dict, ema=None, changes=()):
    """`progress` (JSON-able: epoch, step, global_step, ...) and `class_names` (the training set's
    {id: name}, for prediction and fine-tuning) travel with the weights, and the `ema`
    (training.ema.EMA), and the `changes` made to the config by resumes (training/resume_check.py)."""
    arrays = {f"model.{k}": v for k, v in tree_flatten(model.parameters())}
    arrays.update({f"optimizer.{k}": v for k, v in tree_flatten(optimizer.state)})
    metadata = {
        "progress": json.dumps(progress),
        "config": json.dumps(config_to_dict(cfg)),
        **class_names_metadata(class_names),
    }
    if changes:
        metadata[CONFIG_CHANGES_KEY] = json.dumps(list(changes))
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


def saved_progress(path) -> dict:
    """A training checkpoint's progress (epoch, step, global_step, ...), from its header alone."""
    metadata = read_metadata(path)
    if "progress" not in metadata:
        raise ValueError(f"{path}: not a training checkpoint (no progress metadata)")
    return json.loads(metadata["progress"])


def saved_config(path) -> tuple[dict | None, list]:
    """A training checkpoint's config (None: it records none) and the changes resumes made to it
    (`save_checkpoint`), from its header alone."""
    metadata = read_metadata(path)
    config = json.loads(metadata["config"]) if "config" in metadata else None
    return config, json.loads(metadata.get(CONFIG_CHANGES_KEY, "[]"))
