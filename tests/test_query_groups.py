"""The decoder's query groups (models/query_groups.py) and DINO's denoising queries at a fixed count
(models/denoising.py): what each config's groups are, what a group sees, and that no batch's targets bring a new
shape."""

from deformable_detr import build_criterion, build_model, load_config
from deformable_detr.models.denoising import denoising_queries, draw_noise
from deformable_detr.models.query_groups import HUNGARIAN, KNOWN, LEARNED, PROPOSALS, REPEATED, query_groups

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

TINY_DINO = [
    "model.architecture=dino", "model.mixed_selection=true", "model.look_forward_twice=true",
    "model.position_temperature=20", "model.dn_number=10", "model.num_queries=20", "model.dec_layers=2",
]  # fmt: skip


def describe(cfg):
    return [(g.name, g.count, g.training_only, g.contents, g.positions, g.assignment) for g in query_groups(cfg.model)]


def test_each_config_is_its_groups():
    """The authors' single stage and two-stage, H-Deformable-DETR (its hybrid branch), DINO (its denoising): the
    flags the groups replace, read once."""
    assert describe(load_config("r50")) == [("one2one", 300, False, LEARNED, LEARNED, HUNGARIAN)]
    assert describe(load_config("r50_two_stage")) == [("one2one", 300, False, PROPOSALS, PROPOSALS, HUNGARIAN)]
    hdetr = load_config("hdetr_r50_12ep")
    assert describe(hdetr) == [
        ("one2one", 300, False, LEARNED, PROPOSALS, HUNGARIAN),
        ("one2many", 1500, True, LEARNED, PROPOSALS, REPEATED),
    ]
    branch = query_groups(hdetr.model, hdetr.loss)[1]
    assert (branch.repeats, branch.loss_weight, branch.loss_suffix, branch.sees) == (6, 1.0, "_one2many", ())
    dino = load_config("dino_r50_4scale_12ep")
    assert describe(dino) == [
        ("one2one", 900, False, LEARNED, PROPOSALS, HUNGARIAN),
        ("denoising", 200, True, "targets", "targets", KNOWN),
    ]
    assert query_groups(dino.model)[1].sees == ("one2one",)


def batch(counts, seed=0):
    rng = np.random.default_rng(seed)
    targets = []
    for n in counts:
        centres = rng.uniform(0.2, 0.8, (n, 2))
        sizes = rng.uniform(0.05, 0.3, (n, 2))
        targets.append(
            {"labels": rng.integers(1, 6, n), "boxes": np.concatenate([centres, sizes], 1).astype(np.float32)}
        )
    return targets


@pytest.mark.parametrize("counts", [(0, 0), (1, 0), (3, 2), (10, 4), (40, 1)])
def test_denoising_queries_have_one_shape_whatever_the_targets(counts):
    """2 x dn_number queries for no target, one, a few, dn_number of them, more (each image's first dn_number
    copied); DINO's layout inside (its groups of a positive and a negative copy, as many as fit), the rest masked."""
    targets = batch(counts)
    noise = draw_noise(np.random.default_rng(1), targets, 10, 6, 0.5, 0.4)
    queries = denoising_queries(targets, 10, noise, 0.5, 0.4)
    assert queries.labels.shape == (2, 20) and queries.positions.shape == (2, 20, 4)
    assert queries.attention_mask.shape == (20, 20) and queries.counted.shape == (20,)
    most = min(max(counts), 10)
    copies = 10 // most if most else 0
    assert (queries.copies, queries.width) == (copies, most)
    assert queries.counted.sum() == 2 * copies * most
    # each query sees itself; a group (a positive and a negative copy) sees itself alone
    assert np.all(np.diag(queries.attention_mask) == 0)
    for q in range(int(queries.counted.sum())):
        seen = np.nonzero(queries.attention_mask[q] == 0)[0]
        np.testing.assert_array_equal(seen, np.arange(q // (2 * most) * 2 * most, (q // (2 * most) + 1) * 2 * most))
    flat, query = queries.assigned()
    assert len(flat) == len(query) == copies * sum(min(n, 10) for n in counts)
    assert np.all(query < queries.counted.sum()) and np.all(queries.labels[flat.image, query] >= 0)


def test_the_detectors_queries_do_not_see_the_denoising_queries():
    """The detector's outputs in training are the same bit for bit with and without the denoising group: its queries
    attend to their own alone (DINO's mask), the denoising queries to theirs and the detector's."""
    mx.random.seed(0)
    cfg = load_config("shapes", TINY_DINO)
    model = build_model(cfg)
    images = mx.array(np.random.default_rng(0).standard_normal((2, 96, 128, 3)).astype(np.float32))
    mask = mx.zeros((2, 96, 128), mx.bool_)
    targets = batch((3, 2))
    queries = denoising_queries(targets, 10, draw_noise(np.random.default_rng(2), targets, 10, 6, 0.5, 0.4), 0.5, 0.4)
    plain, noised = model(images, mask), model(images, mask, queries)
    mx.eval(plain, noised)
    assert "denoising" not in plain and noised["denoising"]["pred_logits"].shape == (2, 20, 6)
    for key in ("pred_logits", "pred_boxes"):
        np.testing.assert_array_equal(np.array(plain[key]), np.array(noised[key]))


def test_denoising_losses_train_the_decoder_and_count_what_dino_counts():
    """The denoising group's losses (suffix _dn, every layer) reach the decoder's sampling offsets and the label
    embedding; a batch without targets gives them zero, finite, with the same shapes."""
    mx.random.seed(0)
    cfg = load_config("shapes", TINY_DINO)
    model = build_model(cfg)
    criterion = build_criterion(cfg)
    images = mx.array(np.random.default_rng(0).standard_normal((2, 96, 128, 3)).astype(np.float32))
    mask = mx.zeros((2, 96, 128), mx.bool_)

    def denoising_loss(model, targets, queries):
        losses = criterion(model(images, mask, queries), targets, None, queries)
        return sum(v * criterion.weight_dict[k] for k, v in losses.items() if k.endswith("_dn")), losses

    for counts in ((3, 2), (0, 0)):
        targets = batch(counts)
        queries = denoising_queries(
            targets, 10, draw_noise(np.random.default_rng(3), targets, 10, 6, 0.5, 0.4), 0.5, 0.4
        )
        (loss, losses), grads = nn.value_and_grad(model, denoising_loss)(model, targets, queries)
        mx.eval(loss, grads)
        names = {k for k in losses if k.endswith("_dn")}
        assert names == {f"loss_{t}{layer}_dn" for t in ("ce", "bbox", "giou") for layer in ("", "_0")}
        offsets = grads["transformer"]["decoder"]["layers"][0]["cross_attn"]["sampling_offsets"]["weight"]
        label_enc = grads["label_enc"]["weight"]
        if sum(counts):
            assert loss.item() > 0 and float(mx.abs(offsets).max()) > 0 and float(mx.abs(label_enc).max()) > 0
        else:
            assert loss.item() == 0 and float(mx.abs(label_enc).max()) == 0
