"""Convert PyTorch Deformable DETR weights to this port's safetensors.

    python -m deformable_detr.convert SRC DST.safetensors [--backbone-only]

SRC is one of
- the authors' checkpoint (`.pth`: a dict with `model`, as released, usually also `args`,
  `optimizer`, `epoch`; or a bare state_dict);
- Hugging Face `DeformableDetrForObjectDetection` weights (`model.safetensors` or
  `pytorch_model.bin`, or the folder holding one, of any transformers release), or
  `hf://ORG/NAME[@REVISION]` on the Hub;
- with `--backbone-only`, torchvision ResNet ImageNet weights (`resnet50-*.pth`), written as a
  backbone-only file that training starts from.

Every key is mapped or refused: an unknown or missing key is an error naming it. Tied keys (the
authors repeat a shared head under several names) are checked equal and stored once. `.pth` files
are read with `torch.load(weights_only=True)`, allowing only `argparse.Namespace` beyond tensors.
torch is needed only for `.pth` / `.bin` input (`pip install -e ".[convert]"`).
"""

import argparse
import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np

from .cli import ArgumentParser, entry_point
from .hub import is_hub, snapshot
from .weights import CONFIG_FILE_KEY, MODEL_OPTIONS_KEY, open_safetensors, save_weights


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message says which file and key."""


# ---------------------------------------------------------------------------------------------
# reading


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
    try:
        import torch
    except ImportError:
        raise ConversionError(
            f"{path}: reading .pth / .bin files needs PyTorch; install it with pip install -e '.[convert]'"
        ) from None
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


# ---------------------------------------------------------------------------------------------
# the authors' layout -> this port


def detect_variant(state: dict) -> dict:
    """The model options that the authors' state_dict keys and shapes show."""

    def count(prefix, position):
        return len({k.split(".")[position] for k in state if k.startswith(prefix)})

    bottleneck = "backbone.0.body.layer1.0.conv3.weight" in state
    backbone = {(True, 6): "resnet50", (True, 23): "resnet101", (False, 6): "resnet34", (False, 2): "resnet18"}
    options = {
        "backbone": backbone.get((bottleneck, count("backbone.0.body.layer3.", 4)), "unknown"),
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
}


def model_options(state: dict, args: dict) -> dict:
    """ModelConfig fields for a checkpoint: what its keys show, and from its args (the authors'
    argparse Namespace or a Hugging Face config.json) what keys cannot show (heads, points, DC5)."""
    from_args = {field: args[name] for name, field in _ARG_NAMES.items() if name in args}
    return {**from_args, **detect_variant(state)}


def config_for(variant: dict) -> str:
    """The name of the configs/ file of the authors' configuration a variant matches."""
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
        check_keys(out, expected, source)
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


def check_keys(weights: dict, expected: dict, source: str):
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
    from mlx.utils import tree_flatten

    return {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}


# ---------------------------------------------------------------------------------------------
# Hugging Face and torchvision layouts -> the authors' layout

_HF_RULES = [  # (pattern, replacement) on Hugging Face DeformableDetrForObjectDetection keys
    (r"^model\.input_proj\.", "input_proj."),
    (r"^model\.query_position_embeddings\.", "query_embed."),
    (r"^model\.level_embed$", "transformer.level_embed"),
    (r"^model\.(reference_points|enc_output|enc_output_norm|pos_trans|pos_trans_norm)\.", r"transformer.\1."),
    (r"^model\.decoder\.(bbox_embed|class_embed)\.", r"transformer.decoder.\1."),
    (r"^model\.encoder\.layers\.(\d+)\.self_attn_layer_norm\.", r"transformer.encoder.layers.\1.norm1."),
    (r"^model\.encoder\.layers\.(\d+)\.(?:mlp\.)?fc1\.", r"transformer.encoder.layers.\1.linear1."),
    (r"^model\.encoder\.layers\.(\d+)\.(?:mlp\.)?fc2\.", r"transformer.encoder.layers.\1.linear2."),
    (r"^model\.encoder\.layers\.(\d+)\.final_layer_norm\.", r"transformer.encoder.layers.\1.norm2."),
    (r"^model\.encoder\.layers\.(\d+)\.self_attn\.", r"transformer.encoder.layers.\1.self_attn."),
    (
        r"^model\.decoder\.layers\.(\d+)\.self_attn\.(?:o_proj|out_proj)\.",
        r"transformer.decoder.layers.\1.self_attn.out_proj.",
    ),
    (r"^model\.decoder\.layers\.(\d+)\.self_attn_layer_norm\.", r"transformer.decoder.layers.\1.norm2."),
    (r"^model\.decoder\.layers\.(\d+)\.encoder_attn\.", r"transformer.decoder.layers.\1.cross_attn."),
    (r"^model\.decoder\.layers\.(\d+)\.encoder_attn_layer_norm\.", r"transformer.decoder.layers.\1.norm1."),
    (r"^model\.decoder\.layers\.(\d+)\.(?:mlp\.)?fc1\.", r"transformer.decoder.layers.\1.linear1."),
    (r"^model\.decoder\.layers\.(\d+)\.(?:mlp\.)?fc2\.", r"transformer.decoder.layers.\1.linear2."),
    (r"^model\.decoder\.layers\.(\d+)\.final_layer_norm\.", r"transformer.decoder.layers.\1.norm3."),
    (r"^(class_embed|bbox_embed)\.", r"\1."),
]

