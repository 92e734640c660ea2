"""Model settings that do not go together (models/combinations.py) are refused at once: by train, eval,
predict, serve and `Detector.load` before any data, weights or input is read, any run directory claimed or
any model built, in one line naming the keys, exit 2; a model built from Python by the same rule. And the
precision line of each command says where its precision comes from: asked for, or the command's default."""

import dataclasses
import json

from deformable_detr import Detector
from deformable_detr.commands import eval as eval_command
from deformable_detr.commands import predict as predict_command
from deformable_detr.commands import train as train_command
from deformable_detr.config import CONFIGS_DIR, load_config, shipped_configs
from deformable_detr.data.shapes import generate
from deformable_detr.errors import UsageError
from deformable_detr.models import DeformableDETR, build_model
from deformable_detr.models.backbones import build_backbone
from deformable_detr.models.combinations import model_problem
from deformable_detr.models.deformable_transformer import DeformableTransformer
from deformable_detr.weights.files import save_weights

import pytest
from mlx.utils import tree_flatten
from test_train import TINY

# what the model refuses -> the overrides (on tests/fixtures/tiny.yaml: resnet18, hidden_dim 64, 4 heads), the line
REFUSED = {
    "look forward twice without box refinement": (
        ["model.look_forward_twice=true", "model.with_box_refine=false"],
        "model.look_forward_twice needs model.with_box_refine: it looks at the refined boxes",
    ),
    "mixed selection without two-stage": (
        ["model.mixed_selection=true"],
        "model.mixed_selection needs model.two_stage: it mixes the encoder's proposals in",
    ),
    "DC5 with a Swin": (
        ["model.backbone=swin_tiny", "model.dilation=true"],
        "model.dilation (DC5) dilates a ResNet's last stage; model.backbone swin_tiny has none: set "
        "model.dilation=false",
    ),
    "heads that do not divide the width": (
        ["model.nheads=3"],
        "model.hidden_dim 64 is not a multiple of model.nheads 3: each head takes hidden_dim / nheads of the channels",
    ),
    "two feature levels of three maps": (
        ["model.num_feature_levels=2"],
        "model.num_feature_levels 2 with model.backbone_maps auto: the levels are the backbone's 3 maps, then maps "
        "made from the last: 1 level takes 1 map, more take 3 or 4",
    ),
    "four maps in four levels' place": (
        ["model.backbone_maps=4", "model.num_feature_levels=3"],
        "model.num_feature_levels 3 with model.backbone_maps 4: the levels are the backbone's 4 maps, then maps "
        "made from the last: 1 level takes 1 map, more take 3 or 4",
    ),
    "DINO without its two-stage": (
        ["model.architecture=dino"],
        "model.architecture dino needs model.two_stage, model.with_box_refine and model.mixed_selection (DINO's "
        "code builds only that: configs/dino_r50_4scale_12ep.yaml)",
    ),
    "denoising without DINO": (
        ["model.dn_number=100"],
        "model.dn_number (contrastive denoising) needs model.architecture dino",
    ),
    "a width the group norm cannot split": (
        ["model.hidden_dim=48"],
        "model.hidden_dim 48: a multiple of 32, the groups of the input projections' norm",
    ),
    "an unknown backbone": (["model.backbone=resnet51"], "model.backbone resnet51: expected one of resnet18, "),
}


def refused_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0].removeprefix("error: ")


@pytest.mark.parametrize("case", list(REFUSED))
def test_each_rule_is_one_line_and_a_model_built_from_python_keeps_it(case):
    overrides, said = REFUSED[case]
    cfg = load_config(TINY, overrides)
    assert model_problem(cfg.model).startswith(said) and "\n" not in model_problem(cfg.model)
    with pytest.raises(ValueError) as refused:  # a UsageError is one
        build_model(cfg)
    assert str(refused.value) == model_problem(cfg.model)


def test_the_model_refuses_its_own_combinations_when_built_by_hand():
    cfg = load_config(TINY)
    backbone, transformer = build_backbone(cfg.model), DeformableTransformer(cfg.model)
    mixed = dataclasses.replace(cfg.model, mixed_selection=True)
    with pytest.raises(ValueError, match=r"^model.mixed_selection needs model.two_stage"):
        DeformableDETR(backbone, transformer, mixed)


def test_every_shipped_config_is_a_model():
    for name in shipped_configs():
        assert model_problem(load_config(name).model) is None, name


