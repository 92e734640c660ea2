"""The authors' layout (their `main.py` checkpoints, torchvision's ResNet) and this port's, both ways.
H-Deformable-DETR's checkpoints (github.com/HDETR/H-Deformable-DETR, a fork of the authors' code) share it: their
recipe's options (mixed selection, look forward twice, the hybrid branch's query count) are read from their `args`
where the keys cannot show them, and written back for their main.py.

`sanitize` maps the authors' state_dict to this port's weights: tied duplicates dropped after being
checked equal (shared heads without refinement; the decoder's references to the top-level heads),
`num_batches_tracked` dropped, convolutions OIHW -> OHWI. `to_authors` is its inverse. Both on numpy
arrays; `.pth` files are read with `torch.load(weights_only=True)`, allowing only `argparse.Namespace`
beyond tensors (torch is needed for them alone: the `convert` extra)."""

import argparse
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..errors import ConversionError, optional
from ..models.backbones import backbone_family
from ..models.swin import is_buffer, relative_position_index, window_of
from .backbones import backbone_in
from .files import open_safetensors

# ModelConfig fields -> the authors' argparse names, for the args they read to build the model.
AUTHORS_ARGS = (
    "backbone",
    "dilation",
    "enc_layers",
    "dec_layers",
    "dim_feedforward",
    "hidden_dim",
    "nheads",
    "num_queries",
    "enc_n_points",
    "dec_n_points",
    "num_feature_levels",
    "with_box_refine",
    "two_stage",
    "dropout",
)
# ModelConfig fields -> H-Deformable-DETR's argparse names, written beside the authors' when a model uses their recipe
HDETR_ARGS = {
    "num_queries": "num_queries_one2one",
    "num_queries_one2many": "num_queries_one2many",
    "mixed_selection": "mixed_selection",
    "look_forward_twice": "look_forward_twice",
    "drop_path_rate": "drop_path_rate",
}


def read_checkpoint(path: Path) -> tuple[dict, dict]:
    """-> (state_dict of numpy arrays, args as a dict or {})."""
    path = Path(path)
    if path.is_dir():
        candidates = [path / "model.safetensors", path / "pytorch_model.bin"]
        found = [c for c in candidates if c.is_file()]
        if not found:
            raise ConversionError(f"{path}: no model.safetensors or pytorch_model.bin in this folder")
        path = found[0]
    if not path.is_file():
        raise ConversionError(f"{path}: no such file")
    if path.suffix == ".safetensors":
        try:
            arrays, _ = open_safetensors(path)
        except ValueError as error:
            raise ConversionError(str(error)) from None
        return {k: np.array(v.astype(mx.float32) if v.dtype == mx.bfloat16 else v) for k, v in arrays.items()}, {}
    return _read_torch(path)


def _read_torch(path: Path) -> tuple[dict, dict]:
    torch = optional("torch", "convert", f"{path}: reading .pth / .bin files")
    import pickle
    import zipfile

    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            checkpoint = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        unsafe = re.search(r"GLOBAL ([\w.]+)", str(error))
        what = f"the global {unsafe.group(1)}" if unsafe else "a disallowed object"
        raise ConversionError(
            f"{path}: refused: the pickle asks for {what}; only tensors and argparse.Namespace are allowed"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as error:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0].split(". ")[0]
        raise ConversionError(
            f"{path}: not a readable PyTorch checkpoint (truncated or corrupt?): {first_line}"
        ) from None
    if not isinstance(checkpoint, dict):
        raise ConversionError(
            f"{path}: expected a dict (a state_dict or a checkpoint with 'model'), got {type(checkpoint).__name__}"
        )
    args = checkpoint.get("args")
    args = vars(args) if isinstance(args, argparse.Namespace) else {}
    state = checkpoint.get("model", checkpoint)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConversionError(f"{path}: expected tensors in its state_dict")
    return {k: v.detach().cpu().numpy() for k, v in state.items()}, args


