"""Export of DINO models (model.architecture dino, models/dino.py): the ONNX file in onnxruntime and in OpenVINO,
and the .mlxfn file in a process with only mlx, against the MLX model on the same padded batch, held to
export_models.assert_close's 1e-4 of the largest value as every other variant's exports: small DINO models of 4
levels and of 5 (the stride-4 map), every weight off its init; one of R50's sizes at 5 levels on a small canvas; the
post-processed files' detections, DINO's 300 an image (its evaluation.top_k, DINO's num_select); the commands' lines.

DINO's queries take their contents by slot (tgt_embed) and their boxes from the ranked proposals, so two proposals
whose scores float32's rounding could swap give two queries other boxes: each model here ranks its proposals
unambiguously (asserted), as the other two-stage tests' models do."""

from importlib.util import find_spec
from types import SimpleNamespace

from deformable_detr import build_model, load_config
from deformable_detr.config import CONFIGS_DIR
from deformable_detr.deploy.check import TOLERANCE, detection_difference, differences, swappable_queries
from deformable_detr.deploy.inputs import canvas_inputs
from deformable_detr.deploy.mlxfn import export_mlx
from deformable_detr.export import main
from deformable_detr.models import post_process
from deformable_detr.models.deformable_transformer import DeformableTransformer
from deformable_detr.models.dino import DINOTransformer

import mlx.core as mx
import numpy as np
import pytest
from export_models import (
    CANVAS,
    DINO_VARIANTS,
    SIZES,
    assert_close,
    padded_batch,
    ranking_row,
    small_checkpoint,
    small_model,
    weights_of,
)
from mlx.utils import tree_flatten
from PIL import Image
from test_export_mlx import in_plain_mlx

if find_spec("openvino") and find_spec("onnx"):
    from test_openvino import openvino  # noqa: F401  the fixture: OpenVINO in a process of its own (its module: why)
else:

    @pytest.fixture(scope="module")
    def openvino():
        pytest.skip("running the file in OpenVINO needs the openvino and onnx packages (the dev extra)")


FOUR_SCALE, FIVE_SCALE = DINO_VARIANTS
MANY_QUERIES = ("model.num_queries=90",)  # 450 (query, class) pairs, of which DINO's 300 are kept
R50_SIZES = (  # the 5-scale config's own sizes but 100 queries: the best 100 of its proposals are not near ties
    *("model.backbone=resnet50", "model.backbone_width=64", "model.hidden_dim=256", "model.nheads=8"),
    *("model.enc_layers=6", "model.dec_layers=6", "model.dim_feedforward=2048", "model.num_classes=91"),
    *("model.enc_n_points=4", "model.dec_n_points=4", "model.num_queries=100"),
)


def build_onnx(model, cfg, **options):
    pytest.importorskip("onnx", reason="exporting to ONNX needs the onnx package (the onnx and dev extras)")
    from deformable_detr.deploy.onnx.detector import build_graph

    return build_graph(weights_of(model), cfg.model, **options)


@pytest.fixture(params=["onnxruntime", "openvino"])
def runtime(request, tmp_path):
    """run(graph, inputs) -> the ONNX graph's outputs by name, from onnxruntime (CPU) or OpenVINO (f32)."""
    if request.param == "openvino":
        run = request.getfixturevalue("openvino")
        return lambda graph, inputs: run(graph, tmp_path / "model.onnx", inputs)
    ort = pytest.importorskip("onnxruntime", reason="running the file needs onnxruntime (the onnx and dev extras)")

    def run(graph, inputs):
        session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
        return dict(zip([output.name for output in session.get_outputs()], session.run(None, inputs), strict=True))

    return run


def graph_inputs(images, mask) -> dict:
    return {"pixel_values": images.transpose(0, 3, 1, 2).copy(), "pixel_mask": (~mask).astype(np.int64)}


def padding_chosen(outputs) -> np.ndarray:
    """(B,) how many of the chosen proposals are the padding's (their box all 1: sigmoid of infinity)."""
    return (np.array(outputs["enc_outputs"]["pred_boxes"]) == 1).all(-1).sum(1)


def assert_unambiguous_ranking(outputs):
    """The chosen proposals' best-class scores (best first) are equal (the padding's, all alike) or apart by more
    than 5e-6 of the largest: 5 times the runtimes' differences in them (about 1e-6)."""
    best = np.array(outputs["enc_outputs"]["pred_logits"]).max(-1)
    gaps = best[:, :-1] - best[:, 1:]
    assert ((gaps == 0) | (gaps > 5e-6 * np.abs(best).max())).all(), f"near ties: {gaps[(gaps > 0)].min():.1e}"


def assert_same_predictions(ours, exported, what):
    for i in range(len(exported["logits"])):
        assert_close(ours["pred_logits"][i], exported["logits"][i], f"{what}: logits of image {i}")
        assert_close(ours["pred_boxes"][i], exported["pred_boxes"][i], f"{what}: boxes of image {i}")


