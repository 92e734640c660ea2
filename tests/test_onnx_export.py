"""Export to ONNX: onnxruntime on the exported file against the MLX model, per variant, on small
models with every weight moved off its initial value; the graph's ops and ranks; the command and
its one-line errors."""

import sys

from deformable_detr.data.transforms import normalize, resize
from deformable_detr.models import post_process

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

onnx = pytest.importorskip("onnx", reason="exporting to ONNX needs the onnx package (the onnx and dev extras)")
ort = pytest.importorskip("onnxruntime", reason="running the exported file needs onnxruntime (the onnx and dev extras)")

from deformable_detr.deploy.inputs import canvas_inputs, pad_to_canvas  # noqa: E402
from deformable_detr.deploy.onnx.detector import build_graph  # noqa: E402
from deformable_detr.export import main  # noqa: E402

from export_models import (  # noqa: E402
    CANVAS,
    SIZES,
    VARIANTS,
    assert_close,
    assert_post_processed,
    padded_batch,
    small_checkpoint,
    small_model,
    weights_of,
)


def session(model_proto):
    return ort.InferenceSession(model_proto.SerializeToString(), providers=["CPUExecutionProvider"])


CASES = [(v, "gather", True) for v in VARIANTS] + [
    ("r50", "grid_sample", True),
    ("r50_two_stage", "grid_sample", True),
    ("r50_two_stage", "gather", False),  # the padding's proposals picked: infinite proposals in the graph
]


@pytest.mark.parametrize("variant,sampler,padding_low", CASES)
def test_onnxruntime_gives_our_logits_and_boxes(variant, sampler, padding_low):
    model, cfg = small_model(variant, padding_low)
    images, mask = padded_batch()
    graph = build_graph(weights_of(model), cfg.model, CANVAS, batch=len(SIZES), sampler=sampler)
    inputs = {"pixel_values": images.transpose(0, 3, 1, 2).copy(), "pixel_mask": (~mask).astype(np.int64)}
    logits, boxes = session(graph).run(["logits", "pred_boxes"], inputs)

    ours = model(mx.array(images), mx.array(mask))
    for i, size in enumerate(SIZES):
        assert_close(ours["pred_logits"][i], logits[i], f"logits of the {size} image")
        assert_close(ours["pred_boxes"][i], boxes[i], f"boxes of the {size} image")
    if cfg.model.two_stage:  # the queries came from distinct proposals, or all but one from the padding
        distinct = len(np.unique(boxes[0].round(4), axis=0))
        assert distinct == cfg.model.num_queries if padding_low else distinct < cfg.model.num_queries


@pytest.mark.parametrize("variant", ["r50", "r50_two_stage"])
def test_postprocess_graph_gives_post_process_detections(variant):
    model, cfg = small_model(variant)
    rng = np.random.default_rng(2)
    photos = [Image.fromarray(rng.integers(0, 256, (h * 3, w * 3, 3), np.uint8)) for h, w in SIZES]
    inputs = canvas_inputs(photos, CANVAS, size=64, max_size=100)
    target_sizes = np.array([[p.height, p.width] for p in photos], np.int64)
    graph = build_graph(weights_of(model), cfg.model, CANVAS, batch=len(photos), postprocess=True)
    scores, labels, boxes = session(graph).run(["scores", "labels", "boxes"], {**inputs, "target_sizes": target_sizes})

    assert_post_processed(model, inputs, target_sizes, (scores, labels, boxes))


def test_hugging_face_code_runs_the_file_unchanged():
    """transformers' image processor (padded to the canvas) feeds the file, and its post-processing
    reads the file's outputs, as for DeformableDetrForObjectDetection."""
    transformers = pytest.importorskip("transformers", reason="the Hugging Face processor (the dev extra)")
    torch = pytest.importorskip("torch", reason="transformers' post-processing takes torch tensors (the dev extra)")
    from transformers.models.deformable_detr.modeling_deformable_detr import DeformableDetrObjectDetectionOutput

    model, cfg = small_model("r50_box_refine")
    rng = np.random.default_rng(4)
    photos = [Image.fromarray(rng.integers(0, 256, (h * 2, w * 2, 3), np.uint8)) for h, w in SIZES]
    processor_class = getattr(
        transformers, "DeformableDetrImageProcessorPil", transformers.DeformableDetrImageProcessor
    )
    processor = processor_class(size={"shortest_edge": 64, "longest_edge": 100})
    inputs = processor(images=photos, return_tensors="np", pad_size={"height": CANVAS[0], "width": CANVAS[1]})
    graph = build_graph(weights_of(model), cfg.model, CANVAS, batch=len(photos))
    logits, boxes = session(graph).run(["logits", "pred_boxes"], dict(inputs))

    images = mx.array(inputs["pixel_values"].transpose(0, 2, 3, 1))
    outputs = model(images, mx.array(inputs["pixel_mask"] == 0))
    assert_close(outputs["pred_logits"], logits, "logits")
    target_sizes = [(p.height, p.width) for p in photos]
    theirs = processor.post_process_object_detection(
        DeformableDetrObjectDetectionOutput(logits=torch.from_numpy(logits), pred_boxes=torch.from_numpy(boxes)),
        threshold=0.0,
        target_sizes=target_sizes,
    )
    for ours, their in zip(post_process(outputs, target_sizes), theirs, strict=True):
        assert_close(ours["scores"], their["scores"].numpy(), "scores")
        np.testing.assert_array_equal(np.array(ours["labels"]), their["labels"].numpy())
        assert_close(ours["boxes"], their["boxes"].numpy(), "boxes")