def detect_variant(state: dict) -> dict:
    """The model options that the authors' state_dict keys and shapes show."""

    def count(prefix, position):
        return len({k.split(".")[position] for k in state if k.startswith(prefix)})

    options = {
        "backbone": backbone_in(state),
        "two_stage": "transformer.enc_output.weight" in state,
        "with_box_refine": any(k.startswith("transformer.decoder.bbox_embed.") for k in state)
        or "class_embed.1.weight" in state
        and not np.array_equal(state["class_embed.0.weight"], state["class_embed.1.weight"]),
        "num_feature_levels": count("input_proj.", 1),
        "enc_layers": count("transformer.encoder.layers.", 3),
        "dec_layers": count("transformer.decoder.layers.", 3),
    }
    shapes = {
        "backbone_width": ("backbone.0.body.conv1.weight", 0),
        "hidden_dim": ("transformer.level_embed", 1),
        "dim_feedforward": ("transformer.encoder.layers.0.linear1.weight", 0),
        "num_classes": ("class_embed.0.weight", 0),
        "num_queries": ("query_embed.weight", 0),
    }
    for name, (key, axis) in shapes.items():
        key = key if key in state else f"transformer.decoder.{key}"  # a file may keep only the tied copy
        if key in state:
            options[name] = int(state[key].shape[axis])
    # H-Deformable-DETR's mixed selection: two-stage with learned content queries (the authors' two-stage has none)
    options["mixed_selection"] = options["two_stage"] and "query_embed.weight" in state
    return options


_ARG_NAMES = {  # the authors' args and Hugging Face config.json names -> ModelConfig fields
    "dilation": "dilation",
    "nheads": "nheads",
    "encoder_attention_heads": "nheads",
    "enc_n_points": "enc_n_points",
    "encoder_n_points": "enc_n_points",
    "dec_n_points": "dec_n_points",
    "decoder_n_points": "dec_n_points",
    "num_queries": "num_queries",
    "drop_path_rate": "drop_path_rate",  # H-Deformable-DETR's, for a Swin
}


def model_options(state: dict, args: dict) -> dict:
    """ModelConfig fields for a checkpoint: what its keys show, and from its args (the authors' or
    H-Deformable-DETR's argparse Namespace, or a Hugging Face config.json) what keys cannot show (heads,
    points, DC5, dropout; H-Deformable-DETR's look forward twice and how many of its queries are the hybrid
    branch's: without their args, all are one-to-one)."""
    from_args = {field: args[name] for name, field in _ARG_NAMES.items() if name in args}
    options = {**from_args, **detect_variant(state)}
    if "dropout" in args:
        options["dropout"] = float(args["dropout"])
    if "num_queries_one2one" in args:  # H-Deformable-DETR's args
        options["look_forward_twice"] = bool(args.get("look_forward_twice", False)) and options["with_box_refine"]
        options["num_queries_one2many"] = int(args.get("num_queries_one2many", 0))
        options["num_queries"] = int(args["num_queries_one2one"])
        rows = detect_variant(state).get("num_queries")
        if rows is not None and rows != options["num_queries"] + options["num_queries_one2many"]:
            raise ConversionError(
                f"query_embed.weight has {rows} rows; its args say {options['num_queries']} one-to-one and "
                f"{options['num_queries_one2many']} one-to-many queries"
            )
    return options


def config_for(variant: dict) -> str:
    """The name of the configs/ file of the authors' (or H-Deformable-DETR's) configuration a variant matches."""
    swin = {"swin_large": "hdetr_swin_large_36ep.yaml", "swin_large_window12": "hdetr_swin_large_window12_36ep.yaml"}
    if backbone_family(variant["backbone"]) == "swin":
        return swin.get(variant["backbone"], "hdetr_swin_tiny_12ep.yaml")
    if variant.get("mixed_selection") or variant.get("look_forward_twice") or variant.get("num_queries_one2many"):
        return "hdetr_r50_12ep.yaml"
    if variant["two_stage"]:
        return "r50_two_stage.yaml"
    if variant["with_box_refine"]:
        return "r50_box_refine.yaml"
    if variant["num_feature_levels"] == 1:
        return "r50_single_scale_dc5.yaml" if variant.get("dilation") else "r50_single_scale.yaml"
    return "r50.yaml"


def sanitize(state: dict, expected: dict | None = None, source: str = "checkpoint") -> dict:
    """The authors' state_dict (numpy arrays) -> this port's weights.

    Drops tied duplicates after checking them equal (shared heads without refinement; the decoder's
    references to the top-level heads), drops `num_batches_tracked`, transposes convolution weights
    OIHW -> OHWI (idempotent: only 4-d weights whose last axis is not already the input channels).
    With `expected` ({key: shape} of the model), every key must match: missing and unknown keys are
    errors that name them."""
    variant = detect_variant(state)
    out = {}
    for key, value in state.items():
        if key.endswith("num_batches_tracked"):
            continue
        if key.startswith("backbone.0.body.") and is_buffer(key):
            continue  # a Swin's buffers: computed by the model (models/swin.py)
        twin = _tied_twin(key, variant)
        if twin is not None:
            kept = state.get(twin, out.get(twin))
            if kept is not None:
                if not np.array_equal(kept, value):
                    raise ConversionError(f"{source}: {key} should be tied to {twin} but differs from it")
                continue
            key = twin  # the file kept only this copy of a tied tensor
        if value.ndim == 4 and (expected is None or tuple(expected.get(key, ())) != value.shape):
            value = value.transpose(0, 2, 3, 1)  # OIHW -> OHWI
        out[key] = np.ascontiguousarray(value)
    if expected is not None:
        check_state_keys(out, expected, source)
    return out