@pytest.mark.parametrize(
    "variant,sampler", [(FOUR_SCALE, "gather"), (FIVE_SCALE, "gather"), (FOUR_SCALE, "grid_sample")]
)
def test_onnx_file_gives_our_logits_and_boxes(variant, sampler, runtime):
    model, cfg = small_model(variant)
    images, mask = padded_batch()
    graph = build_onnx(model, cfg, canvas=CANVAS, batch=len(SIZES), sampler=sampler)
    exported = runtime(graph, graph_inputs(images, mask))

    ours = model(mx.array(images), mx.array(mask))
    assert not padding_chosen(ours).any()  # the queries' boxes are the image's proposals, as a trained model's
    assert_unambiguous_ranking(ours)
    assert_same_predictions(ours, exported, variant)


def test_detrexs_dino_heads_per_layer_and_the_authors_encoding(runtime):
    """detrex's DINO (converted: weights/dino.py): a class and a box head per decoder layer, each refining its layer's
    boxes, and the authors' position encoding (half-pixel offset, temperature 10000)."""
    detrex = ("model.decoder_heads=per_layer", "model.position_offset=0.5", "model.position_temperature=10000")
    model, cfg = small_model(FOUR_SCALE, extra=detrex)
    assert len(model.bbox_embed) == cfg.model.dec_layers > 1
    images, mask = padded_batch()
    graph = build_onnx(model, cfg, canvas=CANVAS, batch=len(SIZES), sampler="gather")
    exported = runtime(graph, graph_inputs(images, mask))
    ours = model(mx.array(images), mx.array(mask))
    assert_unambiguous_ranking(ours)
    assert_same_predictions(ours, exported, "heads per layer")


def test_padding_proposals_chosen_give_our_logits_and_boxes(runtime):
    """The padding's proposals ranked first (their memory zeroed, their boxes infinite in logit space): DINO's
    queries at boxes of 1, inverse_sigmoid at its eps 1e-3."""
    model, cfg = small_model(FOUR_SCALE)
    params = dict(tree_flatten(model.parameters()))
    row = np.array(params["transformer.enc_output_norm.weight"]) * ranking_row(cfg.model, params)
    model.load_weights([("transformer.enc_output.bias", mx.array(row / np.linalg.norm(row)))], strict=False)
    images, mask = padded_batch()
    exported = runtime(build_onnx(model, cfg, canvas=CANVAS, batch=len(SIZES)), graph_inputs(images, mask))

    ours = model(mx.array(images), mx.array(mask))
    assert (padding_chosen(ours) == cfg.model.num_queries).all()
    assert_same_predictions(ours, exported, "padding's proposals")


@pytest.fixture(scope="module")
def r50_sized():
    """A DINO of R50's sizes at 5 levels (random init, the parameters initialised to zero moved off it: the box
    heads' last layers, the attention's offsets and weights, biases) and a batch of 2 on a 128 x 160 canvas."""
    cfg = load_config(CONFIGS_DIR / f"{FIVE_SCALE}.yaml", R50_SIZES)
    mx.random.seed(0)
    model = build_model(cfg)
    model.eval()
    rng = np.random.default_rng(0)
    zeros = [(k, v) for k, v in tree_flatten(model.parameters()) if not np.array(v).any()]
    model.load_weights([(k, mx.array(rng.normal(0, 0.02, v.shape).astype(np.float32))) for k, v in zeros], strict=False)
    canvas, sizes = (128, 160), ((120, 150), (70, 90))
    images, mask = np.zeros((2, *canvas, 3), np.float32), np.ones((2, *canvas), bool)
    for i, (h, w) in enumerate(sizes):
        images[i, :h, :w] = np.random.default_rng(i).standard_normal((h, w, 3))
        mask[i, :h, :w] = False
    return model, cfg, images, mask


def test_r50_sized_five_scale_onnx_file_gives_our_logits_and_boxes(r50_sized, runtime):
    model, cfg, images, mask = r50_sized
    graph = build_onnx(model, cfg, canvas=images.shape[1:3], batch=len(images))
    exported = runtime(graph, graph_inputs(images, mask))

    ours = model(mx.array(images), mx.array(mask))
    assert cfg.model.num_feature_levels == 5 and cfg.model.backbone_maps == 4
    assert_unambiguous_ranking(ours)
    assert_same_predictions(ours, exported, "R50 sizes, 5 levels")