_HF_RESNET_RULES = [  # transformers' own ResNet -> torchvision names
    (r"^embedder\.embedder\.convolution\.", "conv1."),
    (r"^embedder\.embedder\.normalization\.", "bn1."),
    (
        r"^encoder\.stages\.(\d+)\.layers\.(\d+)\.shortcut\.convolution\.",
        lambda m: f"layer{int(m[1]) + 1}.{m[2]}.downsample.0.",
    ),
    (
        r"^encoder\.stages\.(\d+)\.layers\.(\d+)\.shortcut\.normalization\.",
        lambda m: f"layer{int(m[1]) + 1}.{m[2]}.downsample.1.",
    ),
    (
        r"^encoder\.stages\.(\d+)\.layers\.(\d+)\.layer\.(\d+)\.convolution\.",
        lambda m: f"layer{int(m[1]) + 1}.{m[2]}.conv{int(m[3]) + 1}.",
    ),
    (
        r"^encoder\.stages\.(\d+)\.layers\.(\d+)\.layer\.(\d+)\.normalization\.",
        lambda m: f"layer{int(m[1]) + 1}.{m[2]}.bn{int(m[3]) + 1}.",
    ),
]


def is_huggingface(state: dict) -> bool:
    return any(k.startswith("model.encoder.layers.") for k in state)


def huggingface_to_authors(state: dict, source: str = "checkpoint") -> dict:
    """Hugging Face `DeformableDetrForObjectDetection` keys -> the authors' keys. The decoder's
    separate q/k/v projections become one `in_proj` as in `torch.nn.MultiheadAttention`."""
    out, qkv = {}, {}
    for key, value in state.items():
        if key.endswith("num_batches_tracked"):
            continue
        backbone = re.match(r"^model\.backbone\.(?:conv_encoder\.)?model\.(.*)$", key)
        if backbone:
            out["backbone.0.body." + _rename(backbone[1], _HF_RESNET_RULES)] = value
            continue
        projection = re.match(r"^model\.decoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)$", key)
        if projection:
            qkv[(projection[1], projection[3], projection[2])] = value
            continue
        renamed = _rename(key, _HF_RULES)
        if renamed == key and not key.startswith(("class_embed.", "bbox_embed.")):
            raise ConversionError(f"{source}: unknown key {key}")
        out[renamed] = value
    for layer, kind in sorted({(layer, kind) for layer, kind, _ in qkv}):
        parts = [qkv.get((layer, kind, p)) for p in "qkv"]
        if any(p is None for p in parts):
            raise ConversionError(f"{source}: decoder layer {layer} lacks one of its q/k/v projection {kind}s")
        name = "in_proj_weight" if kind == "weight" else "in_proj_bias"
        out[f"transformer.decoder.layers.{layer}.self_attn.{name}"] = np.concatenate(parts, 0)
    return out


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


def _rename(key: str, rules) -> str:
    for pattern, replacement in rules:
        renamed, count = re.subn(pattern, replacement, key)
        if count:
            return renamed
    return key


# ---------------------------------------------------------------------------------------------
# command line


@entry_point
def main(argv=None):
    parser = ArgumentParser(prog="python -m deformable_detr.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "src",
        help="the authors' .pth, Hugging Face weights (file or folder, or hf://ORG/NAME[@REVISION] on the Hub), "
        "or torchvision ResNet weights with --backbone-only",
    )
    parser.add_argument("dst", type=Path, help="the .safetensors file to write")
    parser.add_argument("--backbone-only", action="store_true", help="convert torchvision ResNet ImageNet weights")
    parser.add_argument(
        "--dilation",
        action="store_true",
        help="the checkpoint is DC5 (not visible in its keys when the checkpoint has no args)",
    )
    args = parser.parse_args(argv)
    src = snapshot(args.src) if is_hub(args.src) else Path(args.src)
    weights, options, message = convert(src, backbone_only=args.backbone_only, dilation=args.dilation, source=args.src)
    names, where = save_converted(args.dst, weights, options, src)
    print(message)
    if names:
        print(f"category names: {where} (recorded in the file)")
    print(f"wrote {len(weights)} tensors to {args.dst}")


