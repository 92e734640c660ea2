"""Export this port's weights to the authors' PyTorch layout.

    python -m deformable_detr.export --to torch MODEL.safetensors OUT.pth [--config FILE]

MODEL is converted weights (`deformable_detr.convert`) or a training checkpoint (`train.py`). OUT
is `{"model": state_dict, "args": Namespace}` as the authors' `main.py` saves it: their key names,
convolutions OIHW, and the tied keys restored (without box refinement one `class_embed` /
`bbox_embed` repeated for every decoder layer; the decoder's references to the top-level heads with
refinement or two-stage). `args` holds the model options the keys cannot show (heads, points, DC5),
from the checkpoint's config or `--config`. Before writing, the export converts its own result back
and checks that every tensor comes back unchanged. Needs PyTorch (`pip install -e ".[convert]"`).
"""

import argparse
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


@entry_point
def main(argv=None):
    parser = ArgumentParser(prog="python -m deformable_detr.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--to", choices=["torch"], required=True, help="the target layout")
    parser.add_argument("src", type=Path, help="converted weights or a training checkpoint (.safetensors)")
    parser.add_argument("dst", type=Path, help="the .pth file to write")
    parser.add_argument("--config", type=Path, help="the model's config, for args the weights cannot show")
    parser.add_argument(
        "--raw-weights", action="store_true", help="the trained weights, not their EMA (where the file has one)"
    )
    args = parser.parse_args(argv)
    print(export_torch(args.src, args.dst, args.config, args.raw_weights))


if __name__ == "__main__":
    main()
