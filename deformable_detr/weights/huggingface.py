"""Hugging Face transformers' `DeformableDetrForObjectDetection` layout and the authors', both ways:
its key names (the decoder's separate q/k/v projections against one `in_proj`), its ResNet (timm's
names, which are torchvision's, or transformers' own), its config.json and preprocessor_config.json."""

import json
import re
from pathlib import Path

import numpy as np

from ..errors import ConversionError
from ..models.backbone import ARCHITECTURES

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


def _rename(key: str, rules) -> str:
    for pattern, replacement in rules:
        renamed, count = re.subn(pattern, replacement, key)
        if count:
            return renamed
    return key


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


_TO_HUGGINGFACE = [  # the authors' keys -> Hugging Face's, as transformers writes them (the Hub's layout)
    (r"^backbone\.0\.body\.", "model.backbone.conv_encoder.model."),
    (r"^input_proj\.", "model.input_proj."),
    (r"^query_embed\.", "model.query_position_embeddings."),
    (r"^transformer\.level_embed$", "model.level_embed"),
    (r"^transformer\.(reference_points|enc_output|enc_output_norm|pos_trans|pos_trans_norm)\.", r"model.\1."),
    (r"^transformer\.decoder\.(bbox_embed|class_embed)\.", r"model.decoder.\1."),
    (r"^transformer\.encoder\.layers\.(\d+)\.norm1\.", r"model.encoder.layers.\1.self_attn_layer_norm."),
    (r"^transformer\.encoder\.layers\.(\d+)\.linear(\d)\.", r"model.encoder.layers.\1.fc\2."),
    (r"^transformer\.encoder\.layers\.(\d+)\.norm2\.", r"model.encoder.layers.\1.final_layer_norm."),
    (r"^transformer\.encoder\.layers\.(\d+)\.self_attn\.", r"model.encoder.layers.\1.self_attn."),
    (r"^transformer\.decoder\.layers\.(\d+)\.self_attn\.out_proj\.", r"model.decoder.layers.\1.self_attn.out_proj."),
    (r"^transformer\.decoder\.layers\.(\d+)\.norm2\.", r"model.decoder.layers.\1.self_attn_layer_norm."),
    (r"^transformer\.decoder\.layers\.(\d+)\.cross_attn\.", r"model.decoder.layers.\1.encoder_attn."),
    (r"^transformer\.decoder\.layers\.(\d+)\.norm1\.", r"model.decoder.layers.\1.encoder_attn_layer_norm."),
    (r"^transformer\.decoder\.layers\.(\d+)\.linear(\d)\.", r"model.decoder.layers.\1.fc\2."),
    (r"^transformer\.decoder\.layers\.(\d+)\.norm3\.", r"model.decoder.layers.\1.final_layer_norm."),
]

_TO_TRANSFORMERS_RESNET = [  # torchvision / timm ResNet names -> transformers' own ResNet's
    (r"^conv1\.", "embedder.embedder.convolution."),
    (r"^bn1\.", "embedder.embedder.normalization."),
    (
        r"^layer(\d)\.(\d+)\.downsample\.0\.",
        lambda m: f"encoder.stages.{int(m[1]) - 1}.layers.{m[2]}.shortcut.convolution.",
    ),
    (
        r"^layer(\d)\.(\d+)\.downsample\.1\.",
        lambda m: f"encoder.stages.{int(m[1]) - 1}.layers.{m[2]}.shortcut.normalization.",
    ),
    (
        r"^layer(\d)\.(\d+)\.conv(\d)\.",
        lambda m: f"encoder.stages.{int(m[1]) - 1}.layers.{m[2]}.layer.{int(m[3]) - 1}.convolution.",
    ),
    (
        r"^layer(\d)\.(\d+)\.bn(\d)\.",
        lambda m: f"encoder.stages.{int(m[1]) - 1}.layers.{m[2]}.layer.{int(m[3]) - 1}.normalization.",
    ),
]


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
        body = re.match(r"^backbone\.0\.body\.(.*)$", key)
        if body and backbone == "transformers":
            out["model.backbone.conv_encoder.model." + _rename(body[1], _TO_TRANSFORMERS_RESNET)] = value
            continue
        renamed = _rename(key, _TO_HUGGINGFACE)
        if renamed == key and not key.startswith(("class_embed.", "bbox_embed.")):
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
