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


def assert_same_detections(detections: dict, ref: dict, image: int):
    """Post-processed `detections` of `image` against the reference's post{image}.*: scores to 1e-4; each detection
    found among the reference's of its score (to 1e-5: detections whose scores tie to float noise may come in
    either order) with its label and box."""
    scores, labels, boxes = (np.array(detections[k]) for k in ("scores", "labels", "boxes"))
    want_scores, want_labels, want_boxes = (ref[f"post{image}.{k}"] for k in ("scores", "labels", "boxes"))
    np.testing.assert_allclose(scores, want_scores, rtol=1e-4, atol=1e-6)
    for rank in range(len(scores)):
        candidates = np.where(np.abs(want_scores - scores[rank]) <= 1e-5)[0]
        assert any(
            want_labels[c] == labels[rank] and np.allclose(want_boxes[c], boxes[rank], rtol=1e-4, atol=1e-2)
            for c in candidates
        ), f"image {image}, detection {rank}: no reference detection with its score, label and box"


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
