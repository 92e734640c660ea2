"""Hugging Face transformers' `DeformableDetrForObjectDetection` layout and the authors', both ways:
its key names (the decoder's separate q/k/v projections against one `in_proj`), its ResNet (timm's
names, which are torchvision's, or transformers' own), its config.json and preprocessor_config.json."""

import functools
import json
import re
from pathlib import Path

import numpy as np

from ..errors import ConversionError
from ..models.backbone import ARCHITECTURES

# The key map, one table read both ways: (Hugging Face's `DeformableDetrForObjectDetection` prefix, as transformers
# writes it (the Hub's layout), the authors'). A key takes the first row whose prefix it starts with, the rest of it
# as it is. {i} stands for a number, the same on both sides; {s+1} for one more than the other side's {s}
# (transformers counts ResNet stages and convolutions from 0, torchvision from 1).
_LAYER_KEYS = {  # an encoder / decoder layer's parts: (transformers' name, the authors')
    "encoder": [
        ("self_attn_layer_norm", "norm1"),
        ("fc1", "linear1"),
        ("fc2", "linear2"),
        ("final_layer_norm", "norm2"),
        ("self_attn", "self_attn"),
    ],
    "decoder": [
        ("self_attn.out_proj", "self_attn.out_proj"),  # q, k and v: split from / joined into in_proj (below)
        ("self_attn_layer_norm", "norm2"),
        ("encoder_attn", "cross_attn"),
        ("encoder_attn_layer_norm", "norm1"),
        ("fc1", "linear1"),
        ("fc2", "linear2"),
        ("final_layer_norm", "norm3"),
    ],
}
_KEYS = [
    ("model.backbone.conv_encoder.model.", "backbone.0.body."),  # the ResNet's own names: _RESNET_KEYS
    ("model.input_proj.", "input_proj."),
    ("model.query_position_embeddings.", "query_embed."),
    ("model.level_embed", "transformer.level_embed"),
    *(
        (f"model.{part}.", f"transformer.{part}.")
        for part in ("reference_points", "enc_output", "enc_output_norm", "pos_trans", "pos_trans_norm")
    ),
    *((f"model.decoder.{head}.", f"transformer.decoder.{head}.") for head in ("bbox_embed", "class_embed")),
    *(
        (f"model.{stack}.layers.{{i}}.{theirs}.", f"transformer.{stack}.layers.{{i}}.{ours}.")
        for stack, parts in _LAYER_KEYS.items()
        for theirs, ours in parts
    ),
    ("class_embed.", "class_embed."),
    ("bbox_embed.", "bbox_embed."),
]
_RESNET_KEYS = [  # transformers' own ResNet, torchvision's (timm's names)
    ("embedder.embedder.convolution.", "conv1."),
    ("embedder.embedder.normalization.", "bn1."),
    ("encoder.stages.{s}.layers.{b}.shortcut.convolution.", "layer{s+1}.{b}.downsample.0."),
    ("encoder.stages.{s}.layers.{b}.shortcut.normalization.", "layer{s+1}.{b}.downsample.1."),
    ("encoder.stages.{s}.layers.{b}.layer.{c}.convolution.", "layer{s+1}.{b}.conv{c+1}."),
    ("encoder.stages.{s}.layers.{b}.layer.{c}.normalization.", "layer{s+1}.{b}.bn{c+1}."),
]
_ALSO_READ = [  # names other transformers releases write -> the table's
    (r"^model\.backbone\.model\.", "model.backbone.conv_encoder.model."),
    (r"^(model\.(?:en|de)coder\.layers\.\d+\.)mlp\.(?=fc[12]\.)", r"\1"),
    (r"^(model\.decoder\.layers\.\d+\.self_attn\.)o_proj\.", r"\1out_proj."),
]
_FIELD = re.compile(r"\{(\w)(\+1)?\}")
_BODY = "backbone.0.body."


def is_huggingface(state: dict) -> bool:
    return any(k.startswith("model.encoder.layers.") for k in state)


def huggingface_to_authors(state: dict, source: str = "checkpoint") -> dict:
    """Hugging Face `DeformableDetrForObjectDetection` keys -> the authors' keys. The decoder's
    separate q/k/v projections become one `in_proj` as in `torch.nn.MultiheadAttention`."""
    out, qkv = {}, {}
    for key, value in state.items():
        if key.endswith("num_batches_tracked"):
            continue
        projection = re.match(r"^model\.decoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)$", key)
        if projection:
            qkv[(projection[1], projection[3], projection[2])] = value
            continue
        read = key
        for pattern, replacement in _ALSO_READ:
            read = re.sub(pattern, replacement, read)
        renamed = _rename(read, _KEYS, to_authors=True)
        if renamed is None:
            raise ConversionError(f"{source}: unknown key {key}")
        if renamed.startswith(_BODY):
            body = renamed.removeprefix(_BODY)
            renamed = _BODY + (_rename(body, _RESNET_KEYS, to_authors=True) or body)
        out[renamed] = value
    for layer, kind in sorted({(layer, kind) for layer, kind, _ in qkv}):
        parts = [qkv.get((layer, kind, p)) for p in "qkv"]
        if any(p is None for p in parts):
            raise ConversionError(f"{source}: decoder layer {layer} lacks one of its q/k/v projection {kind}s")
        name = "in_proj_weight" if kind == "weight" else "in_proj_bias"
        out[f"transformer.decoder.layers.{layer}.self_attn.{name}"] = np.concatenate(parts, 0)
    return out