@pytest.fixture(scope="module")
def many_queries():
    """A small 5-scale DINO of 90 queries, and three photos on the canvas with their sizes."""
    model, cfg = small_model(FIVE_SCALE, extra=MANY_QUERIES)
    rng = np.random.default_rng(2)
    photos = [Image.fromarray(rng.integers(0, 256, (h * 3, w * 3, 3), np.uint8)) for h, w in SIZES]
    target_sizes = np.array([[p.height, p.width] for p in photos], np.int64)
    return model, cfg, {**canvas_inputs(photos, CANVAS, size=64, max_size=100), "target_sizes": target_sizes}


def assert_top_300(model, inputs: dict, detections: tuple):
    """A post-processed file's (scores, labels, boxes) against post_process's top 300 of our outputs."""
    images = mx.array(inputs["pixel_values"].transpose(0, 2, 3, 1))
    outputs = model(images, mx.array(inputs["pixel_mask"] == 0))
    assert_unambiguous_ranking(outputs)
    ours = post_process(outputs, inputs["target_sizes"].tolist(), top_k=300)
    scores, labels, boxes = detections
    assert scores.shape == (3, 300) and boxes.shape == (3, 300, 4) and labels.dtype == np.int64
    for i, detected in enumerate(ours):
        assert_close(detected["scores"], scores[i], f"scores of image {i}")
        np.testing.assert_array_equal(np.array(detected["labels"]), labels[i])
        assert_close(detected["boxes"], boxes[i], f"boxes in pixels of image {i}")


def test_postprocessed_onnx_file_keeps_dinos_300_detections(many_queries, runtime):
    model, cfg, inputs = many_queries
    assert cfg.evaluation.top_k == 300  # DINO's configs: its num_select
    graph = build_onnx(model, cfg, canvas=CANVAS, batch=3, postprocess=True, top_k=cfg.evaluation.top_k)
    exported = runtime(graph, inputs)

    assert_top_300(model, inputs, tuple(exported[name] for name in ("scores", "labels", "boxes")))


def test_postprocessed_mlxfn_file_keeps_dinos_300_detections(many_queries, tmp_path):
    model, cfg, inputs = many_queries
    summary = export_mlx(model, cfg, tmp_path / "model.mlxfn", size=CANVAS, batch_size=3, postprocess=True)
    assert summary.endswith("; it keeps an image's best 300 (query, class) pairs (evaluation.top_k 300)")

    assert_top_300(model, inputs, tuple(in_plain_mlx(tmp_path / "model.mlxfn", inputs, tmp_path)))


def test_graph_has_standard_ops_static_shapes_and_ranks_at_most_5():
    model, cfg = small_model(FIVE_SCALE)
    graph = build_onnx(model, cfg, canvas=CANVAS, batch=2, postprocess=True, top_k=cfg.evaluation.top_k)
    onnx = pytest.importorskip("onnx", reason="the onnx package (the onnx and dev extras)")
    graph = onnx.shape_inference.infer_shapes(graph, strict_mode=True)
    assert [(o.domain, o.version) for o in graph.opset_import] == [("", 17)]
    assert {node.domain for node in graph.graph.node} == {""}
    values = [*graph.graph.input, *graph.graph.value_info, *graph.graph.output]
    shapes = {
        v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim] for v in values
    }
    shapes.update({t.name: list(t.dims) for t in graph.graph.initializer})
    produced = {name for node in graph.graph.node for name in node.output}
    assert produced <= set(shapes), sorted(produced - set(shapes))[:5]  # every tensor's shape is known
    assert all(None not in shape and 0 not in shape for shape in shapes.values())
    assert max(len(shape) for shape in shapes.values()) == 5
    assert shapes["boxes"] == [2, 60, 4]  # every (query, class) pair: 12 x 5, fewer than 300
    assert graph.doc_string.startswith("DINO (resnet18, two-stage, 5 levels)")


@pytest.mark.parametrize("variant", DINO_VARIANTS)
def test_mlxfn_file_gives_our_logits_and_boxes(variant, tmp_path):
    model, cfg = small_model(variant)
    path = tmp_path / "model.mlxfn"
    summary = export_mlx(model, cfg, path, size=CANVAS, batch_size=len(SIZES))
    assert summary.startswith(f"wrote {path}: ") and "canvas 96 x 128, batch 3" in summary
    images, mask = padded_batch()
    logits, boxes = in_plain_mlx(path, graph_inputs(images, mask), tmp_path)

    ours = model(mx.array(images), mx.array(mask))
    assert_same_predictions(ours, {"logits": logits, "pred_boxes": boxes}, variant)


@pytest.mark.parametrize("to,suffix", [("onnx", "onnx"), ("mlx", "mlxfn")])
def test_command_exports_a_dino_checkpoint_and_says_what_it_keeps(to, suffix, tmp_path, capsys):
    if to == "onnx":
        pytest.importorskip("onnxruntime", reason="the export's check needs onnxruntime (the onnx and dev extras)")
    path, _ = small_checkpoint(tmp_path, FIVE_SCALE, extra=MANY_QUERIES)
    out = tmp_path / f"model.{suffix}"
    main(["--to", to, "--checkpoint", str(path), str(out), "--size", "96", "128", "--postprocess"])
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"wrote {out}: ") and "canvas 96 x 128, batch 1" in line and "within" in line
    assert line.endswith("; it keeps an image's best 300 (query, class) pairs (evaluation.top_k 300)")


