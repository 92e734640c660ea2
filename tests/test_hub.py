"""Weights by name, hf://ORG/NAME[@REVISION], from a Hugging Face cache built here in the layout
huggingface_hub reads (models--ORG--NAME/refs/REF, snapshots/COMMIT/...), offline; and Hugging Face
both ways: files of the installed transformers convert and match it, exports load in it."""

import json
import shutil

from deformable_detr import build_model, load_config
from deformable_detr.config import model_overrides as overrides
from deformable_detr.inference.detector import Detector
from deformable_detr.predict import main as predict_main
from deformable_detr.weights.conversion import convert
from deformable_detr.weights.loading import load_for_finetuning, open_weights

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch reference (dev extra)")
transformers = pytest.importorskip("transformers", reason="the Hugging Face reference (dev extra)")

COMMIT, OTHER_COMMIT = "0123456789abcdef0123456789abcdef01234567", "89abcdef0123456789abcdef0123456789abcdef"
LABELS = {0: "N/A", 1: "cat", 2: "dog", 3: "N/A", 4: "bird", 5: "fish", 6: "frog"}


def huggingface_model(variant: str, seed: int = 0):
    from hf_reference import huggingface_model as model

    return model(variant, LABELS, seed)


def outputs_of(hf, model):
    images = torch.randn(2, 3, 96, 128, generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, 96, 128, dtype=torch.bool)
    mask[0, 80:], mask[1, :, 100:] = True, True
    with torch.no_grad():
        theirs = hf(pixel_values=images, pixel_mask=(~mask).long())
    ours = model(mx.array(images.permute(0, 2, 3, 1).numpy()), mx.array(mask.numpy()))
    return (np.array(ours["pred_logits"]), np.array(ours["pred_boxes"])), (
        theirs.logits.numpy(),
        theirs.pred_boxes.numpy(),
    )


def model_for(weights, options):
    model = build_model(load_config(None, overrides(options) + ["model.dropout=0.0"]))
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    model.eval()
    return model


@pytest.mark.parametrize("variant", ["base", "single_scale", "refine", "refine+two_stage"])
def test_files_of_the_installed_transformers_convert_and_match_it(variant, tmp_path):
    hf = huggingface_model(variant)
    hf.save_pretrained(tmp_path)
    weights, options, _ = convert(tmp_path)
    (ours_logits, ours_boxes), (logits, boxes) = outputs_of(hf, model_for(weights, options))
    np.testing.assert_allclose(ours_logits, logits, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ours_boxes, boxes, rtol=1e-4, atol=1e-4)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hugging Face cache with ORG/detr (main: a two-stage refining model; v1: a base one) and
    ORG/not-detr, offline; this project's cache of converted files beside it."""
    cache = tmp_path / "hf-cache"
    repo = cache / "models--ORG--detr"
    for ref, commit, variant in (("main", COMMIT, "refine+two_stage"), ("v1", OTHER_COMMIT, "base")):
        huggingface_model(variant).save_pretrained(repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    other = cache / "models--ORG--not-detr" / "snapshots" / COMMIT
    other.mkdir(parents=True)
    (other / "config.json").write_text(json.dumps({"model_type": "detr"}))
    (cache / "models--ORG--not-detr" / "refs").mkdir()
    (cache / "models--ORG--not-detr" / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DEFORMABLE_DETR_CACHE", str(tmp_path / "converted"))
    return repo, tmp_path / "converted" / "ORG--detr"


def test_a_hub_reference_is_converting_its_folder_once(hub, monkeypatch):
    repo, converted = hub
    weights, _, _ = convert(repo / "snapshots" / COMMIT)
    from_hub = open_weights("hf://ORG/detr")
    assert from_hub.path == converted / f"{COMMIT}.safetensors"
    assert from_hub.tensors.keys() == weights.keys()
    for key, value in weights.items():
        np.testing.assert_array_equal(np.array(from_hub.tensors[key]), value, err_msg=key)
    assert from_hub.class_names == {1: "cat", 2: "dog", 4: "bird", 5: "fish", 6: "frog"}  # id2label, less N/A
    assert from_hub.model_options["two_stage"] and from_hub.config_file == "r50_two_stage.yaml"

    from deformable_detr.weights import hub as hub_module

    import huggingface_hub

    with monkeypatch.context() as patched:
        patched.setattr(hub_module, "convert", lambda *a, **k: pytest.fail("converted twice"))
        patched.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: pytest.fail("asked the Hub twice"))
        assert open_weights("hf://ORG/detr").path == from_hub.path  # kept, keyed by the snapshot
    v1 = open_weights("hf://ORG/detr@v1")
    assert v1.path == converted / f"{OTHER_COMMIT}.safetensors" and not v1.model_options["two_stage"]


def test_convert_takes_a_hub_reference(hub, tmp_path, capsys):
    from deformable_detr.convert import main as convert_main

    convert_main(["hf://ORG/detr", str(tmp_path / "detr.safetensors")])
    assert "category names: the 5 of config.json's id2label (recorded in the file)" in capsys.readouterr().out
    written, from_hub = open_weights(tmp_path / "detr.safetensors"), open_weights("hf://ORG/detr")
    assert written.tensors.keys() == from_hub.tensors.keys() and written.class_names == from_hub.class_names
    for key, value in written.tensors.items():
        np.testing.assert_array_equal(np.array(value), np.array(from_hub.tensors[key]), err_msg=key)


def test_predict_and_finetune_take_a_hub_reference_without_a_config(hub, tmp_path, capsys):
    from PIL import Image

    Image.new("RGB", (120, 90), "gray").save(tmp_path / "image.png")
    argv = ["--checkpoint", "hf://ORG/detr", "--output-dir", str(tmp_path / "out"), "--threshold", "0"]
    predict_main([*argv, str(tmp_path / "image.png")])
    records = json.loads((tmp_path / "out" / "image.json").read_text())
    named = {r["label"]: r["name"] for r in records}  # a random model: the unnamed ids 0 and 3 too, by number
    assert len(records) == 100 and named == {i: LABELS[i] if LABELS[i] != "N/A" else str(i) for i in named}
    cfg = load_config(
        None,
        ["model.backbone=resnet50", "model.hidden_dim=64", "model.nheads=4", "model.enc_layers=2"]
        + ["model.dec_layers=2", "model.dim_feedforward=128", "model.num_queries=20"]
        + ["model.with_box_refine=true", "model.two_stage=true", "model.num_classes=3"],
    )
    said = load_for_finetuning(build_model(cfg), "hf://ORG/detr", {1: "dog", 2: "horse"})
    assert "dog (2 -> 1)" in said and "new: horse (2)" in said


@pytest.mark.parametrize(
    "reference, says",
    [
        (
            "hf://ORG/nothing",
            "hf://ORG/nothing: config.json is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE=1",
        ),
        (
            "hf://ORG/detr@v2",
            "hf://ORG/detr@v2: config.json is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE=1",
        ),
        ("hf://ORG/not-detr", "hf://ORG/not-detr is not a Deformable DETR (config.json's model_type is 'detr')"),
        ("hf://detr", "hf://detr: expected hf://ORG/NAME or hf://ORG/NAME@REVISION"),
    ],
)
def test_bad_hub_references(hub, tmp_path, reference, says, capsys):
    with pytest.raises(SystemExit) as stopped:
        predict_main(["--checkpoint", reference, str(tmp_path)])
    said = str(stopped.value.code) if stopped.value.code not in (1, 2) else capsys.readouterr().err.strip()
    assert said == "error: " + says.format(cache=tmp_path / "hf-cache")


def test_a_download_cut_short_leaves_no_converted_file(hub):
    repo, converted = hub
    weights_file = repo / "snapshots" / COMMIT / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:5000])  # as a cut download would have left it
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        open_weights("hf://ORG/detr")
    assert not converted.exists() or not any(converted.iterdir())


