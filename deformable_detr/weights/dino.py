"""DINO's checkpoints (github.com/IDEA-Research/DINO at faa8520: its main.py saves `{"model": state_dict, "args":
Namespace, ...}`) and detrex's (github.com/IDEA-Research/detrex, projects/dino: detectron2's checkpointer, `{"model":
state_dict, ...}`, no args), both ways.

DINO's state_dict is the authors' layout (weights/authors.py) with DINO's parts beside it: its Swin directly under
`backbone.0.` (its ResNet under `backbone.0.body.`, as the authors'), one class head and one box head shared by
the decoder's layers and written once per layer (`class_embed.0..5`, again as `transformer.decoder.class_embed.0..5`),
the encoder's own heads (`transformer.enc_out_class_embed`, `transformer.enc_out_bbox_embed`), `label_enc`,
`transformer.tgt_embed`, `transformer.decoder.ref_point_head` and `transformer.decoder.norm`. `sanitize` renames
the Swin, checks the tied copies equal and drops them, then leaves the rest (buffers, OIHW -> OHWI, the key check)
to the authors' `sanitize`; `to_dino` is its inverse, through the authors' `to_authors`.

detrex names the same model detectron2's way (`backbone.res2.0.conv1.norm.*`, `neck.convs.0.conv.*`,
`transformer.level_embeds`, `layers.0.attentions.0`, `norms.0`, `ffns.0.layers.0.0`); `from_detrex` and
`to_detrex` map its keys to DINO's and back, one table read both ways. Its model differs from DINO's in what keys
cannot all show: a class and a box head for each decoder layer and one more for the encoder (never shared), the
position encoding of the authors (the half-pixel offset, temperature 10000), `label_enc` of num_classes rows."""

import argparse
import re

import numpy as np

from ..errors import ConversionError
from .authors import sanitize as authors_sanitize
from .authors import to_authors
from .backbones import (
    DINO_BODY,
    backbone_from_dino,
    backbone_in,
    backbone_in_dino,
    backbone_to_dino,
    key_from_dino,
    key_to_dino,
)
from .huggingface import _rename

HALF_SHARED = (
    "a class head shared by the decoder's layers and box heads per layer, or the other way "
    "(dec_pred_class_embed_share != dec_pred_bbox_embed_share): not built; both shared or both per layer are"
)
OFFSET_POSITION = (
    "this model's position encoding has the authors' half-pixel offset (model.position_offset {offset}: detrex's "
    "DINO), which DINO's code has not: its layout would load and answer otherwise"
)
HEADS = re.compile(r"^(transformer\.decoder\.)?(class_embed|bbox_embed)\.(\d+)\.(.*)$")

