import dataclasses
import re

from deformable_detr import build_model, load_config
from deformable_detr.config import CONFIGS_DIR, Config
from deformable_detr.errors import UsageError

import mlx.core as mx
import pytest

AUTHORS = {  # file -> the flags of the authors' script on top of their main.py defaults
    "r50.yaml": {},
    "r50_single_scale.yaml": {"num_feature_levels": 1},
    "r50_single_scale_dc5.yaml": {"num_feature_levels": 1, "dilation": True},
    "r50_box_refine.yaml": {"with_box_refine": True},
    "r50_two_stage.yaml": {"with_box_refine": True, "two_stage": True},
}


@pytest.mark.parametrize("name", AUTHORS)
def test_configs_are_the_authors_defaults_plus_their_flags(name):
    cfg = load_config(CONFIGS_DIR / name)
    expected = Config()  # the dataclass defaults are the authors' main.py defaults
    expected.model = dataclasses.replace(expected.model, **AUTHORS[name])
    # ours, not the authors': at their image sizes a step may fit in memory only with it
    expected.train = dataclasses.replace(expected.train, activation_checkpointing="auto")
    # ours: their 32 images a step in micro-batches that fit this machine
    expected.schedule = dataclasses.replace(expected.schedule, micro_batch_size="auto")
    assert cfg == expected


def test_every_key_is_listed_in_r50_yaml():
    import yaml

    listed = yaml.safe_load((CONFIGS_DIR / "r50.yaml").read_text())
    for section, values in dataclasses.asdict(Config()).items():
        if isinstance(values, dict):
            assert set(listed[section]) == set(values), section
        else:
            assert section in listed


def test_unknown_keys_are_named_with_the_nearest_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  backbone: resnet50\n  num_layers: 3\ntrainer: {}\n")
    with pytest.raises(UsageError, match=r"bad.yaml: trainer: unknown key; did you mean train\?$"):
        load_config(path)
    path.write_text("model:\n  num_layers: 3\n")
    with pytest.raises(UsageError, match=r"bad.yaml: model.num_layers: unknown key; did you mean model.enc_layers\?"):
        load_config(path)
    with pytest.raises(
        UsageError, match=r"^override: optimizer.learning_rate: unknown key; expected one of optimizer.lr,"
    ):
        load_config(None, ["optimizer.learning_rate=1e-3"])
    nothing_near = (
        "override: schedule.foo: unknown key; expected one of schedule.epochs, schedule.lr_drop, schedule.batch_size, "
        "schedule.micro_batch_size"
    )
    with pytest.raises(UsageError, match=f"^{re.escape(nothing_near)}$"):
        load_config(None, ["schedule.foo=1"])
    also = r"schedule.bach_size: unknown key; did you mean schedule.batch_size\? \(also unknown: schedule.epoch\)$"
    with pytest.raises(UsageError, match=also):
        load_config(None, ["schedule={bach_size: 2, epoch: 1}"])


def test_yaml_that_does_not_parse_names_the_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  backbone: resnet18\n hidden_dim: 64\n")
    with pytest.raises(
        UsageError, match=rf"^{re.escape(str(path))}, line 3, column 2: not valid YAML \(expected <block end>"
    ):
        load_config(path)
    with pytest.raises(UsageError, match=r"override 'schedule.batch_size=\[2': '\[2' is not a YAML value"):
        load_config(None, ["schedule.batch_size=[2"])


def test_overrides_and_types(tmp_path):
    cfg = load_config(CONFIGS_DIR / "r50.yaml", ["schedule.batch_size=4", "optimizer.lr=1e-3", "model.two_stage=true"])
    assert (cfg.schedule.batch_size, cfg.optimizer.lr, cfg.model.two_stage) == (4, 1e-3, True)
    with pytest.raises(UsageError, match=r"^override: model.num_queries must be int, got 'many'$"):
        load_config(None, ["model.num_queries=many"])
    with pytest.raises(UsageError, match="config file not found: nowhere.yaml"):
        load_config("nowhere.yaml")


def test_dc5_backbone_keeps_stride_16_and_dilates_layer4():
    model = build_model(load_config(CONFIGS_DIR / "r50_single_scale_dc5.yaml"))
    body = model.backbone[0].body
    # as torchvision with replace_stride_with_dilation=[False, False, True]
    assert body.layer4[0].conv2.stride == (1, 1) and body.layer4[0].conv2.dilation == 1
    assert all(block.conv2.dilation == 2 and block.conv2.padding == (2, 2) for block in body.layer4[1:])
    features = model.backbone[0](mx.zeros((1, 64, 96, 3)), mx.zeros((1, 64, 96), dtype=mx.bool_))
    assert [f.shape for f, _ in features] == [(1, 4, 6, 2048)]
    assert len(model.input_proj) == 1


def test_single_scale_model_runs():
    cfg = load_config(CONFIGS_DIR / "r50_single_scale.yaml", ["model.enc_layers=1", "model.dec_layers=2"])
    model = build_model(cfg)
    out = model(mx.zeros((1, 64, 64, 3)), mx.zeros((1, 64, 64), dtype=mx.bool_))
    assert out["pred_logits"].shape == (1, 300, 91) and out["pred_boxes"].shape == (1, 300, 4)
    assert len(out["aux_outputs"]) == 1


def test_custom_is_r50_with_auto_classes_and_its_own_data():
    cfg = load_config(CONFIGS_DIR / "custom.yaml")
    expected = load_config(CONFIGS_DIR / "r50.yaml", ["model.num_classes=auto", "data.path=data/custom"])
    assert cfg == expected and cfg.model.num_classes == "auto"
