"""Writes tests/fixtures/dino/: DINO's own outputs, losses, gradients and denoising noise, the references the
DINO port is held to. Their code runs on the CPU with the pure-PyTorch attention core (tests/dino_code.py), as the
H-Deformable-DETR references were made (make_hdetr_reference.py, whose images, targets and weight recipe this
reuses: no weights are stored).

    git clone https://github.com/IDEA-Research/DINO /tmp/dino   # at tests/dino_code.py's DINO_COMMIT
    python tests/make_dino_reference.py --dino /tmp/dino [--variants r50_4scale r50_5scale swin_tiny]

Each variant is one of their configs as it stands (900 queries, 100 denoising queries' worth of groups, label
noise 0.5, box noise 0.4, dropout 0, FFN 2048, shared heads, 91 classes), with device cpu:
- `r50_4scale`: config/DINO/DINO_4scale.py (ResNet-50 maps of strides 8, 16, 32 and one extra level).
- `r50_5scale`: config/DINO/DINO_5scale.py (return_interm_indices [0, 1, 2, 3]: strides 4 to 32 and one extra).
- `swin_tiny`: config/DINO/DINO_4scale_swin.py with backbone swin_T_224_1k and no backbone_dir (no ImageNet
  file); the stochastic depth their SwinTransformer builds by default (drop_path_rate 0.2, not one of their
  args) is set to 0 in the built model: a reference to compare with, not a random draw.

Training mode (model.train(), criterion.train(), `model(samples, targets)` as their engine calls it): the draws of
their prepare_for_cdn as drawn (`noise.*`), its outputs, the denoising queries' and the matching queries' outputs,
every loss term and the gradients of the weighted total (their engine's sum) w.r.t. a few parameters. Evaluation
mode (model.eval(), no targets, no_grad): outputs of every decoder layer, the encoder's proposals and their
PostProcess (num_select 300). manifest.json: args, the state_dict's keys, the tied keys, losses, weight_dict, the
total, gradient norms, dn_meta, what each stored tensor is and how the noise was drawn."""

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from dino_code import DINO_COMMIT, dino_args, import_dino, on_the_cpu
from make_hdetr_reference import SEED, SIZES, TARGETS, images, recipe_weights
from safetensors.numpy import save_file

FIXTURE = Path(__file__).parent / "fixtures" / "dino"
VARIANTS = {
    "r50_4scale": ("DINO_4scale.py", {}),
    "r50_5scale": ("DINO_5scale.py", {}),
    "swin_tiny": ("DINO_4scale_swin.py", dict(backbone="swin_T_224_1k")),
}
GRADIENTS = [
    *(
        f"transformer.{stack}.layers.{i}.{attn}.{part}.{kind}"
        for stack, attn in (("encoder", "self_attn"), ("decoder", "cross_attn"))
        for i in (0, 5)
        for part in ("sampling_offsets", "attention_weights")
        for kind in ("weight", "bias")
    ),
    "label_enc.weight",  # the denoising queries' contents: rows of the noised labels only
    "transformer.tgt_embed.weight",  # the matching queries' contents (rows SAMPLED_ROWS kept)
    "transformer.decoder.ref_point_head.layers.0.weight",  # query positions from each layer's box
    "class_embed.0.weight",  # shared by the 6 layers (tied to transformer.decoder.class_embed.*)
    "bbox_embed.0.layers.2.weight",  # shared by the 6 layers, also through the next layer's reference
    "transformer.enc_out_bbox_embed.layers.2.weight",  # the encoder's proposals' own heads
    "transformer.enc_out_class_embed.weight",
    "transformer.decoder.layers.3.self_attn.in_proj_weight",  # behind the denoising mask (its norm alone)
]
EVAL_LOGITS = (0, 4, 5)  # decoder layers whose evaluation logits are stored (each is 655 kB; 8 MB a file)
SAMPLED_ROWS = {"transformer.tgt_embed.weight": list(range(8))}
NORM_ONLY = {"transformer.decoder.layers.3.self_attn.in_proj_weight"}
NOISE = {
    "order": "their prepare_for_cdn draws, in this order, on the default torch generator: "
    "p = rand_like(known_labels.float()); chosen = nonzero(p < label_noise_ratio * 0.5); "
    "new_label = randint_like(chosen, 0, num_classes); rand_sign = randint_like(known_bboxs, 0, 2, float32) * 2 - 1; "
    "rand_part = rand_like(known_bboxs)",
    "noise.label_p": "rand_like of the known labels, as drawn: (M,) float32, M = N * 2 * num_dn_group, N the "
    "batch's boxes (targets concatenated image by image)",
    "noise.chosen": "nonzero(label_p < 0.25): the known indices whose label is replaced (derived, int64)",
    "noise.new_label": "randint_like(chosen, 0, num_classes): their new labels, in chosen's order (int64)",
    "noise.box_sign": "randint_like(known_bboxs, 0, 2) * 2.0 - 1.0: the signs, -1 or +1 (M, 4) float32 "
    "(the raw draw is (box_sign + 1) / 2)",
    "noise.box_part": "rand_like(known_bboxs) as drawn, in [0, 1), before their `+= 1.0` on the negatives and "
    "the product with the signs (M, 4) float32",
    "known layout": "known index k = j * N + n: chunk j of 2 * num_dn_group (even j = 2g: group g's positives, "
    "odd j = 2g + 1: its negatives), n the target in the concatenated batch; query slot of k in image b = "
    "single_pad * j + (n's index within image b); slots past an image's boxes are padding (zero content, zero "
    "unsigmoided box)",
}


