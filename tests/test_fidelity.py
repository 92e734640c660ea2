"""The port against the authors' PyTorch model: weights rebuilt from the fixture's recipe; outputs,
losses and gradients compared with theirs (fixtures/reference, produced by their code on a CPU)."""

from functools import cache

from deformable_detr import build_criterion, build_model, load_config, post_process
from deformable_detr.weights.authors import detect_variant, expected_shapes, sanitize

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from reference_weights import VARIANTS, assert_same_detections, manifest, reference, state_dict

# About 1e-4 relative, as the fixture's README says for float32 on a CPU.
OUTPUT_TOLERANCE = dict(rtol=1e-4, atol=1e-4)
IMAGE_SIZES = [[200, 280], [240, 200]]  # (h, w) of each image before padding


@cache
def run(variant):
    """The port's outputs, losses (the fixture's targets) and gradients on the fixture's images, and
    the reference tensors. The backbone is frozen: no reference gradient lies behind it."""
    state = state_dict(variant)
    options = detect_variant(state)
    cfg = load_config(
        None,
        [
            "model.dropout=0.0",
            f"model.with_box_refine={str(options['with_box_refine']).lower()}",
            f"model.two_stage={str(options['two_stage']).lower()}",
        ],
    )
    model = build_model(cfg)
    model.load_weights(list((k, mx.array(v)) for k, v in sanitize(state, expected_shapes(model), variant).items()))
    model.backbone[0].freeze()
    criterion = build_criterion(cfg)
    targets = [
        {"labels": np.array(t["labels"]), "boxes": np.array(t["boxes"], np.float32)}
        for t in manifest()["variants"][variant]["targets"]
    ]
    ref = reference(variant)
    images, mask = mx.array(ref["images"].transpose(0, 2, 3, 1)), mx.array(ref["mask"].astype(bool))

    def loss_fn(model):
        out = model(images, mask)
        losses = criterion(out, targets)
        return criterion.total(losses), (out, losses)

    (total, (out, losses)), grads = nn.value_and_grad(model, loss_fn)(model)
    mx.eval(total, out, losses, grads)
    return out, losses, total, dict(tree_flatten(grads)), ref


def layers(out, ref):
    """(name, ours, reference) for the last decoder layer, every aux layer and the encoder proposals."""
    pairs = [("", out)] + [(f"aux{i}.", aux) for i, aux in enumerate(out["aux_outputs"])]
    if "enc_outputs" in out:
        pairs.append(("enc.", out["enc_outputs"]))
    for prefix, outputs in pairs:
        for key in ("pred_logits", "pred_boxes"):
            yield prefix + key, np.array(outputs[key]), ref[prefix + key]


def query_permutation(out, ref):
    """Two-stage picks its 300 queries by sorting encoder scores; where two scores differ by float
    noise, the two implementations may order those queries differently. Match each reference query
    to ours by its initial box and check that only such near-ties moved."""
    ours = np.array(out["aux_outputs"][0]["pred_boxes"])
    theirs = ref["aux0.pred_boxes"]
    perm = np.stack([np.abs(ours[b][None] - theirs[b][:, None]).sum(-1).argmin(1) for b in range(len(ours))])
    scores = np.array(out["enc_outputs"]["pred_logits"][..., 0])
    for b in range(len(perm)):
        assert sorted(perm[b]) == list(range(len(perm[b]))), "queries do not match one to one"
        top = np.sort(scores[b])[::-1][: len(perm[b])]
        for i in np.where(perm[b] != np.arange(len(perm[b])))[0]:
            assert abs(top[i] - top[perm[b][i]]) < 1e-5, f"query {i} moved by more than a near-tie"
    return perm


def test_recipe_rebuilds_the_reference_weights():
    for variant in VARIANTS:
        state = state_dict(variant)
        for key, (total, first) in manifest()["variants"][variant]["recipe_checks"].items():
            assert float(state[key].astype(np.float64).sum()) == pytest.approx(total, rel=1e-5, abs=1e-4), key
            assert state[key].reshape(-1)[0] == np.float32(first), key


@pytest.mark.parametrize("variant", VARIANTS)
def test_outputs_match_the_authors(variant):
    out, *_, ref = run(variant)
    perm = query_permutation(out, ref) if variant == "two_stage" else None
    assert len(out["aux_outputs"]) == 5
    for name, ours, theirs in layers(out, ref):
        if perm is not None and not name.startswith("enc."):
            ours = np.stack([ours[b][perm[b]] for b in range(len(ours))])
        np.testing.assert_allclose(ours, theirs, **OUTPUT_TOLERANCE, err_msg=name)


@pytest.mark.parametrize("variant", VARIANTS)
def test_post_processed_detections_match_the_authors(variant):
    out, *_, ref = run(variant)
    for i, detections in enumerate(post_process(out, IMAGE_SIZES)):
        assert_same_detections(detections, ref, i)


@pytest.mark.parametrize("variant", VARIANTS)
def test_losses_match_the_authors(variant):
    _, losses, total, _, _ = run(variant)
    info = manifest()["variants"][variant]
    assert set(losses) == set(info["losses"])
    for key, want in info["losses"].items():
        assert losses[key].item() == pytest.approx(want, rel=1e-3, abs=1e-6), key
    assert total.item() == pytest.approx(info["total_loss"], rel=1e-3)
    assert build_criterion(load_config()).weight_dict == info["weight_dict"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_gradients_match_the_authors(variant):
    """sampling_offsets and attention_weights of encoder and decoder layers 0 and 5, to 1e-3 of
    each tensor's largest entry."""
    _, _, _, grads, ref = run(variant)
    names = [k.removeprefix("grad.") for k in ref if k.startswith("grad.")]
    assert len(names) == 16
    for name in names:
        want = ref["grad." + name]
        np.testing.assert_allclose(np.array(grads[name]), want, rtol=1e-3, atol=1e-3 * np.abs(want).max(), err_msg=name)