# The values of DINO's config/DINO/DINO_4scale.py for what their build_dino reads (models/dino/*.py), and main.py's
# defaults for the rest: the args a checkpoint of theirs carries, in which `dino_args` writes a model's own values.
DINO_ARGS = {
    "modelname": "dino",
    "dataset_file": "coco",
    "device": "cuda",
    "frozen_weights": None,
    "backbone": "resnet50",
    "use_checkpoint": False,
    "lr_backbone": 1e-05,
    "backbone_freeze_keywords": None,
    "dilation": False,
    "position_embedding": "sine",
    "pe_temperatureH": 20,
    "pe_temperatureW": 20,
    "return_interm_indices": [1, 2, 3],
    "enc_layers": 6,
    "dec_layers": 6,
    "unic_layers": 0,
    "pre_norm": False,
    "dim_feedforward": 2048,
    "hidden_dim": 256,
    "dropout": 0.0,
    "nheads": 8,
    "num_queries": 900,
    "query_dim": 4,
    "num_patterns": 0,
    "random_refpoints_xy": False,
    "fix_refpoints_hw": -1,
    "use_deformable_box_attn": False,
    "box_attn_type": "roi_align",
    "dec_layer_number": None,
    "num_feature_levels": 4,
    "enc_n_points": 4,
    "dec_n_points": 4,
    "decoder_layer_noise": False,
    "dln_xy_noise": 0.2,
    "dln_hw_noise": 0.2,
    "add_channel_attention": False,
    "add_pos_value": False,
    "two_stage_type": "standard",
    "two_stage_pat_embed": 0,
    "two_stage_add_query_num": 0,
    "two_stage_bbox_embed_share": False,
    "two_stage_class_embed_share": False,
    "two_stage_learn_wh": False,
    "two_stage_default_hw": 0.05,
    "two_stage_keep_all_tokens": False,
    "num_select": 300,
    "transformer_activation": "relu",
    "batch_norm_type": "FrozenBatchNorm2d",
    "masks": False,
    "aux_loss": True,
    "set_cost_class": 2.0,
    "set_cost_bbox": 5.0,
    "set_cost_giou": 2.0,
    "cls_loss_coef": 1.0,
    "mask_loss_coef": 1.0,
    "dice_loss_coef": 1.0,
    "bbox_loss_coef": 5.0,
    "giou_loss_coef": 2.0,
    "enc_loss_coef": 1.0,
    "interm_loss_coef": 1.0,
    "no_interm_box_loss": False,
    "focal_alpha": 0.25,
    "decoder_sa_type": "sa",
    "matcher_type": "HungarianMatcher",
    "decoder_module_seq": ["sa", "ca", "ffn"],
    "nms_iou_threshold": -1,
    "dec_pred_bbox_embed_share": True,
    "dec_pred_class_embed_share": True,
    "use_dn": True,
    "dn_number": 100,
    "dn_box_noise_scale": 0.4,
    "dn_label_noise_ratio": 0.5,
    "embed_init_tgt": True,
    "dn_labelbook_size": 91,
    "match_unstable_error": True,
    "use_detached_boxes_dec_out": False,
    "num_classes": 91,
}
# ModelConfig fields -> DINO's argparse names, where the two say the same thing the same way
_SAME_ARGS = {
    "dilation": "dilation",
    "enc_layers": "enc_layers",
    "dec_layers": "dec_layers",
    "dim_feedforward": "dim_feedforward",
    "hidden_dim": "hidden_dim",
    "nheads": "nheads",
    "num_queries": "num_queries",
    "enc_n_points": "enc_n_points",
    "dec_n_points": "dec_n_points",
    "num_feature_levels": "num_feature_levels",
    "dropout": "dropout",
    "dn_label_noise_ratio": "dn_label_noise_ratio",
    "dn_box_noise_scale": "dn_box_noise_scale",
}
# What DINO's args may ask for that this project does not build: (the arg, its value as built, what it is)
_NOT_BUILT = (
    ("masks", False, "DINO's segmentation head (masks)"),
    ("two_stage_type", "standard", "a two_stage_type other than standard"),
    ("num_patterns", 0, "query patterns (num_patterns > 0)"),
    ("decoder_sa_type", "sa", "a decoder self-attention other than sa"),
    ("two_stage_add_query_num", 0, "learned queries added to the proposals (two_stage_add_query_num > 0)"),
    ("two_stage_pat_embed", 0, "proposal pattern embeddings (two_stage_pat_embed > 0)"),
    ("two_stage_learn_wh", False, "learned proposal sizes (two_stage_learn_wh)"),
    ("two_stage_keep_all_tokens", False, "all tokens kept as proposals (two_stage_keep_all_tokens)"),
    ("dec_layer_number", None, "a query count per decoder layer (dec_layer_number)"),
    ("add_channel_attention", False, "the encoder's channel attention (add_channel_attention)"),
    ("use_deformable_box_attn", False, "deformable box attention (use_deformable_box_attn)"),
    ("pre_norm", False, "pre-norm layers (pre_norm)"),
    ("unic_layers", 0, "unicoder layers (unic_layers > 0)"),
    ("transformer_activation", "relu", "an activation other than relu (transformer_activation)"),
    ("decoder_module_seq", ["sa", "ca", "ffn"], "a decoder layer order other than sa, ca, ffn"),
    ("embed_init_tgt", True, "content queries taken from the proposals (embed_init_tgt False)"),
    ("query_dim", 4, "reference points of other than 4 values (query_dim)"),
)


def is_dino(state: dict) -> bool:
    """A DINO main.py state_dict: its denoising labels' embedding and its decoder's query-position head, under the
    authors' names (`transformer.level_embed`: detrex's is `level_embeds`)."""
    keys = ("label_enc.weight", "transformer.decoder.ref_point_head.layers.0.weight", "transformer.level_embed")
    return all(key in state for key in keys)