def prepare_recording(models, record):
    """Their model calls `prepare_for_cdn` (imported by name into models.dino.dino): wrap it so that each
    torch.rand_like / torch.randint_like it draws is kept (cloned as drawn, before their in-place edits), and its
    outputs with them."""
    dino = models.dino.dino
    original = dino.prepare_for_cdn

    def prepare(*args, **kwargs):
        draws, rand_like, randint_like = [], torch.rand_like, torch.randint_like

        def kept(name, draw):
            def wrapped(*a, **k):
                value = draw(*a, **k)
                draws.append((name, value.clone()))
                return value

            return wrapped

        torch.rand_like, torch.randint_like = kept("rand_like", rand_like), kept("randint_like", randint_like)
        try:
            result = original(*args, **kwargs)
        finally:
            torch.rand_like, torch.randint_like = rand_like, randint_like
        record["draws"], record["result"] = draws, result
        return result

    dino.prepare_for_cdn = prepare


def proposal_scores(model, record):
    """The encoder's class logits over every token (their transformer's first enc_out_class_embed call, on
    output_memory), whose max over classes their torch.topk ranks."""

    def hook(module, inputs, output):
        record.setdefault("enc_logits", output.detach())  # the second call is dino.py's, on the chosen 900

    return model.transformer.enc_out_class_embed.register_forward_hook(hook)


