"""Weights by name: `hf://ORG/NAME[@REVISION]`, a Hugging Face Hub repository of a
`DeformableDetrForObjectDetection`, wherever weights are taken.

huggingface_hub fetches config.json and the weights (model.safetensors, else pytorch_model.bin) into
its cache (HF_HUB_CACHE; with HF_HUB_OFFLINE=1 nothing is fetched: a cached repository still works).
The conversion to this port's layout is done once per snapshot and kept in this project's cache
(DEFORMABLE_DETR_CACHE, default ~/.cache/deformable-detr-mlx), written whole or not at all."""

import json
import os
from functools import cache
from pathlib import Path

from ..errors import UsageError
from ..settings import CACHE
from .conversion import convert, save_converted

PREFIX = "hf://"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def is_hub(reference) -> bool:
    return isinstance(reference, str) and reference.startswith(PREFIX)


def parse(reference: str) -> tuple[str, str | None]:
    """'hf://ORG/NAME@REVISION' -> ('ORG/NAME', 'REVISION' or None)."""
    repo, _, revision = reference[len(PREFIX) :].partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise UsageError(f"{reference}: expected hf://ORG/NAME or hf://ORG/NAME@REVISION")
    return repo, revision or None


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "on", "yes", "true"}


def hub_cache() -> Path:
    """Where huggingface_hub keeps repositories (read when called, as the environment is then)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def converted_cache() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deformable-detr-mlx"
    return CACHE.value() or default


def _fetch(reference: str, repo: str, revision, filename: str) -> Path:
    """One file of the repository through huggingface_hub's cache; its errors in one line."""
    try:
        from huggingface_hub import errors, hf_hub_download
    except ImportError:
        raise ImportError(
            f"{reference}: weights from the Hub need huggingface_hub: pip install huggingface_hub"
        ) from None
    try:
        return Path(
            hf_hub_download(repo, filename, revision=revision, cache_dir=hub_cache(), local_files_only=offline())
        )
    except errors.RevisionNotFoundError:
        raise FileNotFoundError(f"{reference}: the Hub has no revision {revision!r} of {repo}") from None
    except errors.RepositoryNotFoundError:
        raise FileNotFoundError(
            f"{reference}: the Hub has no repository {repo} (or it is private or gated: log in with `hf auth login`)"
        ) from None
    except errors.LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1" if offline() else "the Hub cannot be reached"
        raise FileNotFoundError(
            f"{reference}: {filename} is not in the Hugging Face cache ({hub_cache()}) and {why}"
        ) from None
    except errors.RemoteEntryNotFoundError:
        raise FileNotFoundError(f"{reference}: the repository has no {filename}") from None
    except (errors.HfHubHTTPError, OSError) as error:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise OSError(f"{reference}: downloading {filename} failed: {first_line}") from None


def snapshot(reference: str) -> Path:
    """The local snapshot folder of `reference` holding its config.json and weights (fetched if need
    be). Asked once a process for each cache and mode: a command reads its weights more than once
    (their config, then the model), and online each ask is a request to the Hub per file."""
    return _snapshot(reference, hub_cache(), offline())


@cache
def _snapshot(reference: str, hub_dir: Path, offline_only: bool) -> Path:
    repo, revision = parse(reference)
    config = _fetch(reference, repo, revision, "config.json")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (ValueError, AttributeError):
        raise ValueError(f"{reference}: its config.json is not valid JSON") from None
    if model_type != "deformable_detr":
        raise ValueError(f"{reference} is not a Deformable DETR (config.json's model_type is {model_type!r})")
    missing = None
    for filename in WEIGHT_FILES:
        try:
            _fetch(reference, repo, revision, filename)
            return config.parent
        except FileNotFoundError as error:
            missing = missing or error  # the safetensors file's reason: the first choice
    raise missing


def local_weights(reference) -> Path:
    """A weights reference -> the local file: paths as they are; `hf://` converted once per snapshot."""
    if not is_hub(reference):
        return Path(reference)
    folder = snapshot(reference)
    repo, _ = parse(reference)
    path = converted_cache() / repo.replace("/", "--") / f"{folder.name}.safetensors"  # the snapshot's commit
    if not path.is_file():
        weights, options, _ = convert(folder, source=reference)
        save_converted(path, weights, options, folder)
    return path
