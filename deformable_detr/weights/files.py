"""The weights files themselves: training checkpoints (`checkpoint.py`), converted weights
(`conversion.py`), exported ones. One writer makes each of them appear whole or not at all; one
reader opens the safetensors ones, whose metadata carry the category names (and, in a checkpoint,
the optimizer state, progress, config and EMA). Local files only: `loading.py` resolves hf://."""

import json
import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_unflatten

from ..errors import WriteError

CLASS_NAMES_KEY = "category_names"  # safetensors metadata: JSON {category id: name}
MODEL_OPTIONS_KEY = "model_options"  # converted weights: JSON of the ModelConfig fields they need
CONFIG_FILE_KEY = "config_file"  # converted weights: the configs/ file of the authors' they match


@contextmanager
def atomic_write(path):
    """Yield a temporary path beside `path` to write the file to; then flush it to the disk and
    rename it over `path`, and sync the directory: a crash, a kill or a power cut at any moment
    leaves either the previous file or the new one, never a part of one."""
    path = Path(path)
    tmp = path.with_name(f"{path.stem}.tmp{path.suffix}")  # beside it: the rename stays on one file system
    try:
        with write_errors_named(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            yield tmp
            _fsync(tmp)
            os.replace(tmp, path)
            _fsync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def write_errors_named(path):
    """An OSError while writing `path` (a full disk, a quota, a read-only file system) -> a WriteError
    naming `path` and the system's reason, the errno's text: one line, where the OSError names no file."""
    try:
        yield
    except OSError as error:
        raise WriteError(path, error.strerror or str(error)) from error


def _fsync(path: Path):
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_safetensors(path, arrays: dict, metadata: dict):
    """`arrays` (MLX or numpy, by name) and string `metadata` as one safetensors file, atomically."""
    arrays = {k: v if isinstance(v, mx.array) else mx.array(np.ascontiguousarray(v)) for k, v in arrays.items()}
    with atomic_write(path) as tmp, open(tmp, "wb") as file:
        # Through a Python file: a failed write is an OSError with the system's reason (MLX's own
        # writer says "[write] Unable to write N bytes to file." alone). The same bytes, as fast.
        mx.save_safetensors(file, arrays, metadata=metadata)


def read_metadata(path) -> dict:
    """The string metadata of a safetensors file, from its header alone (a checkpoint's progress
    without reading its tensors); a file that is not one is a ValueError naming it."""
    with open(path, "rb") as file:
        start = file.read(8)
        length = struct.unpack("<Q", start)[0] if len(start) == 8 else 0
        header = file.read(length) if 0 < length < 100_000_000 else b""  # safetensors' own bound on a header
    try:
        metadata = json.loads(header)["__metadata__"] if header else None
    except (ValueError, KeyError, TypeError):
        metadata = None
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: not a readable safetensors file with metadata")
    return metadata


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
    """The weights file at `path` (local: `loading.open_weights` takes hf:// too)."""
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