def test_canvas_inputs_are_predicts_preprocessing():
    photo = Image.fromarray(np.random.default_rng(3).integers(0, 256, (150, 200, 3), np.uint8))
    inputs = canvas_inputs([photo], CANVAS, size=64, max_size=100)
    expected, _ = normalize(*resize(photo, {"boxes": np.zeros((0, 4), np.float32)}, 64, 100))  # as predict
    h, w = expected.shape[:2]
    np.testing.assert_array_equal(inputs["pixel_values"][0, :, :h, :w], expected.transpose(2, 0, 1))
    assert inputs["pixel_mask"][0].sum() == h * w and inputs["pixel_mask"][0, :h, :w].all()
    assert not inputs["pixel_values"][0, :, h:].any() and not inputs["pixel_values"][0, :, :, w:].any()


@pytest.mark.parametrize("variant,sampler", [("r50_two_stage", "gather"), ("r50_single_scale_dc5", "grid_sample")])
def test_graph_has_standard_ops_static_shapes_and_ranks_at_most_5(variant, sampler):
    model, cfg = small_model(variant)
    graph = onnx.shape_inference.infer_shapes(
        build_graph(weights_of(model), cfg.model, CANVAS, batch=2, postprocess=True, sampler=sampler), strict_mode=True
    )
    assert [(o.domain, o.version) for o in graph.opset_import] == [("", 17)]
    assert {node.domain for node in graph.graph.node} == {""}
    assert all(onnx.defs.has(node.op_type) for node in graph.graph.node)
    values = [*graph.graph.input, *graph.graph.value_info, *graph.graph.output]
    shapes = {
        v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim] for v in values
    }
    shapes.update({t.name: list(t.dims) for t in graph.graph.initializer})
    produced = {name for node in graph.graph.node for name in node.output}
    assert produced <= set(shapes), sorted(produced - set(shapes))[:5]  # every tensor's shape is known
    assert all(None not in shape and 0 not in shape for shape in shapes.values())
    assert max(len(shape) for shape in shapes.values()) == 5  # the sampled values (N, Q, heads, taps, C)
    assert shapes["pixel_values"] == [2, 3, *CANVAS] and shapes["boxes"] == [2, 60, 4]


def test_command_writes_the_file_after_checking_it(tmp_path, capsys):
    path, model = small_checkpoint(tmp_path)
    out = tmp_path / "model.onnx"
    main(["--to", "onnx", "--checkpoint", str(path), str(out), "--size", "96", "128", "--postprocess"])
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"wrote {out}: ") and "canvas 96 x 128, batch 1, outputs scores, labels, boxes" in line
    assert "onnxruntime" in line and "within" in line and "of the largest value of ours" in line
    names = [i.name for i in ort.InferenceSession(str(out)).get_inputs()]
    assert names == ["pixel_values", "pixel_mask", "target_sizes"]


def test_a_failed_check_leaves_no_file(tmp_path, monkeypatch):
    from deformable_detr.deploy.onnx import export

    path, _ = small_checkpoint(tmp_path, "r50_single_scale")
    monkeypatch.setattr(export, "TOLERANCE", 0.0)  # float32 rounding differs: the check must fail
    out = tmp_path / "model.onnx"
    with pytest.raises(
        SystemExit, match=rf"^error: {out}: onnxruntime .* over 0: the export is wrong, not written$"
    ) as stop:
        main(["--to", "onnx", "--checkpoint", str(path), str(out), "--size", "64", "64"])
    assert "\n" not in str(stop.value.code)
    assert not list(tmp_path.glob("model*.onnx"))


def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys):
    path, _ = small_checkpoint(tmp_path)
    out = str(tmp_path / "model.onnx")
    with pytest.raises(SystemExit) as stop:  # two-stage needs num_queries proposals: 12 > 4 tokens
        main(["--to", "onnx", "--checkpoint", str(path), out, "--size", "8", "8"])
    assert stop.value.code == 2
    assert "two-stage takes the top 12 of the encoder's proposals, and this canvas gives 4" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        main(["--to", "torch", "--checkpoint", str(path), out, "--postprocess"])
    assert stop.value.code == 2 and "are for --to onnx or mlx, not --to torch" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^image 1: 100 x 50 does not fit the 96 x 128 canvas"):
        pad_to_canvas([np.zeros((10, 10, 3)), np.zeros((100, 50, 3))], CANVAS)
    monkeypatch.setitem(sys.modules, "onnx", None)  # as if the extra were not installed
    with pytest.raises(SystemExit, match=r'needs onnx, in the "onnx" extra: pip install -e "\.\[onnx\]"$'):
        main(["--to", "onnx", "--checkpoint", str(path), out])


def test_without_onnxruntime_the_file_is_written_and_says_it_is_unchecked(tmp_path, monkeypatch, capsys):
    path, model = small_checkpoint(tmp_path, "r50_box_refine")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    canvas = ["--size", "64", "96", "--batch-size", "2"]
    main(["--to", "onnx", "--checkpoint", str(path), str(tmp_path / "model.onnx"), *canvas])
    assert capsys.readouterr().out.strip().endswith('not run: onnxruntime is not installed (pip install -e ".[onnx]")')
    monkeypatch.undo()
    images, mask = padded_batch()
    images, mask = images[:2, :64, :96], mask[:2, :64, :96]
    logits = ort.InferenceSession(str(tmp_path / "model.onnx")).run(
        ["logits"], {"pixel_values": images.transpose(0, 3, 1, 2).copy(), "pixel_mask": (~mask).astype(np.int64)}
    )[0]
    assert_close(model(mx.array(images), mx.array(mask))["pred_logits"], logits, "logits")