def is_detrex(state: dict) -> bool:
    """A detrex DINO state_dict: DINO's parts under detrex's names (its transformer's `level_embeds`)."""
    return "label_enc.weight" in state and "transformer.level_embeds" in state


def not_built(args: dict) -> str | None:
    """What DINO's `args` ask for that this project does not build, in one line; None where all is built."""
    for name, built, what in _NOT_BUILT:
        if name in args and args[name] != built:
            return f"{what}: not built (args.{name} = {args[name]!r})"
    if args.get("position_embedding", "sine") not in ("sine", "v2"):
        return f"DINO's learned position embedding: not built (args.position_embedding {args['position_embedding']!r})"
    if args.get("pe_temperatureH", 20) != args.get("pe_temperatureW", 20):
        return (
            f"DINO's position encoding with temperatures {args['pe_temperatureH']} (y) and {args['pe_temperatureW']} "
            "(x): not built; one temperature is (model.position_temperature)"
        )
    if args.get("nms_iou_threshold", -1) > 0:
        return "DINO's non-maximum suppression of its detections: not built (args.nms_iou_threshold > 0)"
    if str(args.get("backbone")).startswith("swin") and args.get("dilation"):
        return f"DINO's dilated Swin ({args['backbone']} with args.dilation): not built"
    return None


def _count(state: dict, prefix: str, position: int) -> int:
    return len({k.split(".")[position] for k in state if k.startswith(prefix)})


def _shared_heads(state: dict) -> bool:
    """Whether every decoder layer's class and box heads are one (DINO's dec_pred_*_embed_share): equal to the
    first layer's, wherever written."""
    for key, value in state.items():
        match = HEADS.match(key)
        if match and match[3] != "0":
            first = state.get(f"{match[2]}.0.{match[4]}", state.get(f"transformer.decoder.{match[2]}.0.{match[4]}"))
            if first is None or not np.array_equal(first, value):
                return False
    return True


def state_options(state: dict) -> dict:
    """The ModelConfig fields that DINO's state_dict keys and shapes show."""
    kernels = [state[f"input_proj.{i}.0.weight"].shape[-1] for i in range(_count(state, "input_proj.", 1))]
    options = {
        "backbone": backbone_in_dino(state),
        "num_feature_levels": len(kernels),
        "backbone_maps": sum(1 for size in kernels if size == 1),  # the maps' 1 x 1 projections; extras 3 x 3
        "enc_layers": _count(state, "transformer.encoder.layers.", 3),
        "dec_layers": _count(state, "transformer.decoder.layers.", 3),
        "hidden_dim": int(state["transformer.level_embed"].shape[1]),
        "dim_feedforward": int(state["transformer.encoder.layers.0.linear1.weight"].shape[0]),
        "num_queries": int(state["transformer.tgt_embed.weight"].shape[0]),
        "num_classes": int(state["transformer.enc_out_class_embed.weight"].shape[0]),
        "dn_labelbook_size": int(state["label_enc.weight"].shape[0]) - 1,  # their label_enc: the book and one more
    }
    if "backbone.0.body.conv1.weight" in state:  # a ResNet's
        options["backbone_width"] = int(state["backbone.0.body.conv1.weight"].shape[0])
    return options