def test_the_check_leaves_out_queries_whose_proposals_near_tie_at_another_box():
    """The authors' enc_outputs rank every proposal (the next after the chosen seen), DINO's the chosen only (its
    last query's next unseen); proposals at one box (the padding's) swap harmlessly."""
    scores = np.array([[5.0, 3.0, 3.0 - 4e-3, 1.0, 1.0, 0.5]])  # 4e-3 apart: within 1e-3 of the largest (5)
    boxes = np.array([[[0.1] * 4, [0.2] * 4, [0.3] * 4, [1.0] * 4, [1.0] * 4, [0.4] * 4]])
    outputs = {
        "pred_logits": mx.zeros((1, 4, 2)),
        "enc_outputs": {"pred_logits": mx.array(np.stack([scores, scores - 1], -1)), "pred_boxes": mx.array(boxes)},
    }
    authors = SimpleNamespace(transformer=DeformableTransformer)
    np.testing.assert_array_equal(swappable_queries(authors, outputs), [[False, True, True, False]])
    outputs["enc_outputs"] = {key: value[:, :4] for key, value in outputs["enc_outputs"].items()}  # DINO's: chosen
    dino = SimpleNamespace(transformer=DINOTransformer)
    np.testing.assert_array_equal(swappable_queries(dino, outputs), [[False, True, True, True]])
    del outputs["enc_outputs"]  # single stage
    assert not swappable_queries(authors, outputs).any()


def test_the_check_matches_detections_by_what_they_are_not_their_rank():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (1, 4, 3)).astype(np.float32)
    logits[0, 2] = logits[0, 1] + 1e-5  # query 2 a near duplicate of query 1: its scores and box within 1e-3
    boxes = rng.uniform(0.2, 0.6, (1, 4, 4)).astype(np.float32)
    boxes[0, 2] = boxes[0, 1] + 1e-5
    ours = {"pred_logits": mx.array(logits), "pred_boxes": mx.array(boxes)}
    every_pair = post_process(ours, [[100, 200]], 12)[0]
    detections = {key: np.array(value)[None, :6] for key, value in every_pair.items()}
    clear = np.zeros(4, bool)
    assert detection_difference(every_pair, detections, 0, clear) == (0.0, 6)
    shuffled = {key: value[:, [1, 0, 3, 2, 5, 4]] for key, value in detections.items()}  # ranks swapped
    assert detection_difference(every_pair, shuffled, 0, clear) == (0.0, 6)
    for wrong in ("labels", "boxes", "scores"):  # a detection changed: it and the pair it was are unexplained
        changed = {key: value.copy() for key, value in detections.items()}
        changed[wrong][0, 1] = (changed[wrong][0, 1] + 1) % 3 if wrong == "labels" else changed[wrong][0, 1] * 1.01
        assert detection_difference(every_pair, changed, 0, clear)[0] == float("inf"), wrong
        query = int(detections["queries"][0, 1])  # unless its query's proposal may have been another
        worst, matched = detection_difference(every_pair, changed, 0, np.arange(4) == query)
        assert worst <= TOLERANCE and matched == 6 - (detections["queries"][0] == query).sum()


def test_export_check_of_an_r50_sized_dino_of_900_queries():
    """DINO's 900 best of 91 classes' scores on random images and untrained weights: near ties, which onnxruntime's
    float32 rounding ranks otherwise (onnxruntime 1.32: 2 queries of 900 swapped, off by 0.69 of the largest
    value); the check compares the rest."""
    ort = pytest.importorskip("onnxruntime", reason="running the file needs onnxruntime (the onnx and dev extras)")
    cfg = load_config(CONFIGS_DIR / f"{FIVE_SCALE}.yaml")
    mx.random.seed(0)
    model = build_model(cfg)
    model.eval()
    rng = np.random.default_rng(0)
    zeros = [(k, v) for k, v in tree_flatten(model.parameters()) if not np.array(v).any()]
    model.load_weights([(k, mx.array(rng.normal(0, 0.02, v.shape).astype(np.float32))) for k, v in zeros], strict=False)
    session = ort.InferenceSession(build_onnx(model, cfg, canvas=(128, 160)).SerializeToString())
    worst, compared = differences(model, (128, 160), 1, False, lambda inputs: session.run(None, inputs))
    assert worst <= TOLERANCE and compared.startswith("logits and boxes of ")
    assert int(compared.split()[4]) > 600 and compared.split()[6] == "900"