def _rename(key: str, table: list, to_authors: bool) -> str | None:
    """`key` renamed by the first row of `table` whose prefix (Hugging Face's side, or the authors' with
    `to_authors` False) it starts with; None where none does."""
    for row in table:
        source, target = row if to_authors else row[::-1]
        pattern, offsets = _prefix(source)
        found = pattern.match(key)
        if found:
            numbers = {name: int(found[name]) - offset for name, offset in offsets.items()}
            return _filled(target, numbers) + key[found.end() :]
    return None


def _filled(template: str, numbers: dict) -> str:
    """A row's prefix with its fields' numbers written in: {n} as n, {n+1} as one more."""
    return _FIELD.sub(lambda field: str(numbers[field[1]] + (1 if field[2] else 0)), template)


@functools.cache
def _prefix(template: str) -> tuple:
    """A row's prefix -> (its regex, {field: what its number adds}): each {n} or {n+1} a number."""
    parts = _FIELD.split(template)  # literal, (field, "+1" or None, literal)...
    regex, offsets = re.escape(parts[0]), {}
    for name, plus, literal in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
        regex += rf"(?P<{name}>\d+)" + re.escape(literal)
        offsets[name] = 1 if plus else 0
    return re.compile(regex), offsets


def read_config(src: Path) -> dict:
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


def to_huggingface(state: dict, backbone: str) -> dict:
    """The authors' state_dict (numpy, tied keys restored) -> `DeformableDetrForObjectDetection`'s,
    the ResNet under timm's names (torchvision's) or transformers' own ResNet's."""
    out = {}
    for key, value in state.items():
        layer = re.match(r"^transformer\.decoder\.layers\.(\d+)\.self_attn\.in_proj_(weight|bias)$", key)
        if layer:
            for name, part in zip("qkv", np.split(value, 3), strict=True):
                out[f"model.decoder.layers.{layer[1]}.self_attn.{name}_proj.{layer[2]}"] = part
            continue
        written = key
        if backbone == "transformers" and key.startswith(_BODY):
            body = key.removeprefix(_BODY)
            written = _BODY + (_rename(body, _RESNET_KEYS, to_authors=False) or body)
        renamed = _rename(written, _KEYS, to_authors=False)
        if renamed is None:
            raise ConversionError(f"{key}: no Hugging Face name for it")
        out[renamed] = value
    return out


def backbone_fields(model: dict, backbone: str) -> dict:
    """config.json's backbone: timm's ResNet by name (width 64 only) or transformers' own (no DC5)."""
    width, name = model.get("backbone_width", 64), model["backbone"]
    if backbone == "timm" and width != 64:
        raise ConversionError(
            f"a {name} of width {width}: timm's {name} has width 64; export it with --hf-backbone transformers"
        )
    if backbone == "transformers" and model["dilation"]:
        raise ConversionError("a DC5 backbone (dilation): transformers' ResNet has none; use --hf-backbone timm")
    fields = {"use_timm_backbone": backbone == "timm", "use_pretrained_backbone": False, "dilation": model["dilation"]}
    if backbone == "timm":
        return {**fields, "backbone": name, "backbone_config": None}
    block, depths = ARCHITECTURES[name]
    expansion = 4 if block == "bottleneck" else 1
    resnet = {
        "model_type": "resnet",
        "embedding_size": width,
        "hidden_sizes": [width * expansion * 2**i for i in range(4)],
        "depths": list(depths),
        "layer_type": block,
        "out_features": ["stage4"] if model["num_feature_levels"] == 1 else ["stage2", "stage3", "stage4"],
    }
    return {**fields, "backbone": None, "backbone_config": resnet}


def config_json(model: dict, names: dict, backbone: str) -> dict:
    """config.json of `DeformableDetrForObjectDetection` for this port's ModelConfig (as a dict)."""
    id2label = {str(i): names.get(i, "N/A" if names else f"LABEL_{i}") for i in range(model["num_classes"])}
    return {
        "architectures": ["DeformableDetrForObjectDetection"],
        "model_type": "deformable_detr",
        **backbone_fields(model, backbone),
        "num_channels": 3,
        "d_model": model["hidden_dim"],
        "encoder_layers": model["enc_layers"],
        "decoder_layers": model["dec_layers"],
        "encoder_attention_heads": model["nheads"],
        "decoder_attention_heads": model["nheads"],
        "encoder_ffn_dim": model["dim_feedforward"],
        "decoder_ffn_dim": model["dim_feedforward"],
        "encoder_n_points": model["enc_n_points"],
        "decoder_n_points": model["dec_n_points"],
        "num_feature_levels": model["num_feature_levels"],
        "num_queries": model["num_queries"],
        "two_stage_num_proposals": model["num_queries"],
        "with_box_refine": model["with_box_refine"],
        "two_stage": model["two_stage"],
        "dropout": model["dropout"],
        "activation_function": "relu",
        "position_embedding_type": "sine",
        "auxiliary_loss": False,
        "id2label": id2label,
        "label2id": {label: int(i) for i, label in id2label.items()},
    }


def image_processor_config(data: dict) -> dict:
    """preprocessor_config.json: what transformers' pipelines resize and normalise with, as eval here."""
    return {
        "image_processor_type": "DeformableDetrImageProcessor",
        "format": "coco_detection",
        "do_resize": True,
        "size": {"shortest_edge": data.get("val_size", 800), "longest_edge": data.get("max_size", 1333)},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.485, 0.456, 0.406],
        "image_std": [0.229, 0.224, 0.225],
        "do_pad": True,
    }