def test_the_hubs_answers_in_one_line(hub, monkeypatch):
    import httpx2
    import huggingface_hub
    from huggingface_hub import errors

    response = httpx2.Response(404, request=httpx2.Request("GET", "https://huggingface.co/api/models/ORG/gone"))
    answers = {
        "hf://ORG/gone": (
            errors.RepositoryNotFoundError("404 Repository Not Found", response=response),
            "hf://ORG/gone: the Hub has no repository ORG/gone (or it is private or gated",
        ),
        "hf://ORG/gone@v9": (
            errors.RevisionNotFoundError("404 Revision Not Found", response=response),
            "hf://ORG/gone@v9: the Hub has no revision 'v9' of ORG/gone",
        ),
        "hf://ORG/cut": (
            OSError("Connection reset by peer"),
            "hf://ORG/cut: downloading config.json failed: Connection reset by peer",
        ),
    }
    for reference, (error, says) in answers.items():
        monkeypatch.setattr(
            huggingface_hub, "hf_hub_download", lambda *a, error=error, **k: (_ for _ in ()).throw(error)
        )
        with pytest.raises(OSError) as raised:
            open_weights(reference)
        assert str(raised.value).startswith(says) and "\n" not in str(raised.value)


def test_the_bin_file_when_there_is_no_safetensors(hub):
    repo, _ = hub
    snapshot = repo / "snapshots" / COMMIT
    weights = open_weights("hf://ORG/detr")
    state = {
        k: v for k, v in transformers.DeformableDetrForObjectDetection.from_pretrained(snapshot).state_dict().items()
    }
    torch.save(state, snapshot / "pytorch_model.bin")
    (snapshot / "model.safetensors").unlink()
    shutil.rmtree(weights.path.parent)
    from_bin = open_weights("hf://ORG/detr")
    for key, value in weights.tensors.items():
        np.testing.assert_array_equal(np.array(from_bin.tensors[key]), np.array(value), err_msg=key)