@pytest.mark.parametrize("case", list(REFUSED))
def test_train_refuses_before_reading_data_or_claiming_its_directory(case, tmp_path, monkeypatch, capsys):
    overrides, said = REFUSED[case]
    monkeypatch.chdir(tmp_path)
    argv = ["--config", str(TINY), "--output-dir", "run", "data.path=nowhere", *overrides]
    with pytest.raises(SystemExit) as stopped:  # the data (nowhere) would have stopped it with exit 1
        train_command.main(argv)
    assert stopped.value.code == 2 and refused_line(capsys).startswith(said)
    assert list(tmp_path.iterdir()) == []  # no run directory, no lock


def test_the_quick_starts_config_refused_leaves_nothing(tmp_path, monkeypatch, capsys):
    """The issue's case: the shapes set (data/shapes, generated where absent) neither generated nor read."""
    monkeypatch.chdir(tmp_path)
    argv = ["--config", "shapes", "model.look_forward_twice=true", "model.with_box_refine=false", "--output-dir", "X"]
    with pytest.raises(SystemExit) as stopped:
        train_command.main(argv)
    assert stopped.value.code == 2 and refused_line(capsys) == REFUSED["look forward twice without box refinement"][1]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", ["DC5 with a Swin", "mixed selection without two-stage"])
@pytest.mark.parametrize("command", ["eval", "predict", "serve"])
def test_commands_that_load_a_model_refuse_before_reading_its_weights_or_inputs(
    command, case, tmp_path, monkeypatch, capsys
):
    """The weights (and predict's image) do not exist: read first, they would have stopped it with exit 1."""
    if command == "serve":
        pytest.importorskip("uvicorn", reason="serve needs uvicorn (the serve extra)")
        from deformable_detr.commands import serve as serve_command
    mains = {"eval": eval_command.main, "predict": predict_command.main}
    mains["serve"] = serve_command.main if command == "serve" else None
    overrides, said = REFUSED[case]
    monkeypatch.chdir(tmp_path)
    argv = ["--config", str(TINY), "--checkpoint", "none.safetensors", *overrides]
    with pytest.raises(SystemExit) as stopped:
        mains[command](argv + (["no.png"] if command == "predict" else []))
    assert stopped.value.code == 2 and refused_line(capsys).startswith(said)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", list(REFUSED))
def test_detector_load_refuses_before_reading_the_weights(case, tmp_path):
    overrides, said = REFUSED[case]
    with pytest.raises(UsageError) as refused:
        Detector.load(tmp_path / "none.safetensors", TINY, overrides)
    assert str(refused.value).startswith(said)
    with pytest.raises(UsageError) as refused:  # a Config given
        Detector.load(tmp_path / "none.safetensors", load_config(TINY, overrides))
    assert str(refused.value).startswith(said)


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    """tiny.yaml's model as built (not trained: the precision lines are what is tested), and 2 val images."""
    tmp = tmp_path_factory.mktemp("untrained")
    root = generate(tmp / "data", 2, 2, seed=5, height=(64, 64), width=(64, 64), max_size=40)
    weights = tmp / "tiny.safetensors"
    save_weights(weights, dict(tree_flatten(build_model(load_config(TINY)).parameters())))
    return root, weights


def precision_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("precision: ")]
    assert len(lines) == 1, lines
    return lines[0].removeprefix("precision: ")


def test_precision_lines_say_asked_for_only_when_asked(untrained, tmp_path, capsys):
    root, weights = untrained
    model = ["--config", str(TINY), "--checkpoint", str(weights)]
    evaluating = [*model, "--data-path", str(root), "--output-dir", str(tmp_path / "eval")]
    stats = eval_command.main(evaluating)
    assert precision_line(capsys) == "float32 (the default)"  # eval's: AP is a reference number
    written = json.loads((tmp_path / "eval" / "eval_results.json").read_text())["precision"]
    assert written == stats["precision"] == {"ran": "float32", "asked": "float32", "reason": "the default"}
    eval_command.main([*evaluating, "--precision", "float32"])
    assert precision_line(capsys) == "float32 (asked for)"

    image = str(sorted((root / "val2017").iterdir())[0])
    predict_command.main([*model, "--output-dir", str(tmp_path / "predict"), image])
    by_default = precision_line(capsys)
    assert by_default.split(" (")[1].startswith("auto, the default: ") and "asked" not in by_default
    predict_command.main([*model, "--output-dir", str(tmp_path / "predict"), "--precision", "auto", image])
    asked = precision_line(capsys)
    assert asked.split(" (")[1].startswith("auto: ") and asked.split(" (")[0] == by_default.split(" (")[0]


def test_a_detector_given_no_precision_says_float32_is_the_default():
    detector = Detector(build_model(load_config(CONFIGS_DIR / "shapes.yaml", ["model.num_classes=3"])), None, {})
    assert str(detector.precision) == "float32 (the default)"
