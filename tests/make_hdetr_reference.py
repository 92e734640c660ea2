"""Writes tests/fixtures/hdetr/: H-Deformable-DETR's own outputs, losses and gradients, the references that
tests/test_hdetr.py holds this port to. Their code runs on the CPU with the pure-PyTorch attention core, as the
authors' references (tests/fixtures/reference) were made; weights are rebuilt from the same recipe
(tests/reference_weights.py `recipe_value`), so no weights are stored.

    git clone https://github.com/HDETR/H-Deformable-DETR /tmp/hdetr   # at tests/hdetr_code.py's HDETR_COMMIT
    python tests/make_hdetr_reference.py --hdetr /tmp/hdetr [--variants hybrid tricks]

Each variant is one of their configs (configs/two_stage/...), run in float32, training mode with dropout 0:
- `hybrid`: R50, box refinement, two-stage, FFN 2048, dropout 0, mixed selection, look forward twice, and the
  hybrid branch (1,500 one-to-many queries, k 6, lambda 1): their 48.7 AP recipe at 12 epochs
  (r50_hybrid_branch_lambda1_group6_t1500_dp0_mqs_lft_..._two_stage.sh).
- `tricks`: the same without the hybrid branch (r50_dp0_mqs_lft_..._two_stage.sh, 47.0 AP).
- `swin_hybrid`: `hybrid` on Swin-T (swin_tiny_hybrid_branch_lambda1_group6_t1500_dp0_mqs_lft_..._two_stage.sh).

Per variant, `<variant>.safetensors` holds the training-mode outputs of the one-to-one queries (every decoder
layer, the encoder's proposals), the hybrid branch's last layer, the gradients of the weighted loss (their
`train_hybrid` and `SetCriterion`) w.r.t. a few parameters, and the evaluation-mode outputs (their `evaluate`
drops the branch) with their PostProcess; manifest.json the state_dict's keys, the tied keys, the losses,
weight_dict, the total, gradient norms, targets, image sizes and how the images are made."""

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from hdetr_code import HDETR_COMMIT, hdetr_args, import_hdetr, train_hybrid
from reference_weights import recipe_value
from safetensors.numpy import save_file

FIXTURE = Path(__file__).parent / "fixtures" / "hdetr"
SEED = 0
SIZES = [[320, 416], [288, 376]]  # (h, w) of each image; the batch is padded to the largest of each
TARGETS = [  # COCO category ids, boxes as normalised cx, cy, w, h
    {"labels": [1, 18, 62], "boxes": [[0.3, 0.4, 0.2, 0.3], [0.7, 0.6, 0.3, 0.4], [0.5, 0.5, 0.9, 0.8]]},
    {"labels": [3, 3], "boxes": [[0.25, 0.3, 0.3, 0.2], [0.6, 0.7, 0.4, 0.5]]},
]
RECIPE = dict(  # their flags common to the variants (all are two-stage with box refinement)
    with_box_refine=True, two_stage=True, dim_feedforward=2048, dropout=0.0, mixed_selection=True,
    look_forward_twice=True, num_queries_one2one=300, device="cpu",
)  # fmt: skip
VARIANTS = {
    "hybrid": dict(num_queries_one2many=1500, k_one2many=6, lambda_one2many=1.0),
    "tricks": dict(num_queries_one2many=0),
    "swin_hybrid": dict(
        backbone="swin_tiny",
        num_queries_one2many=1500,
        k_one2many=6,
        lambda_one2many=1.0,
        drop_path_rate=0.0,  # stochastic depth off: a reference to compare with, not a random draw
        pretrained_backbone_path=None,  # their init_weights(None): no ImageNet file (the recipe's weights follow)
    ),
}
GRADIENTS = [
    *(
        f"transformer.{stack}.layers.{i}.{attn}.{part}.{kind}"
        for stack, attn in (("encoder", "self_attn"), ("decoder", "cross_attn"))
        for i in (0, 5)
        for part in ("sampling_offsets", "attention_weights")
        for kind in ("weight", "bias")
    ),
    "query_embed.weight",  # mixed selection's content queries (rows SAMPLED_ROWS kept: the branch's from its loss)
    "bbox_embed.0.layers.2.weight",  # with look forward twice, also trained by layer 1's boxes
    "bbox_embed.6.layers.2.weight",  # the encoder proposals' box head
    "transformer.decoder.layers.3.self_attn.in_proj_weight",  # where the branch is masked off (its norm alone)
]
SAMPLED_ROWS = {"query_embed.weight": [*range(8), *range(300, 308)]}  # a one-to-one query's rows, the branch's
NORM_ONLY = {"transformer.decoder.layers.3.self_attn.in_proj_weight"}


def images(sizes, seed):
    """The batch: standard normal pixels (already normalised), zero on the padding, and the padding mask.
    The tests make the same arrays from the same recipe (numpy's PCG64 is the same on every platform)."""
    h, w = max(s[0] for s in sizes), max(s[1] for s in sizes)
    rng = np.random.Generator(np.random.PCG64(seed))
    pixels = rng.standard_normal((len(sizes), 3, h, w)).astype(np.float32)
    mask = np.ones((len(sizes), h, w), np.uint8)
    for i, (ih, iw) in enumerate(sizes):
        mask[i, :ih, :iw] = 0
    pixels[np.broadcast_to(mask[:, None].astype(bool), pixels.shape)] = 0
    return pixels, mask