def model_options(state: dict, args: dict, source: str = "checkpoint", detrex: bool = False) -> dict:
    """ModelConfig fields for DINO's checkpoint: DINO's model (two-stage, box refinement, mixed selection, look
    forward twice), what its keys show, and from its args what keys cannot show (heads, points, the position
    encoding's temperature, denoising, dropout, DC5); without args, DINO's configs' values. What the args or the
    state ask for that is not built is a ConversionError in one line."""
    if problem := not_built(args):
        raise ConversionError(f"{source}: {problem}")
    if args.get("dec_pred_class_embed_share", True) != args.get("dec_pred_bbox_embed_share", True):
        raise ConversionError(f"{source}: {HALF_SHARED}")
    options = {
        "architecture": "dino",
        "two_stage": True,
        "with_box_refine": True,
        "mixed_selection": True,
        "look_forward_twice": True,
        "dropout": 0.0,
        "position_temperature": 20.0,
        "position_offset": 0.0,
        "dn_number": 100,
        "decoder_heads": "auto" if _shared_heads(state) else "per_layer",
    }
    if detrex:  # its keys mapped to DINO's (from_detrex): the authors' position encoding, its configs' box noise
        options.update(position_temperature=10000.0, position_offset=0.5, dn_box_noise_scale=1.0)
    options.update({field: args[name] for field, name in _SAME_ARGS.items() if name in args})
    if "pe_temperatureH" in args:
        options["position_temperature"] = float(args["pe_temperatureH"])
    if "dn_number" in args:
        options["dn_number"] = int(args["dn_number"]) if args.get("use_dn", True) else 0
    shown = state_options(state)
    if shown["backbone"] == "unknown":
        raise ConversionError(f"{source}: its backbone's shapes are none this project builds")
    named = backbone_from_dino(args["backbone"], source) if "backbone" in args else None
    if named is not None and named != shown["backbone"]:
        raise ConversionError(
            f"{source}: its args name the backbone {args['backbone']}; its weights hold a {shown['backbone']}"
        )
    indices = args.get("return_interm_indices")
    if indices is not None and len(indices) != shown["backbone_maps"]:
        raise ConversionError(
            f"{source}: its args take the backbone's maps {indices}; its weights project {shown['backbone_maps']}"
        )
    options.update(shown)
    return options


def config_for(options: dict) -> str:
    """The configs/ file of DINO's recipe a DINO model's options match: its Swin-L (window 12) or R50 rows, 4-scale
    or 5-scale, 12 epochs (another backbone's options name it over the R50 recipe's)."""
    scales = 5 if options.get("backbone_maps") == 4 else 4
    swin_large = options.get("backbone") == "swin_large_window12"
    return f"dino_{'swin_large' if swin_large else 'r50'}_{scales}scale_12ep.yaml"


def _twin(key: str, shared: bool) -> str | None:
    """The key a tied copy of a head shares its value with (the decoder's references to the top-level heads; with
    shared heads, every layer's to the first's), or None for a key stored as it is."""
    match = HEADS.match(key)
    if match is None or (not match[1] and (not shared or match[3] == "0")):
        return None
    return f"{match[2]}.{'0' if shared else match[3]}.{match[4]}"


def sanitize(state: dict, expected: dict | None = None, source: str = "checkpoint") -> dict:
    """DINO's state_dict (numpy arrays) -> this port's weights: its Swin under `backbone.0.body.`, the tied copies of
    the heads checked equal and dropped, then the authors' `sanitize` (buffers, convolutions OIHW -> OHWI, with
    `expected` every key and shape checked)."""
    shared, backbone = _shared_heads(state), backbone_in_dino(state)
    out = {}
    for key, value in state.items():
        key = key if backbone == "unknown" else key_from_dino(key, backbone)
        twin = _twin(key, shared)
        if twin is not None:
            kept = state.get(twin, out.get(twin))
            if kept is not None:
                if not np.array_equal(kept, value):
                    raise ConversionError(f"{source}: {key} should be tied to {twin} but differs from it")
                continue
            key = twin  # the file kept only this copy of a tied tensor
        out[key] = value
    return authors_sanitize(out, expected, source)


def to_dino(weights: dict) -> dict:
    """This port's weights of a DINO model -> DINO's state_dict (numpy arrays), every key their model has: the
    shared heads written for each decoder layer and again as the decoder's, the Swin under `backbone.0.`."""
    heads = {k: v for k, v in weights.items() if HEADS.match(k)}
    state = to_authors({k: v for k, v in weights.items() if k not in heads})  # OIHW, a Swin's index buffers
    layers = _count(weights, "transformer.decoder.layers.", 3)
    for key, value in heads.items():
        match = HEADS.match(key)
        for layer in range(layers) if match[3] == "0" and f"{match[2]}.1.{match[4]}" not in weights else [match[3]]:
            state[f"{match[2]}.{layer}.{match[4]}"] = value
            state[f"transformer.decoder.{match[2]}.{layer}.{match[4]}"] = value
    backbone = backbone_in(weights)
    return {key_to_dino(k, backbone): v for k, v in state.items()}


