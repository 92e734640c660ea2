"""The weights files themselves: training checkpoints (`checkpoint.py`), converted weights
(`conversion.py`), exported ones. One writer makes each of them appear whole or not at all; one
reader opens the safetensors ones, whose metadata carry the category names (and, in a checkpoint,
the optimizer state, progress, config and EMA) and the SHA-256 of each tensor, checked as it is read.
Local files only: `loading.py` resolves hf://."""

import hashlib
import json
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
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
CHECKSUMS_KEY = "tensor_sha256"  # every file written here: JSON {tensor name: `tensor_digest`}
# The dtype names safetensors headers use, of the MLX dtypes mx.save_safetensors writes (not float64)
SAFETENSORS_DTYPES = {mx.bool_: "BOOL", mx.float16: "F16", mx.bfloat16: "BF16", mx.float32: "F32", mx.complex64: "C64"}
SAFETENSORS_DTYPES |= {mx.int8: "I8", mx.int16: "I16", mx.int32: "I32", mx.int64: "I64"}
SAFETENSORS_DTYPES |= {mx.uint8: "U8", mx.uint16: "U16", mx.uint32: "U32", mx.uint64: "U64"}


@contextmanager
def atomic_write(path):
    """Yield a temporary path beside `path` to write the file to; then flush it to the disk and
    rename it over `path`, and sync the directory: a crash, a kill or a power cut at any moment
    leaves either the previous file or the new one, never a part of one."""
    path = Path(path)
    tmp = temporary_path(path)
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


def temporary_path(path: Path) -> Path:
    """Where `atomic_write` writes `path` first: beside it, so the rename stays on one file system
    (a run killed while writing leaves it, `RunDirectory.claim` removes it)."""
    return path.with_name(f"{path.stem}.tmp{path.suffix}")


def _fsync(path: Path):
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_safetensors(path, arrays: dict, metadata: dict):
    """`arrays` (MLX or numpy, by name) and string `metadata` as one safetensors file, atomically,
    with each tensor's SHA-256 in the metadata (`tensor_checksums`)."""
    arrays = {k: v if isinstance(v, mx.array) else mx.array(np.ascontiguousarray(v)) for k, v in arrays.items()}
    metadata = {**metadata, CHECKSUMS_KEY: json.dumps(tensor_checksums(arrays))}
    with atomic_write(path) as tmp, open(tmp, "wb") as file:
        # Through a Python file: a failed write is an OSError with the system's reason (MLX's own
        # writer says "[write] Unable to write N bytes to file." alone). The same bytes, as fast.
        mx.save_safetensors(file, arrays, metadata=metadata)


def tensor_digest(dtype: str, shape, data) -> str:
    """The SHA-256 of one tensor as a safetensors file holds it: its dtype's name there, its shape and
    its raw bytes (row-major, little-endian). Per tensor, so a mismatch names the tensor; SHA-256, as
    OpenSSL's runs on the CPU's SHA instructions where it has them: 1.7 GB/s a core on this project's
    machine, BLAKE2b 0.9 (bench/checksum.py; an R50 checkpoint's 457 MiB in 0.18 s on 2 cores)."""
    digest = hashlib.sha256(json.dumps([dtype, list(shape)]).encode())
    digest.update(data)
    return digest.hexdigest()


def tensor_checksums(arrays: dict) -> dict:
    """{name: `tensor_digest`} of MLX `arrays`, from their bytes in memory (bfloat16 ones too: viewed
    as bytes, never converted)."""
    mx.eval(list(arrays.values()))
    data = {k: mx.view(v.reshape(-1), mx.uint8) for k, v in arrays.items()}  # a copy only where not contiguous
    mx.eval(list(data.values()))  # here: MLX is not to be run from the hashing threads
    jobs = [(SAFETENSORS_DTYPES.get(v.dtype, str(v.dtype)), v.shape, memoryview(data[k])) for k, v in arrays.items()]
    return dict(zip(arrays, _digests(jobs), strict=True))


def _digests(jobs) -> list:
    """`tensor_digest` of each (dtype, shape, bytes), on every core: hashlib lets go of the GIL."""
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return list(pool.map(lambda job: tensor_digest(*job), jobs))


def read_header(path) -> tuple[dict, int]:
    """-> (the JSON header of a safetensors file, where its data starts); a file that is not one is
    a ValueError naming it."""
    with open(path, "rb") as file:
        start = file.read(8)
        length = struct.unpack("<Q", start)[0] if len(start) == 8 else 0
        header = file.read(length) if 0 < length < 100_000_000 else b""  # safetensors' own bound on a header
    try:
        parsed = json.loads(header) if header else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError(f"{path}: not a readable safetensors file")
    return parsed, 8 + length


def read_metadata(path) -> dict:
    """The string metadata of a safetensors file, from its header alone (a checkpoint's progress
    without reading its tensors); a file that is not one is a ValueError naming it."""
    try:
        metadata = read_header(path)[0].get("__metadata__")
    except ValueError:
        metadata = None
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: not a readable safetensors file with metadata")
    return metadata


def verify_checksums(path, metadata: dict):
    """Each tensor of the safetensors file at `path` against the SHA-256 its `metadata` records,
    hashed from the file's bytes: a tensor changed, added or removed since it was written is a
    ValueError naming the file and the first such tensor (by name). A file that records none (the
    authors', Hugging Face's, one written before checksums) passes."""
    if CHECKSUMS_KEY not in metadata:
        return
    try:
        recorded = json.loads(metadata[CHECKSUMS_KEY])
    except ValueError:
        recorded = None
    if not isinstance(recorded, dict):
        raise ValueError(f"{path}: unreadable {CHECKSUMS_KEY} metadata: the file is damaged")
    names = sorted(recorded)
    header, start = read_header(path)
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    damaged = "the file was damaged after it was written (on disk or in a copy); use another copy"
    if entries.keys() != recorded.keys():
        name = min(entries.keys() ^ recorded.keys())
        which = "has no checksum" if name in entries else "has a checksum but is not in the file"
        raise ValueError(f"{path}: tensor {name} {which}: {damaged}")
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        with memoryview(mapped) as data:
            jobs = [(entries[k]["dtype"], entries[k]["shape"], _part(data, start, entries[k])) for k in names]
            try:
                digests = _digests(jobs)
            finally:
                for job in jobs:
                    job[2].release()  # before the map closes
    for name, digest in zip(names, digests, strict=True):
        if digest != recorded[name]:
            raise ValueError(f"{path}: tensor {name} does not match its checksum: {damaged}")


def _part(data: memoryview, start: int, entry: dict) -> memoryview:
    first, end = entry["data_offsets"]
    return data[start + first : start + end]


def open_safetensors(path, verify: bool = True) -> tuple[dict, dict]:
    """-> (arrays, metadata) of a safetensors file, its tensors checked against their checksums
    (`verify_checksums`) unless not `verify`; a missing or unreadable one is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        arrays, metadata = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error})") from None
    if verify:
        verify_checksums(path, metadata)
    return arrays, metadata


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


def read_weights(path, raw: bool = False, verify: bool = True) -> WeightsFile:
    """The weights file at `path` (local: `loading.open_weights` takes hf:// too), its tensors checked
    against their checksums unless not `verify` (`verify_checksums`)."""
    arrays, metadata = open_safetensors(path, verify)
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