def _tied_twin(key: str, variant: dict) -> str | None:
    """The key a tied duplicate shares its value with, or None for a key stored as it is."""
    match = re.match(r"transformer\.decoder\.(class_embed|bbox_embed)\.(.*)", key)
    if match:
        return f"{match.group(1)}.{match.group(2)}"
    match = re.match(r"(class_embed|bbox_embed)\.(\d+)\.(.*)", key)
    if match and not variant["with_box_refine"] and match.group(2) != "0":
        return f"{match.group(1)}.0.{match.group(3)}"
    return None


def check_state_keys(weights: dict, expected: dict, source: str):
    missing = sorted(set(expected) - set(weights))
    unknown = sorted(set(weights) - set(expected))
    if unknown:
        raise ConversionError(
            f"{source}: unknown key {unknown[0]}" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
        )
    if missing:
        raise ConversionError(
            f"{source}: missing key {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    for key, shape in expected.items():
        if tuple(weights[key].shape) != tuple(shape):
            raise ConversionError(f"{source}: {key} has shape {tuple(weights[key].shape)}; expected {tuple(shape)}")


def expected_shapes(model) -> dict:
    return {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}


def torchvision_resnet_to_backbone(state: dict, source: str = "checkpoint") -> dict:
    """torchvision ResNet ImageNet weights -> the authors' backbone keys (the classifier dropped)."""
    out = {}
    for key, value in state.items():
        if key.startswith("fc.") or key.endswith("num_batches_tracked"):
            continue
        if not re.match(r"^(conv1|bn1|layer[1-4])\.", key):
            raise ConversionError(f"{source}: unknown key {key} for a torchvision ResNet")
        out["backbone.0.body." + key] = value
    return out


def to_authors(weights: dict) -> dict:
    """This port's weights -> the authors' state_dict (numpy arrays), tied keys restored."""
    two_stage = "transformer.enc_output.weight" in weights
    box_refine = "class_embed.1.weight" in weights  # without refinement only class_embed.0 is stored
    decoder_layers = len({k.split(".")[3] for k in weights if k.startswith("transformer.decoder.layers.")})
    predictions = decoder_layers + 1 if two_stage else decoder_layers
    out = {}
    for key, value in weights.items():
        out[key] = value.transpose(0, 3, 1, 2) if value.ndim == 4 else value  # OHWI -> OIHW
    heads = [k for k in out if re.match(r"(class_embed|bbox_embed)\.", k)]
    if not box_refine:  # one head, repeated for every prediction
        for key in heads:
            head, _, rest = key.split(".", 2)
            for i in range(1, predictions):
                out[f"{head}.{i}.{rest}"] = out[key]
    for key in sorted(out):
        head = re.match(r"(class_embed|bbox_embed)\.", key)
        if head and ((head[1] == "bbox_embed" and box_refine) or (head[1] == "class_embed" and two_stage)):
            out[f"transformer.decoder.{key}"] = out[key]
        if key.startswith("backbone.0.body.") and key.endswith(".attn.relative_position_bias_table"):
            index = np.array(relative_position_index(window_of(out[key]))).astype(np.int64)  # HDETR's Swin keeps it
            out[key.replace("relative_position_bias_table", "relative_position_index")] = index
    return out


def authors_args(config: dict | None) -> argparse.Namespace:
    """The args a main.py checkpoint carries for a model of `config` (ModelConfig as a dict): the authors'
    names, and H-Deformable-DETR's where the model uses their recipe."""
    config = config or {}
    args = {name: config[name] for name in AUTHORS_ARGS if name in config}
    if any(config.get(key) for key in ("mixed_selection", "look_forward_twice", "num_queries_one2many")):
        args.update({name: config[field] for field, name in HDETR_ARGS.items() if field in config})
    return argparse.Namespace(**args)
