"""Export this port's weights to the authors' PyTorch layout or to Hugging Face transformers'.

    python -m deformable_detr.export --to torch MODEL.safetensors OUT.pth [--config FILE]
    python -m deformable_detr.export --to huggingface MODEL.safetensors DIR [--hf-backbone timm|transformers]
    python -m deformable_detr.export --to onnx MODEL.safetensors OUT.onnx [--size H W] [--postprocess]
        [--batch-size N] [--sampler gather|grid_sample]    (deformable_detr/onnx_export: the `onnx` extra)

`--to huggingface` writes DIR/config.json (the variant, `id2label` from the category names),
preprocessor_config.json (the resize and normalisation) and model.safetensors in the layout of the
Hub's SenseTime checkpoints, for `DeformableDetrForObjectDetection.from_pretrained(DIR)` and
transformers' pipelines; checked, as below, to convert back unchanged.

MODEL is converted weights (`deformable_detr.convert`) or a training checkpoint (`train.py`). OUT
is `{"model": state_dict, "args": Namespace}` as the authors' `main.py` saves it: their key names,
convolutions OIHW, and the tied keys restored (without box refinement one `class_embed` /
`bbox_embed` repeated for every decoder layer; the decoder's references to the top-level heads with
refinement or two-stage). `args` holds the model options the keys cannot show (heads, points, DC5),
from the checkpoint's config or `--config`. Before writing, the export converts its own result back
and checks that every tensor comes back unchanged. Needs PyTorch (`pip install -e ".[convert]"`).
"""

import argparse
import json
import re
from pathlib import Path

import numpy as np

from .cli import ArgumentParser, entry_point
from .convert import ConversionError, sanitize
from .weights import atomic_write, read_weights

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
)


def read_port_weights(path: Path, raw: bool = False) -> tuple[dict, dict | None]:
    """-> (this port's weights as numpy arrays: their EMA where the file has one, unless `raw`; the
    model config dict of a training checkpoint or None)."""
    weights = read_weights(path, raw)
    if "class_embed.0.weight" not in weights.tensors or "transformer.level_embed" not in weights.tensors:
        raise ConversionError(
            f"{path}: not Deformable DETR weights (no class_embed.0.weight / transformer.level_embed)"
        )
    return {k: np.array(v) for k, v in weights.tensors.items()}, (weights.config or {}).get("model")


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
    return out


def authors_args(config: dict | None) -> argparse.Namespace:
    return argparse.Namespace(**{name: config[name] for name in AUTHORS_ARGS if config and name in config})


def export_torch(src: Path, dst: Path, config_path: Path | None = None, raw: bool = False) -> str:
    """Write `dst` from `src`; return a one-line summary."""
    try:
        import torch
    except ImportError:
        raise ConversionError(
            "exporting to PyTorch needs PyTorch; install it with pip install -e '.[convert]'"
        ) from None
    weights, config = read_port_weights(src, raw)
    if config_path is not None:
        from .config import config_to_dict, load_config

        config = config_to_dict(load_config(config_path))["model"]
    state = to_authors(weights)
    back = sanitize(state, source=str(src))
    if back.keys() != weights.keys() or any(not np.array_equal(back[k], weights[k]) for k in weights):
        raise ConversionError(f"{src}: the exported state_dict does not convert back to the same weights")
    checkpoint = {"model": {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}}
    checkpoint["args"] = authors_args(config)
    with atomic_write(dst) as tmp:
        torch.save(checkpoint, tmp)
    return f"wrote {len(state)} tensors ({len(weights)} distinct) in the authors' layout to {dst}"


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

RESNETS = {  # name -> (depths, block) of torchvision's ResNets
    "resnet18": ([2, 2, 2, 2], "basic"),
    "resnet34": ([3, 4, 6, 3], "basic"),
    "resnet50": ([3, 4, 6, 3], "bottleneck"),
    "resnet101": ([3, 4, 23, 3], "bottleneck"),
}


def to_huggingface(state: dict, backbone: str) -> dict:
    """The authors' state_dict (numpy, tied keys restored) -> `DeformableDetrForObjectDetection`'s,
    the ResNet under timm's names (torchvision's) or transformers' own ResNet's."""
    from .convert import _rename

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
    depths, block = RESNETS[name]
    expansion = 4 if block == "bottleneck" else 1
    resnet = {
        "model_type": "resnet",
        "embedding_size": width,
        "hidden_sizes": [width * expansion * 2**i for i in range(4)],
        "depths": depths,
        "layer_type": block,
        "out_features": ["stage4"] if model["num_feature_levels"] == 1 else ["stage2", "stage3", "stage4"],
    }
    return {**fields, "backbone": None, "backbone_config": resnet}


