"""Writes tests/fixtures/dino/state_keys.json: the key, shape and dtype of every entry of the state_dict that DINO's
own code (github.com/IDEA-Research/DINO, commit faa8520) builds for the variants tests/test_dino_weights.py reads
(R50 4-scale and 5-scale, Swin-T 4-scale; DINO's configs with a small transformer, the backbones whole), so the
tests check the mapping against their names without their code. Run with a checkout of theirs:

    python tests/make_dino_keys.py --dino PATH/TO/DINO

Their code is imported as tests/dino_code.py imports it (its stand-ins, their main.py's args)."""

import argparse
import json
from pathlib import Path

from dino_code import DINO_COMMIT, dino_args, import_dino, on_the_cpu

HERE = Path(__file__).resolve().parent
# DINO's config/DINO/DINO_4scale.py with a small transformer: every kind of key at a tenth of the size
SMALL = dict(hidden_dim=64, dim_feedforward=128, enc_layers=2, dec_layers=3, num_queries=30, num_classes=5)
SMALL["dn_labelbook_size"] = 5
VARIANTS = {
    "r50_4scale": dict(backbone="resnet50", return_interm_indices=[1, 2, 3], num_feature_levels=4),
    "r50_5scale": dict(backbone="resnet50", return_interm_indices=[0, 1, 2, 3], num_feature_levels=5),
    "swin_t_4scale": dict(backbone="swin_T_224_1k", return_interm_indices=[1, 2, 3], num_feature_levels=4),
}


def build(models, config: str, **changes):
    """Their model for their main.py's args of config/DINO/`config` with `changes`, on the CPU."""
    with on_the_cpu():
        return models.dino.dino.build_dino(dino_args(models, config, device="cpu", **changes))[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dino", type=Path, required=True, help="a checkout of IDEA-Research/DINO")
    args = parser.parse_args()
    models = import_dino(args.dino)
    keys = {"commit": DINO_COMMIT, "changes": SMALL, "variants": {}}
    for name, variant in VARIANTS.items():
        model = build(models, "DINO_4scale.py", **SMALL, **variant)
        state = model.state_dict()
        keys["variants"][name] = {
            "changes": variant,
            "state": {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in state.items()},
        }
    out = HERE / "fixtures" / "dino" / "state_keys.json"
    out.write_text(json.dumps(keys, indent=0) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
