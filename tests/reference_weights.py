"""The weights of `fixtures/reference/` (the authors' model outputs), rebuilt from the recipe of its
README, and the reference tensors themselves."""

import json
import zlib
from functools import cache
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

FIXTURE = Path(__file__).parent / "fixtures" / "reference"
VARIANTS = ("base", "refine", "two_stage")


@cache
def manifest() -> dict:
    return json.loads((FIXTURE / "manifest.json").read_text())


def recipe_value(key: str, shape, seed: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(key.encode())])))
    u = rng.random(size=tuple(shape))
    if len(shape) >= 2:
        value = (2 * u - 1) * np.sqrt(3 / np.prod(shape[1:]))
    elif key.endswith("running_var") or key.endswith("weight"):
        value = 0.5 + u
    else:
        value = (2 * u - 1) * 0.1
    return value.astype(np.float32)


def state_dict(variant: str) -> dict:
    """The authors' state_dict for `variant`, in their key order, tied keys sharing values."""
    info = manifest()["variants"][variant]
    tied = dict(info["tied"])
    state = {}
    for key, shape, _ in info["state_dict_keys"]:
        state[key] = state[tied[key]] if key in tied else recipe_value(key, shape, manifest()["seed"])
    return state


def reference(variant: str) -> dict:
    return load_file(str(FIXTURE / f"{variant}.safetensors"))
