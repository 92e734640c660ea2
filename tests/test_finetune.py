"""Fine-tuning to new classes: class-head rows carried over by category name, new rows as a fresh
model's, errors that name the key; `model.num_classes: auto` and the id >= num_classes check before
any step; category names travelling with converted and trained weights."""

import json

from deformable_detr import build_model, load_config
from deformable_detr.convert import main as convert_main
from deformable_detr.data import COCO_CATEGORY_NAMES, build_dataset
from deformable_detr.data.classes import describe_match, match_classes
from deformable_detr.data.shapes import CATEGORIES, generate
from deformable_detr.predict import main as predict_main
from deformable_detr.training.optimizer import build_optimizer
from deformable_detr.weights.checkpoint import save_checkpoint
from deformable_detr.weights.files import read_weights
from deformable_detr.weights.loading import load_for_finetuning

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_train import TINY

import train

SMALL = dict(height=(64, 64), width=(64, 64), max_size=40)
TWO_STAGE = ["model.with_box_refine=true", "model.two_stage=true"]  # three class heads, one for proposals
NEW_CLASSES = ["circle", "square", "hexagon", "star"]  # ids 1..4: circle and square swap ids


def params(model) -> dict:
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A training checkpoint of the five-shape classes (ids 1..5), with class heads unlike any fresh
    initialisation (random biases too, so a copied bias cannot pass by being the prior)."""
    cfg = load_config(TINY, TWO_STAGE)
    mx.random.seed(1)
    model = build_model(cfg)
    for head in model.class_embed:
        head.weight = mx.random.normal(head.weight.shape)
        head.bias = mx.random.normal(head.bias.shape)
    path = tmp_path_factory.mktemp("source") / "checkpoint.safetensors"
    names = {i + 1: name for i, name in enumerate(CATEGORIES)}
    save_checkpoint(path, model, build_optimizer(cfg), cfg, {"epoch": 3, "step": 0, "global_step": 150}, names)
    return path, params(model)


@pytest.fixture(scope="module")
def new_set(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("new"), 8, 4, seed=5, categories=NEW_CLASSES, **SMALL)


def test_rows_carried_over_by_name_and_new_rows_as_a_fresh_model(source, new_set):
    path, before = source
    cfg = load_config(TINY, [*TWO_STAGE, "model.num_classes=5", f"data.path={new_set}", "data.dataset=coco"])
    names = build_dataset("train", cfg.data).class_names()
    assert names == {1: "circle", 2: "square", 3: "hexagon", 4: "star"}
    mx.random.seed(7)
    model = build_model(cfg)
    mx.random.seed(7)
    fresh = params(build_model(cfg))
    summary = load_for_finetuning(model, path, names)
    assert summary == (
        f"fine-tuning from {path}: {len(before)} tensors loaded, class heads rebuilt for 5 outputs; "
        "carried over by name (id -> id): circle (2 -> 1), square (1 -> 2); new: hexagon (3), star (4)"
    )
    after = params(model)
    heads = [k for k in after if k.startswith("class_embed.")]
    assert len(heads) == 6  # weight and bias of the three decoder heads and the encoder's proposal head
    for key in heads:
        assert after[key].shape[0] == 5 and before[key].shape[0] == 6
        np.testing.assert_array_equal(after[key][1], before[key][2], err_msg=key)  # circle
        np.testing.assert_array_equal(after[key][2], before[key][1], err_msg=key)  # square
        for new in (0, 3, 4):
            np.testing.assert_array_equal(after[key][new], fresh[key][new], err_msg=key)
        assert not np.array_equal(fresh[key][1], before[key][2])  # the copy is visible
    for key in after.keys() - set(heads):
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)


def test_finetune_trains_and_records_the_new_names(source, new_set, tmp_path, capsys):
    path, before = source
    output = tmp_path / "run"
    argv = ["--config", str(TINY), "--output-dir", str(output), "--finetune", str(path)]
    train.main(argv + [*TWO_STAGE, f"data.path={new_set}", "model.num_classes=auto", "train.max_steps=2"])
    printed = capsys.readouterr().out
    assert "carried over by name (id -> id): circle (2 -> 1), square (1 -> 2); new: hexagon (3), star (4)" in printed
    assert "num_classes: 5" in (output / "config.yaml").read_text()
    records = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "global_step" in r and "loss" in r and "epoch_steps" not in r]
    assert len(losses) == 2 and all(np.isfinite(losses))
    saved = read_weights(output / "checkpoint.safetensors")
    weights, names = saved.tensors, saved.class_names
    assert names == {1: "circle", 2: "square", 3: "hexagon", 4: "star"}
    assert weights["class_embed.0.weight"].shape == (5, 64)
    progress = json.loads(mx.load(str(output / "checkpoint.safetensors"), return_metadata=True)[1]["progress"])
    assert progress["global_step"] == 2  # a new run: the source's progress (150 steps) is not carried
    moved = np.abs(np.array(weights["transformer.level_embed"]) - before["transformer.level_embed"]).max()
    assert moved > 0  # it trained


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.backbone=resnet34", "backbone.0.body.layer1.2."),  # the target's extra block
        ("model.num_feature_levels=1", "input_proj."),  # one level: other input channels, fewer projections
    ],
)
def test_another_variant_is_an_error_naming_the_key(source, new_set, tmp_path, override, key):
    path, _ = source
    argv = ["--config", str(TINY), "--output-dir", str(tmp_path), "--finetune", str(path)]
    with pytest.raises(SystemExit) as stopped:
        train.main(argv + [*TWO_STAGE, f"data.path={new_set}", "model.num_classes=auto", override])
    assert str(stopped.value).startswith(f"error: {path}: ") and key in str(stopped.value)
    assert not (tmp_path / "checkpoint.safetensors").exists()


def test_weights_of_other_classes_point_to_finetune(source, new_set, tmp_path):
    path, _ = source
    argv = ["--config", str(TINY), "--output-dir", str(tmp_path), "--weights", str(path)]
    with pytest.raises(SystemExit, match=r"class_embed\.0\.bias has shape \(6,\); the model's is \(5,\).*--finetune"):
        train.main(argv + [*TWO_STAGE, f"data.path={new_set}", "model.num_classes=auto"])


@pytest.fixture(scope="module")
def ids_to_90(tmp_path_factory):
    """A COCO-format set whose category ids reach 90 (the issue's report): shapes 1..5 renumbered."""
    root = generate(tmp_path_factory.mktemp("ids90"), 6, 2, seed=9, **SMALL)
    renumber = {1: 1, 2: 17, 3: 44, 4: 80, 5: 90}
    for split in ("train", "val"):
        path = root / "annotations" / f"instances_{split}2017.json"
        data = json.loads(path.read_text())
        for item in data["annotations"]:
            item["category_id"] = renumber[item["category_id"]]
        for item in data["categories"]:
            item["id"] = renumber[item["id"]]
        path.write_text(json.dumps(data))
    return root


def test_a_category_id_beyond_num_classes_stops_before_any_step(ids_to_90, tmp_path):
    output = tmp_path / "run"
    argv = ["--config", str(TINY), "--output-dir", str(output), f"data.path={ids_to_90}", "model.num_classes=50"]
    with pytest.raises(SystemExit) as stopped:
        train.main(argv)
    annotation_file = ids_to_90 / "annotations" / "instances_train2017.json"
    assert str(stopped.value) == (
        f"error: {annotation_file}: category id 90 is not below model.num_classes (50); "
        "set model.num_classes=91 or model.num_classes=auto"
    )
    assert not output.exists()  # nothing was built, nothing written


def test_num_classes_auto_is_the_largest_id_plus_one(ids_to_90, tmp_path):
    output = tmp_path / "run"
    argv = ["--config", str(TINY), "--output-dir", str(output), f"data.path={ids_to_90}"]
    train.main(argv + ["model.num_classes=auto", "train.max_steps=1", "train.eval_every=0"])
    assert load_config(output / "config.yaml").model.num_classes == 91
    saved = read_weights(output / "checkpoint.safetensors")
    weights, names = saved.tensors, saved.class_names
    assert weights["class_embed.0.bias"].shape == (91,)
    assert names == {1: "square", 17: "circle", 44: "triangle", 80: "diamond", 90: "cross"}


@pytest.mark.parametrize("config", sorted((TINY.parents[2] / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_accepts_auto(config):
    assert load_config(config, ["model.num_classes=auto"]).model.num_classes == "auto"
    assert load_config(config, ["model.num_classes=auto", "model.num_classes=12"]).model.num_classes == 12
    with pytest.raises(ValueError, match="model.hidden_dim must be int"):
        load_config(config, ["model.hidden_dim=auto"])
    with pytest.raises(ValueError, match="model.num_classes must be int or auto, got 'many'"):
        load_config(config, ["model.num_classes=many"])


def authors_state(model) -> dict:
    """A model's weights in the authors' layout (OIHW convolutions), as numpy."""
    return {k: np.array(v.transpose(0, 3, 1, 2) if v.ndim == 4 else v) for k, v in tree_flatten(model.parameters())}


def test_predict_names_classes_from_converted_coco_weights(tmp_path, capsys):
    """A 91-class checkpoint converted, then predict with no annotation file anywhere: the JSON and
    the picture name COCO's categories."""
    from safetensors.numpy import save_file

    overrides = ["model.num_classes=91", "model.nheads=8", "model.enc_n_points=4", "model.dec_n_points=4"]
    mx.random.seed(3)
    model = build_model(load_config(TINY, overrides))
    save_file(authors_state(model), str(tmp_path / "authors.safetensors"))
    convert_main([str(tmp_path / "authors.safetensors"), str(tmp_path / "coco.safetensors")])
    assert "the 80 COCO categories" in capsys.readouterr().out
    assert read_weights(tmp_path / "coco.safetensors").class_names == COCO_CATEGORY_NAMES

    image = generate(tmp_path / "images", 1, 1, seed=2, **SMALL) / "val2017" / "000000000001.png"
    settings = [f"data.path={tmp_path / 'nowhere'}", "model.num_classes=auto", *overrides[1:]]
    argv = ["--config", str(TINY), "--checkpoint", str(tmp_path / "coco.safetensors"), "--output-dir", str(tmp_path)]
    predict_main([*argv, "--threshold", "0", *settings, str(image)])
    records = json.loads((tmp_path / "000000000001.json").read_text())
    named = [r for r in records if r["label"] in COCO_CATEGORY_NAMES]
    assert len(named) > 50  # 100 detections over 91 outputs, 80 of them categories
    assert all(r["name"] == COCO_CATEGORY_NAMES[r["label"]] for r in named)
    assert all(r["name"] == str(r["label"]) for r in records if r["label"] not in COCO_CATEGORY_NAMES)
    assert not (tmp_path / "nowhere").exists()  # predict generated no dataset


def test_eval_meets_the_weights_classes_by_name(new_set):
    """The weights name the five shapes at 1..5; the new set has circle 1, square 2, hexagon 3, star 4:
    square and circle meet by name, hexagon and star have no class of the model."""
    dataset = build_dataset("val", load_config(TINY, [f"data.path={new_set}"]).data)
    recorded = {i + 1: name for i, name in enumerate(CATEGORIES)}
    class_map = match_classes(recorded, dataset.class_names())
    assert class_map == {1: 2, 2: 1}
    assert describe_match(recorded, dataset.class_names(), class_map, dataset.annotation_file) == [
        f"classes met by name (model id -> {dataset.annotation_file}'s id): square 1 -> 2, circle 2 -> 1",
        f"warning: the model has no class named hexagon (3), star (4) of {dataset.annotation_file}: their AP is 0",
    ]
    assert match_classes({1: "Circle", 2: "square"}, dataset.class_names()) == {1: 1, 2: 2}