def port_model(variant: str, tmp_path, width: int = 64):
    """This port's model of a variant with every weight moved off its initial value, saved as
    converted weights that record their category names and options."""
    from deformable_detr.weights.conversion import save_converted

    from hf_reference import VARIANTS
    from mlx.utils import tree_flatten, tree_map

    refine, two_stage, levels = VARIANTS[variant]
    options = {"backbone": "resnet18", "backbone_width": width, "hidden_dim": 64, "nheads": 4, "enc_layers": 2}
    options |= {"dec_layers": 2, "dim_feedforward": 128, "num_queries": 20, "num_classes": 7, "dilation": False}
    options |= {"with_box_refine": refine, "two_stage": two_stage, "num_feature_levels": levels, "dropout": 0.0}
    mx.random.seed(5)
    model = build_model(load_config(None, overrides(options)))
    model.update(tree_map(lambda p: p + 0.05 * mx.random.normal(p.shape), model.parameters()))
    model.eval()
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    (tmp_path / "names").mkdir()
    (tmp_path / "names" / "config.json").write_text(json.dumps({"id2label": {str(i): n for i, n in LABELS.items()}}))
    save_converted(tmp_path / "port.safetensors", weights, options, tmp_path / "names")
    return model, weights


@pytest.mark.parametrize("variant", ["base", "single_scale", "refine", "refine+two_stage"])
def test_exported_to_huggingface_loads_in_transformers_with_our_outputs(variant, tmp_path):
    from deformable_detr.export import main as export_main

    model, weights = port_model(variant, tmp_path, width=32)  # transformers' ResNet takes any width
    out = tmp_path / "hf"
    port = str(tmp_path / "port.safetensors")
    export_main(["--to", "huggingface", "--hf-backbone", "transformers", "--checkpoint", port, str(out)])
    hf, loading = transformers.DeformableDetrForObjectDetection.from_pretrained(out, output_loading_info=True)
    assert not any(loading.values()), loading  # no missing, unexpected or mismatched key
    (ours_logits, ours_boxes), (logits, boxes) = outputs_of(hf.eval(), model)
    np.testing.assert_allclose(logits, ours_logits, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(boxes, ours_boxes, rtol=1e-4, atol=1e-4)
    assert hf.config.id2label == LABELS
    back, _, _ = convert(out)  # and back: the same arrays, the same names
    assert back.keys() == weights.keys()
    for key in weights:
        np.testing.assert_array_equal(back[key], weights[key], err_msg=key)


def test_the_hubs_timm_layout(tmp_path):
    """The SenseTime checkpoints' layout: the ResNet under timm's (= torchvision's) names, every other
    key as the transformers layout's; it converts back to the same weights."""
    _, weights = port_model("refine+two_stage", tmp_path)
    detector = Detector.load(tmp_path / "port.safetensors")
    detector.export("huggingface", tmp_path / "timm", hf_backbone="timm")
    detector.export("huggingface", tmp_path / "own", hf_backbone="transformers")
    from safetensors.numpy import load_file

    timm, own = load_file(tmp_path / "timm" / "model.safetensors"), load_file(tmp_path / "own" / "model.safetensors")
    backbone = "model.backbone.conv_encoder.model."
    assert {k for k in timm if not k.startswith(backbone)} == {k for k in own if not k.startswith(backbone)}
    torchvision_names = {k[len("backbone.0.body.") :] for k in weights if k.startswith("backbone.0.body.")}
    assert {k[len(backbone) :] for k in timm if k.startswith(backbone)} == torchvision_names | {
        k.replace(".weight", f".{b}")
        for k in torchvision_names
        if ".bn" in k or "bn1" in k or "downsample.1" in k
        for b in ("running_mean", "running_var")
        if k.endswith(".weight")
    }
    config = json.loads((tmp_path / "timm" / "config.json").read_text())
    assert config["use_timm_backbone"] and config["backbone"] == "resnet18" and config["backbone_config"] is None
    back, _, _ = convert(tmp_path / "timm")
    for key in weights:
        np.testing.assert_array_equal(back[key], weights[key], err_msg=key)
    pytest.importorskip(
        "timm",
        reason="from_pretrained of the timm layout needs timm, which needs torchvision: "
        "neither has a build for torch 2.13.0+cpu here",
    )
    hf, loading = transformers.DeformableDetrForObjectDetection.from_pretrained(
        tmp_path / "timm", output_loading_info=True
    )
    assert not any(loading.values()), loading


def test_transformers_pipeline_runs_an_export(tmp_path):
    from PIL import Image

    port_model("base", tmp_path, width=32)
    Detector.load(tmp_path / "port.safetensors").export("huggingface", tmp_path / "hf", hf_backbone="transformers")
    detector = transformers.pipeline("object-detection", model=str(tmp_path / "hf"), threshold=0.0)
    found = detector(Image.new("RGB", (120, 90), "gray"))
    assert found and {d["label"] for d in found} <= set(LABELS.values()) and {"box", "score"} <= set(found[0])


def test_export_refuses_what_the_layout_cannot_hold(tmp_path):
    from deformable_detr.errors import ConversionError

    port_model("base", tmp_path, width=32)
    with pytest.raises(
        ConversionError, match="timm's resnet18 has width 64; export it with --hf-backbone transformers"
    ):
        Detector.load(tmp_path / "port.safetensors").export("huggingface", tmp_path / "hf", hf_backbone="timm")
    assert not (tmp_path / "hf").exists()