def huggingface_config(model: dict, names: dict, backbone: str) -> dict:
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


def export_huggingface(src, out_dir: Path, config_path=None, raw: bool = False, backbone: str = "timm") -> str:
    """Write `out_dir`/config.json, preprocessor_config.json and model.safetensors for transformers'
    `DeformableDetrForObjectDetection.from_pretrained(out_dir)`; return a one-line summary."""
    from .config import config_to_dict, load_config
    from .convert import huggingface_to_authors
    from .weights import config_from_weights, write_safetensors

    weights, _ = read_port_weights(src, raw)
    cfg = config_to_dict(load_config(config_path) if config_path else config_from_weights(src))
    model = {**cfg["model"], "num_classes": int(weights["class_embed.0.bias"].shape[0])}
    hf_config = huggingface_config(model, read_weights(src, raw).class_names, backbone)
    processor = image_processor_config(cfg["data"])
    state = to_authors(weights)
    hf_state = to_huggingface(state, backbone)
    back = sanitize(huggingface_to_authors(hf_state), source=str(src))  # as convert reads it
    if back.keys() != weights.keys() or any(not np.array_equal(back[k], weights[k]) for k in weights):
        raise ConversionError(f"{src}: the exported weights do not convert back to the same weights")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, content in (("config.json", hf_config), ("preprocessor_config.json", processor)):
        with atomic_write(out_dir / name) as tmp:
            tmp.write_text(json.dumps(content, indent=2))
    write_safetensors(out_dir / "model.safetensors", hf_state, {"format": "pt"})
    files = "config.json, preprocessor_config.json and model.safetensors"
    return f"wrote {files} ({len(hf_state)} tensors, {backbone}'s ResNet names) to {out_dir}"


@entry_point
def main(argv=None):
    parser = ArgumentParser(prog="python -m deformable_detr.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--to", choices=["torch", "huggingface", "onnx"], required=True, help="the target layout")
    parser.add_argument("src", help="converted weights or a training checkpoint (.safetensors), or hf://ORG/NAME")
    parser.add_argument("dst", type=Path, help="the .pth (torch) or .onnx file to write, or the folder (huggingface)")
    parser.add_argument("--config", type=Path, help="the model's config, where the weights do not record it")
    parser.add_argument(
        "--hf-backbone",
        choices=["timm", "transformers"],
        default="timm",
        help="huggingface: the ResNet under timm's names as the Hub's SenseTime models (from_pretrained needs timm), "
        "or transformers' own ResNet (any width; no DC5)",
    )
    parser.add_argument(
        "--raw-weights", action="store_true", help="the trained weights, not their EMA (where the file has one)"
    )
    add_onnx_arguments(parser)
    args = parser.parse_args(argv)
    if args.to == "onnx" or onnx_options_given(args):
        print(export_onnx_command(args))
    elif args.to == "torch":
        print(export_torch(args.src, args.dst, args.config, args.raw_weights))
    else:
        print(export_huggingface(args.src, args.dst, args.config, args.raw_weights, args.hf_backbone))


# --- export --to onnx (the exporter: deformable_detr/onnx_export) ---------------------------------


def add_onnx_arguments(parser):
    parser.add_argument(
        "--size", type=int, nargs=2, metavar=("H", "W"), help="onnx: the canvas (default: val_size x max_size)"
    )
    parser.add_argument("--batch-size", type=int, default=1, help="onnx: images a run (the graph's static batch)")
    parser.add_argument(
        "--postprocess",
        action="store_true",
        help="onnx: take target_sizes, return the top-100 scores, labels, boxes in pixels",
    )
    parser.add_argument(
        "--sampler", choices=["gather", "grid_sample"], default="gather", help="onnx: the attention's bilinear sampler"
    )


def onnx_options_given(args) -> bool:
    return bool(args.size or args.postprocess or args.batch_size != 1 or args.sampler != "gather")


def export_onnx_command(args) -> str:
    from .cli import UsageError

    if args.to != "onnx":
        raise UsageError(f"--size, --batch-size, --postprocess and --sampler are for --to onnx, not --to {args.to}")
    if args.hf_backbone != "timm":
        raise UsageError("--hf-backbone is for --to huggingface")
    from .config import load_config
    from .onnx_export.export import export_onnx
    from .weights import config_from_weights

    cfg = load_config(args.config) if args.config else config_from_weights(args.src)
    return export_onnx(
        args.src, args.dst, cfg, args.raw_weights, args.size, args.batch_size, args.postprocess, args.sampler
    )


if __name__ == "__main__":
    main()
