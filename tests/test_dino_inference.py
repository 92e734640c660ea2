"""Every inference path with a DINO model (issue 74, item 7): a tiny DINO trained a few epochs on a generated shapes
set (its training checkpoint), and a small ResNet-50 DINO written in DINO's main.py layout, converted and predicted
from the command line. `Detector.load` builds DINO from the config the weights record; `predict` keeps the config's
`evaluation.top_k` (DINO's 300), as eval.py scores them; the attention view is DINO's sampling points, whose query
positions come from each layer's boxes (checked against a computation of them written here); sliced inference,
tracking and the server give what `predict` gives."""

import json

from deformable_detr import Detector
from deformable_detr.data.shapes import CATEGORIES, generate
from deformable_detr.data.shapes_video import make_video
from deformable_detr.deploy.inputs import model_pixels
from deformable_detr.inference import slicing
from deformable_detr.inference.attention_points import in_pixels, recording
from deformable_detr.models.dino import DINO, DINODecoder
from deformable_detr.predict import main as predict_main

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image
from test_evaluate import coco_stats
from test_train import TINY

import eval as eval_script
import train

TOP_K = 150  # of 30 queries x 6 classes: more than the authors' 100, fewer than the 180 pairs
DINO_TINY = [
    *("model.architecture=dino", "model.two_stage=true", "model.with_box_refine=true", "model.mixed_selection=true"),
    *("model.look_forward_twice=true", "model.position_temperature=20", "model.dn_number=10"),
    *("model.num_queries=30", "model.dropout=0.0", f"evaluation.top_k={TOP_K}"),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """tests/fixtures/tiny.yaml as DINO (dn_number 10: up to 20 denoising queries a step), trained 3 epochs on 16
    generated 64 x 64 images, 7 s here (AP50 above zero): (the set's root, the training checkpoint)."""
    root = generate(tmp_path_factory.mktemp("shapes"), 16, 6, seed=11, height=(64, 64), width=(64, 64), max_size=40)
    output = tmp_path_factory.mktemp("dino_run")
    train.main(
        ["--config", str(TINY), "--output-dir", str(output), f"data.path={root}", "schedule.epochs=3", *DINO_TINY]
    )
    return root, output / "checkpoint.safetensors"


@pytest.fixture(scope="module")
def detector(trained):
    return Detector.load(trained[1], precision="float32")


def val_image(root, index: int = 0) -> Image.Image:
    return Image.open(sorted((root / "val2017").iterdir())[index]).convert("RGB")


def test_the_checkpoint_is_dinos_and_predict_keeps_the_configs_top_k(trained, detector):
    """The config the checkpoint records builds DINO; `predict` at threshold 0 gives the best TOP_K (query, class)
    pairs by sigmoid score of the last layer's logits, computed here from the model's outputs, and a threshold
    keeps those at or above it."""
    root, _ = trained
    assert isinstance(detector.model, DINO) and detector.cfg.model.architecture == "dino"
    assert detector.class_names == dict(enumerate(CATEGORIES, 1))  # the training set's, recorded
    image = val_image(root)
    [result] = detector.predict(image, threshold=0.0)
    assert len(result) == TOP_K

    pixels = model_pixels(image, detector.batch_key(image))
    outputs = detector.model(mx.array(pixels[None]), mx.zeros(pixels.shape[:2], mx.bool_)[None])
    logits, boxes = np.array(outputs["pred_logits"][0]), np.array(outputs["pred_boxes"][0])
    assert logits.shape == (30, 6)
    scores = 1 / (1 + np.exp(-logits.reshape(-1)))
    best = np.argsort(-scores, kind="stable")[:TOP_K]
    queries, labels = best // 6, best % 6
    centre, extent = boxes[queries, :2], boxes[queries, 2:]
    corners = np.concatenate([centre - extent / 2, centre + extent / 2], 1) * np.float32([64, 64, 64, 64])
    np.testing.assert_array_equal(result.queries, queries)
    np.testing.assert_array_equal(result.labels, labels)
    np.testing.assert_allclose(result.scores, scores[best], rtol=1e-6, atol=0)
    np.testing.assert_allclose(result.boxes, corners, rtol=0, atol=1e-4)
    assert result.names == [detector.class_names.get(int(label), str(label)) for label in labels]

    threshold = float(np.median(result.scores))
    [kept] = detector.predict(image, threshold=threshold)
    assert 0 < len(kept) < TOP_K and (kept.scores >= threshold).all()
    np.testing.assert_array_equal(kept.queries, result.queries[: len(kept)])


def sine(boxes: np.ndarray, num_feats: int) -> np.ndarray:
    """DINO's gen_sineembed_for_position (models/dino/utils.py) of (..., 4) boxes cx, cy, w, h: each coordinate
    times 2 pi over 10000 ** (2 floor(i / 2) / num_feats), sines of the even i and cosines of the odd interleaved,
    in the order y, x, w, h."""
    dim_t = 10000.0 ** (2 * (np.arange(num_feats) // 2) / num_feats)
    parts = []
    for coordinate in (1, 0, 2, 3):
        angles = boxes[..., coordinate, None] * 2 * np.pi / dim_t
        parts.append(np.stack([np.sin(angles[..., 0::2]), np.cos(angles[..., 1::2])], -1).reshape(angles.shape))
    return np.concatenate(parts, -1).astype(np.float32)


def sampling_points(model, images, mask, index: int, monkeypatch) -> dict:
    """Decoder layer `index`'s sampling points in each image's frame (fractions of the unpadded image) by DINO's
    arithmetic, from the decoder's inputs (the proposals' boxes, the learned contents, the memory): at every layer the
    query positions are `ref_point_head` of the sine embedding of the layer's boxes at the first level's valid
    ratio, the next layer's boxes are the box head's refinement of the layer's output (inverse sigmoid, eps 1e-3);
    the layer's cross-attention looks from its self-attention's output plus the position, at the box centre plus
    offset / points x half its size on each level. -> {"points" (B, Q, heads, levels, points, 2), "weights",
    "box" (B, Q, 4) cx, cy, w, h}."""
    captured = {}
    decoding = DINODecoder.__call__

    def capture(self, *args):
        captured["inputs"] = args
        return decoding(self, *args)

    monkeypatch.setattr(DINODecoder, "__call__", capture)
    model(mx.array(images), mx.array(mask))
    monkeypatch.setattr(DINODecoder, "__call__", decoding)
    tgt, boxes, memory, shapes, valid_ratios, padding_mask, box_heads, plan = captured["inputs"]
    decoder, boxes = model.transformer.decoder, np.array(boxes)
    ratios = np.concatenate([np.array(valid_ratios)] * 2, -1)[:, None]  # (B, 1, levels, 4): x, y, w, h
    for i, layer in enumerate(decoder.layers[: index + 1]):
        levels = boxes[:, :, None] * ratios  # (B, Q, levels, 4)
        position = decoder.ref_point_head(mx.array(sine(levels[:, :, 0], tgt.shape[-1] // 2)))
        if i == index:
            break
        tgt = layer(tgt, position, mx.array(levels), memory, shapes, padding_mask, plan)
        delta = np.array(box_heads[i if len(box_heads) > 1 else 0](tgt))  # DINO's one shared head, or detrex's
        clipped = np.clip(boxes, 0, 1)
        logit = np.log(np.maximum(clipped, 1e-3) / np.maximum(1 - clipped, 1e-3))
        boxes = 1 / (1 + np.exp(-(delta + logit)))
    attended = tgt + position
    query = layer.norm2(tgt + layer.self_attn(attended, attended, tgt)) + position
    attention = layer.cross_attn
    heads, n_levels, n_points = attention.n_heads, attention.n_levels, attention.n_points
    b, q = boxes.shape[:2]
    offsets = np.array(attention.sampling_offsets(query)).reshape(b, q, heads, n_levels, n_points, 2)
    logits = np.array(attention.attention_weights(query)).reshape(b, q, heads, n_levels * n_points)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights = (weights / weights.sum(-1, keepdims=True)).reshape(b, q, heads, n_levels, n_points)
    centre, size = levels[:, :, None, :, None, :2], levels[:, :, None, :, None, 2:]
    locations = centre + offsets / n_points * size * 0.5  # fractions of each level's padded map
    points = locations / ratios[:, :, None, :, None, :2]
    return {"points": points, "weights": weights, "box": boxes}


def test_the_attention_view_is_dinos_sampling_points(trained, detector, monkeypatch):
    """`predict(attention=True)` and in_pixels of a padded batch give, for each decoder layer, the sampling points,
    weights and reference box that `sampling_points` computes from DINO's arithmetic (its query positions from each
    layer's boxes), in the images' pixels; padding (valid ratios under 1) moves none of them."""
    root, _ = trained
    model = detector.model
    sizes = [(64, 64), (48, 64)]  # (height, width): the second padded below
    images, mask = np.zeros((2, 64, 64, 3), np.float32), np.ones((2, 64, 64), bool)
    for i, (h, w) in enumerate(sizes):
        image = val_image(root, i).resize((w, h))
        images[i, :h, :w] = model_pixels(image, (h, w))
        mask[i, :h, :w] = False
    for layer in range(detector.cfg.model.dec_layers):
        expected = sampling_points(model, images, mask, layer, monkeypatch)
        with recording(model, layer) as recorders:
            model(mx.array(images), mx.array(mask))
        [call] = recorders["decoder"].calls
        assert np.array(call.locations).shape == (2, 30, 4, 4, 2, 2)
        for i, (h, w) in enumerate(sizes):
            seen = in_pixels(call, i, w, h)
            scale = np.float32([w, h])
            # measured: 1.5e-5 px and 6e-8 apart (float32 of one arithmetic in two orders); the view without the
            # valid ratios (its points in the padded frame) is 18 px off
            np.testing.assert_allclose(seen["points"], expected["points"][i] * scale, rtol=0, atol=1e-4)
            np.testing.assert_allclose(seen["weights"], expected["weights"][i], rtol=0, atol=1e-6)
            centre, extent = expected["box"][i, :, :2] * scale, expected["box"][i, :, 2:] * scale
            corners = np.concatenate([centre - extent / 2, centre + extent / 2], 1)
            np.testing.assert_allclose(seen["reference"], centre, rtol=0, atol=1e-4)
            np.testing.assert_allclose(seen["box"], corners, rtol=0, atol=1e-4)

    image = val_image(root, 2)
    [shown] = detector.predict(image, threshold=0.2, attention=True, attention_layer=0)
    assert len(shown) > 0
    pixels = model_pixels(image, detector.batch_key(image))
    expected = sampling_points(model, pixels[None], np.zeros((1, 64, 64), bool), 0, monkeypatch)
    np.testing.assert_allclose(shown.attention["points"], expected["points"][0, shown.queries] * 64, rtol=0, atol=1e-4)
    np.testing.assert_allclose(shown.attention["weights"], expected["weights"][0, shown.queries], rtol=0, atol=1e-6)


def test_sliced_inference_gives_each_slices_own_detections(trained, detector):
    """A 2 x 2 canvas of val images sliced at one image's size: each slice's detections are that image's own
    (its TOP_K), moved by its offset; merged, a per-class suppression of them (test_slicing's checks)."""
    pytest.importorskip("supervision", reason="the slice extra (supervision) is not installed")
    from test_slicing import assert_same, best_first, suppressed

    root, _ = trained
    canvas, moved = Image.new("RGB", (128, 128)), []
    for k, (left, top) in enumerate([(0, 0), (64, 0), (0, 64), (64, 64)]):  # rows, then columns
        image = val_image(root, k)
        canvas.paste(image, (left, top))
        [alone] = detector.predict(image, threshold=0.0)
        boxes = np.clip(alone.boxes, 0, 64) + np.float32([left, top, left, top])
        moved.append({"boxes": boxes} | {key: getattr(alone, key) for key in ("scores", "labels", "queries")})
    expected = best_first(moved)
    assert len(expected["scores"]) == 4 * TOP_K
    unmerged = slicing.sliced_detect(detector, canvas, (64, 64), 0.0, 0.0, merge={"filter": "none"})
    assert_same(unmerged, expected)
    [merged] = detector.predict(canvas, threshold=0.0, slice=(64, 64), overlap=0)
    assert 0 < len(merged) < 4 * TOP_K
    assert_same(merged, suppressed(expected))


def test_tracking_gives_predicts_detections_their_identities(detector):
    """`track` with SORT on a short synthetic video: each frame's detections are `predict`'s at the threshold, in
    its order, each with an id; some ids last through most of the frames."""
    pytest.importorskip("trackers", reason="tracking needs Roboflow's trackers (the track extra, in dev)")
    frames = make_video(seed=1, frames=8, size=(96, 72)).frames
    threshold = 0.15  # the briefly trained model's objects score 0.15-0.3
    tracked = list(detector.track(frames, "sort", threshold=threshold, frame_rate=25))
    assert len(tracked) == 8
    for frame, result in zip(frames, tracked, strict=True):
        [alone] = detector.predict(frame, threshold=threshold)
        for key in ("queries", "labels", "scores", "boxes"):
            np.testing.assert_array_equal(getattr(result, key), getattr(alone, key))
        assert result.track_ids.shape == (len(result),)
    ids = [set(result.track_ids[result.track_ids >= 0].tolist()) for result in tracked]
    lasting = [i for i in set().union(*ids) if sum(i in frame for frame in ids) >= 5]
    assert lasting, ids


def test_the_server_answers_with_predicts_json(trained, detector):
    """`python -m deformable_detr.serve` of the DINO checkpoint on loopback: an image's answer, with attention, is
    `predict`'s JSON; /v1/model names its architecture, classes, decoder layers and top_k."""
    pytest.importorskip("httpx", reason="httpx is not installed (the dev extra)")
    pytest.importorskip("starlette", reason="the serve extra (starlette, uvicorn, python-multipart) is not installed")
    import httpx
    from test_serve import detect, exits_0, start

    root, checkpoint = trained
    process, url = start(checkpoint, "--precision", "float32")
    try:
        image = sorted((root / "val2017").iterdir())[1]
        answer = detect(url, image.read_bytes(), threshold=0.1, attention=1)
        assert answer.status_code == 200, answer.text
        [expected] = detector.predict(image, threshold=0.1, attention=True, attention_layer=1)
        assert len(expected) > 0
        assert answer.json()["detections"] == json.loads(json.dumps(expected.to_json()))
        described = httpx.get(f"{url}/v1/model").json()
        assert (described["architecture"], described["decoder_layers"], described["top_k"]) == ("dino", 2, TOP_K)
        assert described["classes"] == {str(k): v for k, v in detector.class_names.items()}
    finally:
        process.terminate()
    exits_0(process)


def test_eval_scores_the_configs_top_k_with_cocos_ap(trained, tmp_path):
    """eval.py of the DINO checkpoint on the set's val split: TOP_K detections an image, and the 12 numbers those of
    pycocotools on the detections it wrote (the model finds something: not a comparison of zeros)."""
    root, checkpoint = trained
    argv = ["--checkpoint", str(checkpoint), "--data-path", str(root), "--output-dir", str(tmp_path)]
    stats = eval_script.main(argv)
    detections = json.loads((tmp_path / "detections_val.json").read_text())
    assert len(detections) == 6 * TOP_K
    from pycocotools.coco import COCO

    reference = coco_stats(COCO(str(root / "annotations" / "instances_val2017.json")), detections, verbose=False)
    assert [stats[k] for k in reference if k != "per_class"] == [v for k, v in reference.items() if k != "per_class"]
    assert stats["AP50"] > 0


def test_training_starts_from_a_dino_checkpoint(trained, tmp_path):
    """train.py --weights of the DINO checkpoint starts from every one of its tensors; --finetune on a set of two of
    its classes (cross, circle: ids 1, 2; the checkpoint's 5 and 2) carries their rows of each class head (the
    decoder's, the encoder's, label_enc's) by name. At learning rate 0 the checkpoint written is what training
    started from."""
    _, checkpoint = trained
    two = generate(tmp_path / "two", 8, 2, seed=3, categories=["cross", "circle"], height=(64, 64), width=(64, 64))
    still = ["optimizer.lr=0", "optimizer.lr_backbone=0", "schedule.epochs=1", "train.eval_every=0"]
    source = {
        k.removeprefix("model."): np.array(v) for k, v in mx.load(str(checkpoint)).items() if k.startswith("model.")
    }

    argv = ["--config", str(TINY), *DINO_TINY, *still]
    train.main([*argv, "--output-dir", str(tmp_path / "weights"), "--weights", str(checkpoint), f"data.path={two}"])
    started = mx.load(str(tmp_path / "weights" / "checkpoint.safetensors"))
    assert all(np.array_equal(np.array(started[f"model.{k}"]), v) for k, v in source.items())

    argv += ["model.num_classes=3", f"data.path={two}"]
    train.main([*argv, "--output-dir", str(tmp_path / "finetuned"), "--finetune", str(checkpoint)])
    tuned = {k: np.array(v) for k, v in mx.load(str(tmp_path / "finetuned" / "checkpoint.safetensors")).items()}
    for key in (
        "class_embed.0.weight",
        "class_embed.0.bias",
        "transformer.enc_out_class_embed.bias",
        "label_enc.weight",
    ):
        rows = tuned[f"model.{key}"]
        assert len(rows) == len(source[key]) - 3  # 3 outputs, was 6 (label_enc: a row more)
        np.testing.assert_array_equal(rows[[1, 2]], source[key][[5, 2]])
    np.testing.assert_array_equal(tuned["model.transformer.tgt_embed.weight"], source["transformer.tgt_embed.weight"])


def test_dinos_checkpoint_converted_then_predicted_from_the_command_line(tmp_path):
    """A small ResNet-50 DINO exported in DINO's main.py layout (model and args), converted (`convert`: the config
    configs/dino_r50_4scale_12ep.yaml with the checkpoint's sizes), then `predict --checkpoint --attention` on an
    image: its JSON (sampling points too) is `Detector.load(...).predict`'s, and those are the MLX model's own
    detections (the weights came back)."""
    pytest.importorskip("torch", reason="DINO's .pth needs PyTorch (the convert extra)")
    from deformable_detr import build_model, load_config
    from deformable_detr.convert import main as convert_main

    small = ["model.hidden_dim=64", "model.nheads=4", "model.enc_layers=1", "model.dec_layers=2"]
    small += ["model.dim_feedforward=64", "model.num_queries=20", "model.num_classes=6", "model.dn_number=10"]
    small += ["data.val_size=96", "data.max_size=128"]
    cfg = load_config("dino_r50_4scale_12ep", small)
    mx.random.seed(5)
    original = Detector(build_model(cfg), cfg, {})
    original.export("torch", tmp_path / "dino.pth")
    convert_main([str(tmp_path / "dino.pth"), str(tmp_path / "dino.safetensors")])

    image = tmp_path / "picture.png"
    Image.fromarray((np.random.default_rng(2).random((90, 120, 3)) * 255).astype(np.uint8)).save(image)
    sizes = ["data.val_size=96", "data.max_size=128"]  # the converted config's are COCO's (800, 1333)
    argv = ["--checkpoint", str(tmp_path / "dino.safetensors"), "--threshold", "0", "--precision", "float32"]
    predict_main([*argv, "--attention", "--output-dir", str(tmp_path / "out"), str(image), *sizes])
    written = json.loads((tmp_path / "out" / "picture.json").read_text())
    assert Image.open(tmp_path / "out" / "picture.attention.png").size > (0, 0)  # the sampling points drawn

    loaded = Detector.load(tmp_path / "dino.safetensors", overrides=sizes, precision="float32")
    assert isinstance(loaded.model, DINO) and loaded.cfg.evaluation.top_k == 300  # DINO's config: its num_select
    [result] = loaded.predict(image, threshold=0.0, attention=True)
    assert len(result) == 20 * 6  # every pair: fewer than DINO's 300
    assert written == json.loads(json.dumps(result.to_json()))
    [own] = original.predict(image, threshold=0.0)
    np.testing.assert_array_equal(result.queries, own.queries)
    np.testing.assert_array_equal(result.scores, own.scores)