def recipe_weights(model, seed):
    """Every floating-point tensor of the state_dict from the recipe, in state_dict order; a tensor that
    shares its storage with an earlier key (tied heads) takes that key's value. Integer buffers (Swin's
    relative_position_index) stay as built. -> (state, tied pairs)."""
    state = model.state_dict(keep_vars=True)
    first_of, tied, values = {}, [], {}
    for key, tensor in state.items():
        ptr = tensor.data_ptr()
        if ptr in first_of:
            tied.append([key, first_of[ptr]])
            continue
        first_of[ptr] = key
        if tensor.is_floating_point():
            values[key] = torch.from_numpy(recipe_value(key, tuple(tensor.shape), seed))
    model.load_state_dict({**{k: v.detach() for k, v in state.items()}, **values}, strict=True)
    tied_keys = {k for k, _ in tied}
    for key, source in tied:
        assert torch.equal(state[key], state[source]), f"{key} should be tied to {source}"
    return state, tied, tied_keys


def run(models, name, flags):
    args = hdetr_args(models, **RECIPE, **flags)
    torch.manual_seed(SEED)
    model, criterion, postprocessors = models.build(args)
    state, tied, _ = recipe_weights(model, SEED)
    pixels, mask = images(SIZES, SEED)
    samples = models.deformable_detr.NestedTensor(torch.from_numpy(pixels), torch.from_numpy(mask.astype(bool)))
    targets = [
        {"labels": torch.tensor(t["labels"]), "boxes": torch.tensor(t["boxes"], dtype=torch.float32)} for t in TARGETS
    ]

    model.train()
    criterion.train()
    outputs = model(samples)
    if args.num_queries_one2many > 0:
        losses = train_hybrid(models)(outputs, targets, args.k_one2many, criterion, args.lambda_one2many)
    else:
        losses = criterion(outputs, targets)
    weight_dict = criterion.weight_dict
    total = sum(losses[k] * weight_dict[k] for k in losses if k in weight_dict)
    total.backward()
    parameters = model.state_dict(keep_vars=True)  # every name, tied ones too (named_parameters has one)

    tensors = {}
    for prefix, out in [("", outputs)] + [(f"aux{i}.", a) for i, a in enumerate(outputs["aux_outputs"])]:
        tensors[prefix + "pred_logits"], tensors[prefix + "pred_boxes"] = out["pred_logits"], out["pred_boxes"]
    tensors["enc.pred_logits"] = outputs["enc_outputs"]["pred_logits"]
    tensors["enc.pred_boxes"] = outputs["enc_outputs"]["pred_boxes"]
    # the proposals their queries were made from, in order (their transformer's torch.topk, on the same scores):
    # where two scores tie to float noise, the port may rank them the other way (tests/test_hdetr.py)
    queries = args.num_queries_one2one + args.num_queries_one2many
    tensors["enc.top"] = torch.topk(outputs["enc_outputs"]["pred_logits"][..., 0], queries, dim=1)[1].to(torch.int32)
    if args.num_queries_one2many > 0:
        tensors["one2many.pred_logits"] = outputs["pred_logits_one2many"]
        tensors["one2many.pred_boxes"] = outputs["pred_boxes_one2many"]
    for key in GRADIENTS:
        grad = parameters[key].grad
        if key in SAMPLED_ROWS:
            grad = grad[[row for row in SAMPLED_ROWS[key] if row < len(grad)]]
        if key not in NORM_ONLY:
            tensors["grad." + key] = grad

    # their evaluate(): the one-to-one queries alone
    model.num_queries = model.num_queries_one2one
    model.transformer.two_stage_num_proposals = model.num_queries
    model.eval()
    with torch.no_grad():
        evaluated = model(samples)
        target_sizes = torch.tensor(SIZES)
        results = postprocessors["bbox"](evaluated, target_sizes)
    tensors["eval.pred_logits"], tensors["eval.pred_boxes"] = evaluated["pred_logits"], evaluated["pred_boxes"]
    for i, result in enumerate(results):
        for key in ("scores", "labels", "boxes"):
            tensors[f"post{i}.{key}"] = result[key]

    save_file(
        {k: np.ascontiguousarray(v.detach().numpy()) for k, v in tensors.items()},
        str(FIXTURE / f"{name}.safetensors"),
    )
    return {
        "flags": {**RECIPE, **flags},
        "args": {k: v for k, v in sorted(vars(args).items()) if isinstance(v, (bool, int, float, str, type(None)))},
        "state_dict_keys": [[k, list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in state.items()],
        "tied": tied,
        "losses": {k: float(v.detach()) for k, v in losses.items()},
        "weight_dict": {k: float(v) for k, v in weight_dict.items()},
        "total_loss": float(total),
        "sampled_rows": SAMPLED_ROWS,
        "grad_norms": {k: float(parameters[k].grad.norm()) for k in GRADIENTS},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hdetr", type=Path, required=True, help="a checkout of HDETR/H-Deformable-DETR")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    options = parser.parse_args()
    models = import_hdetr(options.hdetr)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    FIXTURE.mkdir(parents=True, exist_ok=True)
    manifest_path = FIXTURE / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {"variants": {}}
    manifest.update(
        seed=SEED,
        sizes=SIZES,
        targets=TARGETS,
        hdetr_commit=HDETR_COMMIT,
        images="numpy.random.Generator(numpy.random.PCG64(seed)).standard_normal((2, 3, H, W)) as float32, "
        "zero on the padding; H, W the largest height and width of sizes (make_hdetr_reference.images)",
        made_by="tests/make_hdetr_reference.py",
    )
    for name in options.variants:
        print(f"{name}: running H-Deformable-DETR's code", flush=True)
        manifest["variants"][name] = run(models, name, VARIANTS[name])
        print(f"{name}: total loss {manifest['variants'][name]['total_loss']:.6g}", flush=True)
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