def rebuilt_queries(noise, targets, dn_meta, label_enc, dn_args):
    """Their prepare_for_cdn's input queries made again from the recorded noise, as a port must apply it: the
    check that the noise's description (NOISE) is complete. -> (contents, unsigmoided boxes), as theirs."""
    from util.misc import inverse_sigmoid

    ratio, scale, num_classes = dn_args
    groups, pad_size = dn_meta["num_dn_group"], dn_meta["pad_size"]
    single_pad = pad_size // (2 * groups)
    labels = torch.cat([t["labels"] for t in targets])
    boxes = torch.cat([t["boxes"] for t in targets])
    n = len(labels)
    known_labels = labels.repeat(2 * groups)  # (M,), chunk j = known[j * n:(j + 1) * n]
    known_boxes = boxes.repeat(2 * groups, 1)  # (M, 4)
    chosen = torch.nonzero(noise["noise.label_p"] < ratio * 0.5).view(-1)
    assert torch.equal(chosen, noise["noise.chosen"])
    assert bool((noise["noise.new_label"] < num_classes).all())
    known_labels = known_labels.scatter(0, chosen, noise["noise.new_label"])
    negative = (torch.arange(len(known_boxes)) // n) % 2 == 1
    part = noise["noise.box_part"] + negative[:, None].float()  # negatives: 1 to 2 half-sizes away
    corners = torch.cat([known_boxes[:, :2] - known_boxes[:, 2:] / 2, known_boxes[:, :2] + known_boxes[:, 2:] / 2], 1)
    half = torch.cat([known_boxes[:, 2:] / 2, known_boxes[:, 2:] / 2], 1)
    corners = (corners + (part * noise["noise.box_sign"]) * half * scale).clamp(0.0, 1.0)
    noised = torch.cat([(corners[:, :2] + corners[:, 2:]) / 2, corners[:, 2:] - corners[:, :2]], 1)
    contents = torch.zeros(len(targets), pad_size, label_enc.weight.shape[1])
    unsigmoided = torch.zeros(len(targets), pad_size, 4)
    counts = [len(t["labels"]) for t in targets]
    image = torch.cat([torch.full((c,), b) for b, c in enumerate(counts)]).repeat(2 * groups)
    within = torch.cat([torch.arange(c) for c in counts]).repeat(2 * groups)
    slot = within + single_pad * (torch.arange(len(known_labels)) // n)
    contents[image, slot] = label_enc(known_labels)
    unsigmoided[image, slot] = inverse_sigmoid(noised)
    return contents, unsigmoided


def plain(value):
    if isinstance(value, (bool, int, float, str, type(None))):
        return True
    return isinstance(value, (list, tuple)) and all(plain(v) for v in value)


def layers(out):
    """[(layer, {'pred_logits', 'pred_boxes'})] for decoder layers 0..5 (the aux ones, then the last)."""
    return list(enumerate([*out["aux_outputs"], {k: out[k] for k in ("pred_logits", "pred_boxes")}]))


def max_abs(a, b):
    return float((a.detach() - b.detach()).abs().max())


def run(models, name, config, changes):
    args = dino_args(models, config, device="cpu", **changes)
    torch.manual_seed(SEED)
    with on_the_cpu():
        model, criterion, postprocessors = models.dino.dino.build_dino(args)
    drop_paths = [m for m in model.modules() if hasattr(m, "drop_prob")]
    for module in drop_paths:  # Swin's stochastic depth (their default 0.2): none, as make_hdetr_reference
        module.drop_prob = 0.0
    state, tied, _ = recipe_weights(model, SEED)
    pixels, mask = images(SIZES, SEED)
    nested = models.dino.dino.NestedTensor
    samples = nested(torch.from_numpy(pixels), torch.from_numpy(mask.astype(bool)))
    targets = [
        {"labels": torch.tensor(t["labels"]), "boxes": torch.tensor(t["boxes"], dtype=torch.float32)} for t in TARGETS
    ]

    record = {}
    prepare_recording(models, record)
    hook = proposal_scores(model, record)
    model.train()
    criterion.train()
    with on_the_cpu():
        outputs = model(samples, targets)
        losses = criterion(outputs, targets)
        weight_dict = criterion.weight_dict
        total = sum(losses[k] * weight_dict[k] for k in losses if k in weight_dict)  # their engine's sum
        total.backward()
    hook.remove()
    parameters = model.state_dict(keep_vars=True)  # every name, tied ones too

    tensors = {}
    kinds = [kind for kind, _ in record["draws"]]
    assert kinds == ["rand_like", "randint_like", "randint_like", "rand_like"], kinds
    (_, label_p), (_, new_label), (_, sign), (_, part) = record["draws"]
    tensors["noise.label_p"] = label_p
    tensors["noise.chosen"] = torch.nonzero(label_p < args.dn_label_noise_ratio * 0.5).view(-1)
    tensors["noise.new_label"] = new_label
    tensors["noise.box_sign"] = sign * 2.0 - 1.0
    tensors["noise.box_part"] = part
    input_query_label, input_query_bbox, attn_mask, dn_meta = record["result"]
    tensors["dn.input_query_label"] = input_query_label
    tensors["dn.input_query_bbox"] = input_query_bbox
    pad_size, groups = dn_meta["pad_size"], dn_meta["num_dn_group"]
    matching_rows = attn_mask[pad_size:]  # a rule, not stored: the denoising queries hidden, the rest seen
    assert matching_rows[:, :pad_size].all() and not matching_rows[:, pad_size:].any()
    tensors["dn.attn_mask"] = attn_mask[:pad_size].to(torch.uint8)
    dn_args = (args.dn_label_noise_ratio, args.dn_box_noise_scale, args.num_classes)
    with torch.no_grad():
        contents, unsigmoided = rebuilt_queries(tensors, targets, dn_meta, model.label_enc, dn_args)
    assert torch.equal(contents, input_query_label.detach()), "the noise's description misses something (labels)"
    rebuilt_boxes = max_abs(unsigmoided, input_query_bbox)
    assert rebuilt_boxes < 1e-5, f"the noise's description misses something (boxes: {rebuilt_boxes})"
    known = dn_meta["output_known_lbs_bboxes"]
    for i, out in layers(known):
        tensors[f"dn{i}.pred_logits"], tensors[f"dn{i}.pred_boxes"] = out["pred_logits"], out["pred_boxes"]
    for i, out in layers(outputs):  # the matching queries: boxes of every layer, logits of the last (see eval)
        tensors[f"train{i}.pred_boxes"] = out["pred_boxes"]
    tensors["train5.pred_logits"] = outputs["pred_logits"]
    tensors["interm.pred_logits"] = outputs["interm_outputs"]["pred_logits"]
    tensors["interm.pred_boxes"] = outputs["interm_outputs"]["pred_boxes"]
    scores = record["enc_logits"].max(-1)[0]
    tensors["enc.scores"] = scores
    tensors["enc.top"] = torch.topk(scores, args.num_queries, dim=1)[1].to(torch.int32)  # their call, their order
    for key in GRADIENTS:
        grad = parameters[key].grad
        if key in SAMPLED_ROWS:
            grad = grad[SAMPLED_ROWS[key]]
        if key not in NORM_ONLY:
            tensors["grad." + key] = grad

    # their evaluate(): no denoising queries (prepare_for_cdn returns None outside training)
    model.eval()
    record.clear()
    hook = proposal_scores(model, record)
    with torch.no_grad(), on_the_cpu():
        evaluated = model(samples)
        results = postprocessors["bbox"](evaluated, torch.tensor(SIZES))
    hook.remove()
    assert evaluated["dn_meta"] is None
    for i, out in layers(evaluated):
        tensors[f"eval{i}.pred_boxes"] = out["pred_boxes"]
        if i in EVAL_LOGITS:
            tensors[f"eval{i}.pred_logits"] = out["pred_logits"]
    for i, result in enumerate(results):
        for key in ("scores", "labels", "boxes"):
            tensors[f"post{i}.{key}"] = result[key]
    # what is stored once stands for its twin: the matching queries in training behind the mask, the encoder
    train_vs_eval = {
        f"layer{i}.{key}": max_abs(out[key], dict(layers(evaluated))[i][key])
        for i, out in layers(outputs)
        for key in ("pred_logits", "pred_boxes")
    }
    for key in ("pred_logits", "pred_boxes"):
        train_vs_eval[f"interm.{key}"] = max_abs(outputs["interm_outputs"][key], evaluated["interm_outputs"][key])
    eval_top = torch.topk(record["enc_logits"].max(-1)[0], args.num_queries, dim=1)[1]
    train_vs_eval["enc.top_equal"] = bool(torch.equal(eval_top, tensors["enc.top"].long()))

    path = FIXTURE / f"{name}.safetensors"
    save_file({k: np.ascontiguousarray(v.detach().numpy()) for k, v in tensors.items()}, str(path))
    return {
        "config": f"config/DINO/{config}",
        "changes": {"device": "cpu", **changes},
        "swin_drop_path_set_to_zero": len(drop_paths),
        "args": {k: v for k, v in sorted(vars(args).items()) if plain(v)},
        "state_dict_keys": [[k, list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in state.items()],
        "tied": tied,
        "losses": {k: float(v.detach()) for k, v in losses.items()},
        "weight_dict": {k: float(v) for k, v in weight_dict.items()},
        "total_loss": float(total),
        "sampled_rows": SAMPLED_ROWS,
        "grad_norms": {k: float(parameters[k].grad.norm()) for k in GRADIENTS},
        "eval_logits_layers": list(EVAL_LOGITS),
        "dn_meta": {"pad_size": pad_size, "num_dn_group": groups, "single_pad": pad_size // (2 * groups)},
        "train_vs_eval_max_abs": train_vs_eval,
        "noise_rebuilt_boxes_max_abs": rebuilt_boxes,
        "tensors": {k: [list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in tensors.items()},
        "bytes": path.stat().st_size,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dino", type=Path, required=True, help="a checkout of IDEA-Research/DINO")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    options = parser.parse_args()
    models = import_dino(options.dino)
    FIXTURE.mkdir(parents=True, exist_ok=True)
    manifest_path = FIXTURE / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {"variants": {}}
    manifest.update(
        seed=SEED,
        sizes=SIZES,
        targets=TARGETS,
        dino_commit=DINO_COMMIT,
        images="numpy.random.Generator(numpy.random.PCG64(seed)).standard_normal((2, 3, H, W)) as float32, "
        "zero on the padding; H, W the largest height and width of sizes (make_hdetr_reference.images)",
        weights="reference_weights.recipe_value(key, shape, seed) for each floating-point tensor of state_dict_keys "
        "not in tied, keyed by its own name; a tied key takes its source's value; integer buffers (Swin's "
        "relative_position_index) as their model builds them (make_hdetr_reference.recipe_weights)",
        noise=NOISE,
        stored={
            "noise.*": "see noise",
            "dn.input_query_label, dn.input_query_bbox": "prepare_for_cdn's outputs: (B, pad_size, 256) contents, "
            "(B, pad_size, 4) unsigmoided boxes",
            "dn.attn_mask": "prepare_for_cdn's self-attention mask (1 = may not attend), the denoising queries' "
            "rows: (pad_size, pad_size + num_queries); the matching queries' rows (not stored) are 1 on the first "
            "pad_size columns and 0 on the rest (asserted when made)",
            "dn{i}.*": "decoder layer i's outputs of the denoising queries (dn_meta['output_known_lbs_bboxes'])",
            "train{i}.pred_boxes, train5.pred_logits": "training mode, the matching queries (the last layer's "
            "logits alone: behind the mask they are evaluation's to float noise, train_vs_eval_max_abs)",
            "interm.*": "interm_outputs of training (the 900 chosen proposals: enc_out_class_embed of their memory, "
            "their boxes); evaluation's equal them (train_vs_eval_max_abs)",
            "enc.scores": "max over classes of enc_out_class_embed(output_memory), every token (B, sum HW)",
            "enc.top": "torch.topk(enc.scores, num_queries, dim=1) indices: the proposals chosen, in order",
            "grad.*": "gradients of the weighted total (rows sampled_rows where given; norms of all in grad_norms)",
            "eval{i}.*": "evaluation mode, decoder layer i (5 the last): boxes of every layer, logits of layers "
            "EVAL_LOGITS (eval_logits_layers); the other layers' logits are checked through their losses",
            "post{b}.*": "their PostProcess (num_select 300), target_sizes = sizes",
        },
        made_by="tests/make_dino_reference.py",
    )
    for name in options.variants:
        print(f"{name}: running DINO's code", flush=True)
        config, changes = VARIANTS[name]
        manifest["variants"][name] = run(models, name, config, changes)
        info = manifest["variants"][name]
        print(f"{name}: total loss {info['total_loss']:.6g}, dn_meta {info['dn_meta']}, {info['bytes']} bytes")
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