def dino_args(config: dict, weights: dict) -> argparse.Namespace:
    """The args DINO's main.py writes beside the state_dict of a model of `config` (ModelConfig as a dict) with
    `weights` (the class and label counts are read from them): DINO's config's values, the model's own where it
    has them."""
    if config.get("position_offset", 0.0) != 0.0:
        raise ConversionError(OFFSET_POSITION.format(offset=config["position_offset"]))
    args = dict(DINO_ARGS)
    args.update({name: config[field] for field, name in _SAME_ARGS.items() if field in config})
    shared = config.get("decoder_heads", "auto") != "per_layer"
    maps = config.get("backbone_maps", "auto")
    maps = 3 if maps == "auto" else int(maps)
    dn_number = int(config.get("dn_number", 0))
    args.update(
        backbone=backbone_to_dino(config.get("backbone", "resnet50")),
        return_interm_indices=list(range(4 - maps, 4)),
        pe_temperatureH=config.get("position_temperature", 20),
        pe_temperatureW=config.get("position_temperature", 20),
        use_dn=dn_number > 0,
        dn_number=dn_number,
        num_classes=int(weights["class_embed.0.weight"].shape[0]),
        dn_labelbook_size=int(weights["label_enc.weight"].shape[0]) - 1,
        dec_pred_class_embed_share=shared,
        dec_pred_bbox_embed_share=shared,
    )
    return argparse.Namespace(**args)


# detrex's names -> DINO's, one table read both ways (as Hugging Face's, by its `_rename`): (detrex's prefix, DINO's).
# A key takes the first row whose prefix it starts with, the rest of it as it is. {i} stands for a number, the same
# on both sides; {s+1} for one more than the other side's {s} (detectron2's ResNet stages res2..res5 are
# torchvision's layer1..layer4).
_DETREX_KEYS = [
    ("backbone.stem.conv1.norm.", "backbone.0.body.bn1."),
    ("backbone.stem.conv1.", "backbone.0.body.conv1."),
    ("backbone.res{s+1}.{b}.shortcut.norm.", "backbone.0.body.layer{s}.{b}.downsample.1."),
    ("backbone.res{s+1}.{b}.shortcut.", "backbone.0.body.layer{s}.{b}.downsample.0."),
    ("backbone.res{s+1}.{b}.conv{c}.norm.", "backbone.0.body.layer{s}.{b}.bn{c}."),
    ("backbone.res{s+1}.{b}.conv{c}.", "backbone.0.body.layer{s}.{b}.conv{c}."),
    ("neck.convs.{i}.conv.", "input_proj.{i}.0."),
    ("neck.convs.{i}.norm.", "input_proj.{i}.1."),
    ("transformer.level_embeds", "transformer.level_embed"),
    ("transformer.encoder.layers.{i}.attentions.0.", "transformer.encoder.layers.{i}.self_attn."),
    ("transformer.encoder.layers.{i}.norms.0.", "transformer.encoder.layers.{i}.norm1."),
    ("transformer.encoder.layers.{i}.norms.1.", "transformer.encoder.layers.{i}.norm2."),
    *(
        (f"transformer.{stack}.layers.{{i}}.ffns.0.layers.{theirs}.", f"transformer.{stack}.layers.{{i}}.{ours}.")
        for stack in ("encoder", "decoder")
        for theirs, ours in (("0.0", "linear1"), ("1", "linear2"))
    ),
    ("transformer.decoder.layers.{i}.attentions.0.attn.", "transformer.decoder.layers.{i}.self_attn."),
    ("transformer.decoder.layers.{i}.attentions.1.", "transformer.decoder.layers.{i}.cross_attn."),
    ("transformer.decoder.layers.{i}.norms.0.", "transformer.decoder.layers.{i}.norm2."),
    ("transformer.decoder.layers.{i}.norms.1.", "transformer.decoder.layers.{i}.norm1."),
    ("transformer.decoder.layers.{i}.norms.2.", "transformer.decoder.layers.{i}.norm3."),
    ("transformer.", "transformer."),  # tgt_embed, enc_output(_norm), the decoder's ref_point_head and norm
    ("label_enc.", "label_enc."),
    ("class_embed.", "class_embed."),
    ("bbox_embed.", "bbox_embed."),
]