def convert(src: Path, backbone_only: bool = False, dilation: bool = False, source=None) -> tuple[dict, dict, str]:
    """Read, map and check a checkpoint (`source`: its name in messages, default `src`). Returns the
    weights (for `model.load_weights`), the model options they need (`overrides(options)` for
    `load_config`) and a message naming the variant and the config to use."""
    from .backbone import Backbone
    from .config import CONFIGS_DIR, load_config
    from .model import build_model

    state, ckpt_args = read_checkpoint(src)
    source = str(source or src)
    if backbone_only:
        state = torchvision_resnet_to_backbone(state, source)
        name = detect_variant(state)["backbone"]
        if name == "unknown":
            raise ConversionError(f"{source}: not a ResNet-18/34/50/101 state_dict")
        body = Backbone(name)
        expected = {f"backbone.0.body.{k}": v for k, v in expected_shapes(body.body).items()}
        return sanitize(state, expected, source), {"backbone": name}, f"backbone: {name} (backbone-only weights)"
    if is_huggingface(state):
        ckpt_args = huggingface_config(Path(src))
        state = untie_heads(huggingface_to_authors(state, source), ckpt_args)
    options = model_options(state, ckpt_args)
    options["dilation"] = options.get("dilation", False) or dilation
    model = build_model(load_config(None, overrides(options)))
    weights = sanitize(state, expected_shapes(model), source)
    config_name = config_for(options)
    file_options = load_config(CONFIGS_DIR / config_name).model
    differing = {k: v for k, v in options.items() if getattr(file_options, k) != v}
    kind = ("two-stage, " if options["two_stage"] else "") + ("box refinement, " if options["with_box_refine"] else "")
    message = (
        f"variant: {options['backbone']}, {kind}{options['num_feature_levels']} feature level(s)"
        f"{', DC5' if options['dilation'] else ''}\nconfig: configs/{config_name}"
        + (f" with {' '.join(overrides(differing))}" if differing else "")
    )
    return weights, options, message


def overrides(options: dict) -> list[str]:
    """Model options as `load_config` overrides."""
    return [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items()]


def huggingface_config(src: Path) -> dict:
    """The config.json beside Hugging Face weights, if any."""
    path = (src if src.is_dir() else src.parent) / "config.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        raise ConversionError(f"{path}: not valid JSON") from None


def untie_heads(state: dict, config: dict) -> dict:
    """The heads a transformers release tied and so wrote once, written out for every prediction as
    the authors' state_dict has them. transformers 5 ties every `class_embed.N` to `class_embed.0`
    when the model has box refinement but not two stages (earlier releases kept them apart and wrote
    them all), and with box refinement keeps `bbox_embed.N` only as the decoder's copy."""
    layers = config.get("decoder_layers")
    if not layers or not config.get("with_box_refine"):
        return state  # without refinement the authors' heads are one, shared (sanitize keeps one)
    predictions = layers + 1 if config.get("two_stage") else layers
    state = dict(state)
    for head in ("class_embed", "bbox_embed"):
        parts = [k.split(".", 2)[2] for k in state if k.startswith(f"{head}.0.")]
        for i in range(1, predictions):
            for part in parts:
                key = f"{head}.{i}.{part}"
                if key not in state and f"transformer.decoder.{key}" not in state:
                    state[key] = state[f"{head}.0.{part}"]
    return state


def class_names_for(weights: dict, src) -> tuple[dict, str]:
    """({category id: name}, where they come from): a Hugging Face config.json's `id2label` where it
    names them (not transformers' placeholders LABEL_i, nor "N/A" for COCO's unused ids); else COCO's
    when the weights have COCO's 91 class outputs (the authors' released checkpoints); else none."""
    from .data.coco import COCO_CATEGORY_NAMES

    labels = huggingface_config(Path(src)).get("id2label", {}) if Path(src).exists() else {}
    named = {int(i): str(n) for i, n in labels.items() if str(n) not in {f"LABEL_{i}", "N/A"}}
    if named:
        return named, f"the {len(named)} of config.json's id2label"
    head = weights.get("class_embed.0.bias")
    if head is not None and head.shape[0] == 91:
        return dict(COCO_CATEGORY_NAMES), f"the {len(COCO_CATEGORY_NAMES)} COCO categories at their ids"
    return {}, ""


def save_converted(dst, weights: dict, options: dict, src) -> tuple[dict, str]:
    """Converted weights with what they are: their category names and, for a whole model, its options
    and the config it matches (so eval and predict need no --config). -> class_names_for's answer."""
    names, where = class_names_for(weights, src)
    model = "two_stage" in options  # not backbone-only weights
    metadata = {MODEL_OPTIONS_KEY: json.dumps(options), CONFIG_FILE_KEY: config_for(options)} if model else {}
    save_weights(dst, weights, names, metadata)
    return names, where


if __name__ == "__main__":
    main()
