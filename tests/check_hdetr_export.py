"""A model of this port exported to H-Deformable-DETR's layout loads in their code and answers as ours: the check
behind tests/test_hdetr.py's key-for-key export test, run where a checkout of theirs is at hand (their code cannot
run in the suite: it needs their checkout).

    python tests/check_hdetr_export.py --hdetr /tmp/hdetr [--variants hybrid tricks swin_hybrid]

Per variant: our model with the fixture's weights, trained one step here (so the weights are ours, not the
recipe's), `export --to torch`'s file, their `build(args)` from the file's args with their main.py's defaults,
`load_state_dict(strict=True)`, then their evaluation-mode forward against ours on the fixture's images.
"""

import argparse
import sys
from pathlib import Path

import kernels  # noqa: F401  (first: the BLAS)
from deformable_detr import build_model
from deformable_detr.training.trainer import Trainer
from deformable_detr.weights.authors import expected_shapes, sanitize
from deformable_detr.weights.conversion import export_torch

import mlx.core as mx
import numpy as np
import test_hdetr as fixture
import torch
from hdetr_code import hdetr_args, import_hdetr
from mlx.utils import tree_flatten


def check(models, variant: str, out_dir: Path) -> float:
    cfg, _ = fixture.config(variant)
    cfg.schedule.batch_size = cfg.schedule.micro_batch_size = 2
    cfg.train.activation_checkpointing = False
    model = build_model(cfg)
    model.load_weights(
        [(k, mx.array(v)) for k, v in sanitize(fixture.their_state(variant), expected_shapes(model)).items()]
    )
    pixels, mask = fixture.images()
    targets = [
        {"labels": np.array(t["labels"]), "boxes": np.array(t["boxes"], np.float32)}
        for t in fixture.manifest()["targets"]
    ]
    Trainer.from_config(model, cfg, [(416, 320)]).step([(np.array(pixels), np.array(mask), targets)])
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    path = out_dir / f"{variant}.pth"
    print(export_torch(weights, vars(cfg.model), path))
    checkpoint = torch.load(path, weights_only=False)
    args = hdetr_args(models, device="cpu", **{k: v for k, v in vars(checkpoint["args"]).items() if k != "num_queries"})
    args.pretrained_backbone_path = None  # their Swin's init_weights(None): the file's weights follow
    theirs, _, _ = models.build(args)
    theirs.load_state_dict(checkpoint["model"], strict=True)
    theirs.num_queries = theirs.num_queries_one2one
    theirs.transformer.two_stage_num_proposals = theirs.num_queries
    theirs.eval()
    model.eval()
    samples = models.deformable_detr.NestedTensor(
        torch.from_numpy(np.array(pixels).transpose(0, 3, 1, 2).copy()), torch.from_numpy(np.array(mask))
    )
    with torch.no_grad():
        their_logits = theirs(samples)["pred_logits"].numpy()
    ours = np.array(model(pixels, mask)["pred_logits"])
    return float(np.abs(ours - their_logits).max())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hdetr", type=Path, required=True)
    parser.add_argument("--variants", nargs="+", default=["hybrid", "tricks", "swin_hybrid"])
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp"))
    options = parser.parse_args()
    models = import_hdetr(options.hdetr)
    for variant in options.variants:
        difference = check(models, variant, options.out_dir)
        print(f"{variant}: loads in their code (strict); their eval logits within {difference:.2e} of ours")


if __name__ == "__main__":
    sys.exit(main())