def from_detrex(state: dict, source: str = "checkpoint") -> dict:
    """detrex's DINO state_dict -> DINO's: the ResNet's and the neck's names, the transformer's layers'; its Swin
    under `backbone.0.`; the extra levels' convolutions after the maps'; the last of its heads (the encoder's) as
    `transformer.enc_out_*`; `label_enc` one row longer (DINO's book of dn_labelbook_size labels and one more),
    so the book is detrex's classes, from which its noise draws."""
    maps = _count(state, "neck.convs.", 2)
    layers = _count(state, "transformer.decoder.layers.", 3)
    swin = "backbone.patch_embed.proj.weight" in state
    out = {}
    for key, value in state.items():
        extra = re.match(r"^neck\.extra_convs\.(\d+)\.(conv|norm)\.(.*)$", key)
        head = HEADS.match(key)
        if extra:
            renamed = f"input_proj.{maps + int(extra[1])}.{'0' if extra[2] == 'conv' else '1'}.{extra[3]}"
        elif head and int(head[3]) == layers:  # the encoder's heads, after the decoder's
            if head[1]:
                renamed = f"transformer.decoder.enc_out_{head[2]}.{head[4]}"  # a tied copy: checked below
            else:
                renamed = f"transformer.enc_out_{head[2]}.{head[4]}"
        elif swin and key.startswith("backbone."):
            renamed = DINO_BODY["swin"] + key.removeprefix("backbone.")
        else:
            renamed = _rename(key, _DETREX_KEYS, to_authors=True)
        if renamed is None:
            raise ConversionError(f"{source}: unknown key {key} for detrex's DINO")
        out[renamed] = value
    if "label_enc.weight" in out:  # detrex's: a row per class; DINO's one more, never read (its noise < the book)
        rows = out["label_enc.weight"]
        out["label_enc.weight"] = np.concatenate([rows, np.zeros_like(rows[:1])])
    for key in [k for k in out if k.startswith("transformer.decoder.enc_out_")]:
        twin = "transformer." + key.removeprefix("transformer.decoder.")
        if twin in out and not np.array_equal(out[twin], out[key]):
            raise ConversionError(f"{source}: the decoder's copy of the encoder's head {key} differs from it")
        out.setdefault(twin, out.pop(key))
        out.pop(key, None)
    return out


def to_detrex(state: dict) -> dict:
    """DINO's state_dict (every head written out, as `to_dino` gives) -> detrex's: the inverse of `from_detrex`
    (`label_enc` one row shorter: a book of as many labels as classes)."""
    maps = sum(1 for k in state if re.match(r"^input_proj\.\d+\.0\.weight$", k) and state[k].shape[-1] == 1)
    layers = _count(state, "transformer.decoder.layers.", 3)
    swin = DINO_BODY["swin"] + "patch_embed.proj.weight" in state
    classes, rows = state["transformer.enc_out_class_embed.weight"].shape[0], state["label_enc.weight"].shape[0]
    if rows != classes + 1:
        raise ConversionError(f"label_enc.weight has {rows} rows: detrex's DINO embeds its {classes} classes' labels")
    out = {}
    for key, value in state.items():
        value = value[:classes] if key == "label_enc.weight" else value
        level = re.match(r"^input_proj\.(\d+)\.([01])\.(.*)$", key)
        encoder_head = re.match(r"^transformer\.enc_out_(class_embed|bbox_embed)\.(.*)$", key)
        if level and int(level[1]) >= maps:
            out[f"neck.extra_convs.{int(level[1]) - maps}.{'conv' if level[2] == '0' else 'norm'}.{level[3]}"] = value
        elif encoder_head:
            out[f"{encoder_head[1]}.{layers}.{encoder_head[2]}"] = value
            out[f"transformer.decoder.{encoder_head[1]}.{layers}.{encoder_head[2]}"] = value
        elif swin and key.startswith(DINO_BODY["swin"]):
            out["backbone." + key.removeprefix(DINO_BODY["swin"])] = value
        else:
            renamed = _rename(key, _DETREX_KEYS, to_authors=False)
            if renamed is None:
                raise ConversionError(f"{key}: no detrex name for it")
            out[renamed] = value
    return out
