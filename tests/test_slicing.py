"""Sliced inference (deformable_detr/inference/slicing.py) with the tiny random model: a canvas made of
distinct images side by side, sliced at one image's size, gives each image's own detections moved by its
offset; overlapping slices give those of each slice's crop, moved and merged by a per-class greedy
non-max suppression written here; `predict --slice` and the server's `slice` give the API's JSON; bad
values are errors naming them; without supervision, one line names the extra."""

import json
import sys

from deformable_detr import Detector
from deformable_detr.data.shapes import make_image
from deformable_detr.errors import CommandError, UsageError, install_hint
from deformable_detr.inference import slicing
from deformable_detr.predict import main as predict_main

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image
from test_predict import TINY, tiny  # noqa: F401  (the fixture: the tiny config's random model)

pytest.importorskip("supervision", reason="the slice extra (supervision) is not installed")

TILE = 64  # the tiny config's val_size and max_size: a 64 x 64 image goes in as it is
COLUMNS, ROWS = 3, 2
TOLERANCE = {"score": 2e-6, "box": 2e-4}  # a batch's products round unlike one image's (tests/test_batching.py)


@pytest.fixture(scope="module")
def detector(tiny):  # noqa: F811
    _, tmp = tiny
    return Detector.load(tmp / "weights.safetensors", str(TINY), precision="float32")


@pytest.fixture(scope="module")
def wide(tiny):  # noqa: F811
    """The tiny model with its box head's bias moved (centre right and down, width and height x ~3): its
    boxes reach past the images' right and bottom edges, where slices clip them (the random model's stay
    near each image's centre)."""
    _, tmp = tiny
    weights = mx.load(str(tmp / "weights.safetensors"))
    weights["bbox_embed.0.layers.2.bias"] = weights["bbox_embed.0.layers.2.bias"] + mx.array([1.5, 1.0, 2.0, 2.0])
    mx.save_safetensors(str(tmp / "wide.safetensors"), weights)
    return Detector.load(tmp / "wide.safetensors", str(TINY), precision="float32")


@pytest.fixture(params=["random", "wide boxes"])
def model(request):
    return request.getfixturevalue({"random": "detector", "wide boxes": "wide"}[request.param])


@pytest.fixture(scope="module")
def canvas():
    """ROWS x COLUMNS distinct 64 x 64 shapes images side by side -> (the canvas, {(x, y) offset: image})."""
    parts = {}
    whole = Image.new("RGB", (COLUMNS * TILE, ROWS * TILE))
    for row in range(ROWS):
        for column in range(COLUMNS):
            image, _ = make_image(np.random.default_rng([7, row, column]), TILE, TILE, 4, 12, 40)
            parts[(column * TILE, row * TILE)] = image
            whole.paste(image, (column * TILE, row * TILE))
    return whole, parts


def union(detector, image: Image.Image, size: tuple, overlap: float, threshold: float) -> dict:
    """Each slice's crop (slicing.slice_boxes: supervision's layout, test_slice_boxes_are_supervisions)
    predicted alone (batch 1, no slicing), boxes clipped to the crop and moved by its offset, in the
    slices' order (rows, then columns), best first (a stable sort)."""
    found = {"boxes": [], "scores": [], "labels": [], "queries": []}
    for left, top, right, bottom in slicing.slice_boxes(image.size, size, overlap):
        crop = image.crop((left, top, right, bottom))
        [alone] = detector.predict(crop, threshold=threshold)
        limits = [crop.width, crop.height] * 2
        found["boxes"].append(np.clip(alone.boxes, 0, limits) + np.float32([left, top, left, top]))
        for key in ("scores", "labels", "queries"):
            found[key].append(getattr(alone, key))
    return best_first([{key: parts[i] for key, parts in found.items()} for i in range(len(found["scores"]))])


def iou(box, boxes):
    x0, y0 = np.maximum(box[0], boxes[:, 0]), np.maximum(box[1], boxes[:, 1])
    x1, y1 = np.minimum(box[2], boxes[:, 2]), np.minimum(box[3], boxes[:, 3])
    inter = np.clip(x1 - x0, 0, None) * np.clip(y1 - y0, 0, None)
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    return inter / np.maximum(area + areas - inter, 1e-12)


def suppressed(found: dict, threshold: float = 0.5) -> dict:
    """Greedy non-max suppression per class, best first: a box goes where one of its class kept before it
    overlaps it by an IoU above `threshold`."""
    keep = np.ones(len(found["scores"]), bool)
    boxes, labels = found["boxes"].astype(np.float64), found["labels"]
    for i in range(len(keep)):
        if keep[i]:
            later = np.arange(len(keep)) > i
            keep &= ~(later & (labels == labels[i]) & (iou(boxes[i], boxes) > threshold))
    return {key: value[keep] for key, value in found.items()}


def assert_same(got, expected: dict, exact: bool = True):
    """`got` (Detections, or a dict of arrays) holds `expected`'s detections in its order."""
    read = (lambda key: got[key]) if isinstance(got, dict) else (lambda key: getattr(got, key))
    for key in ("labels", "queries"):
        np.testing.assert_array_equal(read(key), expected[key])
    if exact:
        np.testing.assert_array_equal(read("scores"), expected["scores"])
        np.testing.assert_array_equal(read("boxes"), expected["boxes"])
    else:
        np.testing.assert_allclose(read("scores"), expected["scores"], atol=TOLERANCE["score"], rtol=0)
        np.testing.assert_allclose(read("boxes"), expected["boxes"], atol=TOLERANCE["box"], rtol=0)


def best_first(parts: list[dict]) -> dict:
    """Detections of several parts as one, best first (a stable sort: ties keep the parts' order)."""
    joined = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    best = np.argsort(-joined["scores"], kind="stable")
    return {key: value[best] for key, value in joined.items()}


def test_slices_of_one_images_size_give_each_images_own_detections_moved(model, canvas):
    detector, (whole, parts) = model, canvas
    # the reference from the parts themselves, not from the canvas: each image alone, moved by its offset
    moved, clipped = [], []
    for (left, top), image in parts.items():  # rows, then columns: the slices' order
        [alone] = detector.predict(image, threshold=0.0)
        clipped.append(np.any((alone.boxes < 0) | (alone.boxes > TILE)))
        boxes = np.clip(alone.boxes, 0, TILE) + np.float32([left, top, left, top])
        moved.append({"boxes": boxes} | {key: getattr(alone, key) for key in ("scores", "labels", "queries")})
    expected = best_first(moved)
    assert len(expected["scores"]) == ROWS * COLUMNS * 60  # the top 100 of 10 queries x 6 classes: all 60 a part
    assert all(clipped) == (detector.source.name == "wide.safetensors")  # the wide model's boxes are clipped
    unmerged = slicing.sliced_detect(detector, whole, (TILE, TILE), 0.0, 0.0, merge={"filter": "none"})
    assert_same(unmerged, expected)

    merged = detector.predict(whole, threshold=0.0, slice=(TILE, TILE), overlap=0)[0]
    reference = suppressed(expected)
    assert 0 < len(reference["scores"]) < len(expected["scores"])  # the merge had work to do
    assert_same(merged, reference)
    assert merged.image_size == whole.size and merged.names == [str(label) for label in merged.labels]
    # On the seams: every box is clipped to its slice, so boxes of two slices meet at most along a seam
    # (IoU 0) and the merge works within each slice: the same as suppressing each part's on their own.
    assert_same(merged, best_first([suppressed(part) for part in moved]))

    batched = detector.predict(whole, threshold=0.0, slice=(TILE, TILE), overlap=0, batch_size=4)[0]
    assert_same(batched, reference, exact=False)  # 6 slices: forwards of 4 and 2, each slice's answer alone


@pytest.mark.parametrize(
    "size, overlap",
    [((TILE, TILE), 0.25), ((48, 40), 0.5), ((50, 44), 0.39), ((50, 64), 0.0), ((512, 512), 0.2)],
    ids=["overlapping", "not square", "overlap rounded down", "cut short", "larger than the image"],
)
def test_overlapping_slices_are_each_crops_detections_merged(model, canvas, size, overlap):
    detector, (whole, _) = model, canvas
    expected = suppressed(union(detector, whole, size, overlap, 0.05))
    got = detector.predict(whole, threshold=0.05, slice=size, overlap=overlap, batch_size=3)[0]
    assert len(expected["scores"]) > 0
    assert_same(got, expected, exact=False)


def test_predict_slice_writes_the_apis_json(tiny, detector, canvas, tmp_path):  # noqa: F811
    argv, _ = tiny
    whole, _ = canvas
    whole.save(tmp_path / "canvas.png")
    out = tmp_path / "out"
    predict_main(
        [
            *argv,
            "--precision",
            "float32",
            "--output-dir",
            str(out),
            "--threshold",
            "0.05",
            "--slice",
            "64,64",
            "--overlap",
            "0.25",
            "--batch-size",
            "4",
            str(tmp_path / "canvas.png"),
        ]
    )
    [expected] = detector.predict(tmp_path / "canvas.png", threshold=0.05, slice=(64, 64), overlap=0.25, batch_size=4)
    assert len(expected) > 0
    assert json.loads((out / "canvas.json").read_text()) == json.loads(json.dumps(expected.to_json()))
    assert (out / "canvas.png").is_file()


@pytest.mark.parametrize(
    "size, overlap, words",
    [
        ((0, 64), 0.2, "slice 0,64: expected W,H"),
        ((-64, 64), 0.2, "slice -64,64: expected W,H"),
        ((64,), 0.2, "slice 64: expected W,H"),
        (64, 0.2, "slice 64: expected W,H"),
        ((64.5, 64), 0.2, "slice 64.5,64: expected W,H"),
        ((64, 64), 1.0, "overlap 1.0: expected a fraction of the slice from 0 up to (not including) 1"),
        ((64, 64), -0.1, "overlap -0.1: expected a fraction"),
        ((64, 64), float("nan"), "overlap nan: expected a fraction"),
    ],
)
def test_bad_values_are_errors_naming_them(detector, canvas, size, overlap, words):
    with pytest.raises(ValueError) as failed:
        detector.predict(canvas[0], slice=size, overlap=overlap)
    assert str(failed.value).startswith(words)
    with pytest.raises(UsageError, match="attention and encoder_pixel"):
        detector.predict(canvas[0], slice=(64, 64), attention=True)


@pytest.mark.parametrize(
    "options, words",
    [
        (["--slice", "0,64"], "--slice 0,64: expected W,H"),
        (["--slice", "64"], "--slice '64': expected W,H"),
        (["--slice", "64,x"], "--slice '64,x': expected W,H"),
        (["--slice", "64,64", "--overlap", "1"], "--overlap 1.0: expected a fraction"),
        (["--slice", "64,64", "--overlap", "2e-1"], "--overlap '2e-1': expected a decimal"),
        (["--overlap", "0.3"], "--overlap '0.3': the overlap of slices, with --slice W,H"),
        (["--slice", "64,64", "--attention"], "--attention and --encoder-pixel show one forward"),
    ],
)
def test_bad_command_line_values_are_one_line_usage_errors(tiny, canvas, tmp_path, capsys, options, words):  # noqa: F811
    argv, _ = tiny
    canvas[0].save(tmp_path / "canvas.png")
    with pytest.raises(SystemExit) as stopped:
        predict_main([*argv, "--output-dir", str(tmp_path / "out"), *options, str(tmp_path / "canvas.png")])
    assert stopped.value.code == 2
    said = capsys.readouterr().err.strip()
    assert said == f"error: {said.removeprefix('error: ')}" and "\n" not in said and words in said
    assert not (tmp_path / "out").exists()


def test_without_supervision_one_line_names_the_extra(tiny, detector, canvas, tmp_path, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setitem(sys.modules, "supervision", None)  # as if not installed
    hint = f'slicing needs supervision, in the "slice" extra: {install_hint("slice")}'
    with pytest.raises(CommandError) as stopped:
        detector.predict(canvas[0], slice=(64, 64))
    assert str(stopped.value) == hint
    argv, _ = tiny
    canvas[0].save(tmp_path / "canvas.png")
    with pytest.raises(SystemExit) as stopped:
        predict_main([*argv, "--output-dir", str(tmp_path / "out"), "--slice", "64,64", str(tmp_path / "canvas.png")])
    assert stopped.value.code == f"error: {hint}"
    detector.predict(canvas[0])  # without slices, nothing needs it


def test_the_servers_slice_and_overlap(tiny, detector, canvas, tmp_path):  # noqa: F811
    pytest.importorskip("starlette", reason="the serve extra (starlette, uvicorn, python-multipart) is not installed")
    httpx = pytest.importorskip("httpx", reason="httpx is not installed (the dev extra)")
    from test_serve import detect, start

    _, tmp = tiny
    whole, _ = canvas
    whole.save(tmp_path / "canvas.png")
    body = (tmp_path / "canvas.png").read_bytes()
    process, url = start(tmp / "weights.safetensors", "--config", str(TINY), "--precision", "float32")
    try:
        answer = detect(url, body, threshold=0.05, slice="64,64", overlap=0.25)
        assert answer.status_code == 200, answer.text
        [expected] = detector.predict(whole, threshold=0.05, slice=(64, 64), overlap=0.25, batch_size=8)
        assert len(expected) > 0
        assert answer.json()["detections"] == json.loads(json.dumps(expected.to_json()))
        default = detect(url, body, threshold=0.05, slice="64,64").json()["detections"]
        [expected] = detector.predict(whole, threshold=0.05, slice=(64, 64), batch_size=8)  # overlap 0.2
        assert default == json.loads(json.dumps(expected.to_json()))
        bad = {
            "slice 0,64": ({"slice": "0,64"}, "slice 0,64: expected W,H"),
            "slice not W,H": ({"slice": "64"}, "slice '64': expected W,H"),
            "slice words": ({"slice": "big"}, "slice 'big'"),
            "overlap 1": ({"slice": "64,64", "overlap": "1"}, "overlap 1.0: expected a fraction"),
            "overlap negative": ({"slice": "64,64", "overlap": "-0.1"}, "overlap '-0.1'"),
            "overlap alone": ({"overlap": "0.2"}, "overlap '0.2': the overlap of slices, with slice W,H"),
            "with attention": ({"slice": "64,64", "attention": "1"}, "slice: attention"),
            # a slice a pixel wide: tens of thousands of forwards, refused from the header before any work
            "too many slices": ({"slice": "1,1"}, f"slice 1,1 overlap 0.2: {whole.width * whole.height:,} slices"),
        }
        for case, (query, words) in bad.items():
            answer = detect(url, body, **query)
            assert answer.status_code == 400, case
            assert words in answer.json()["error"] and "\n" not in answer.json()["error"], case
        assert detect(url, body, slice="64,64").status_code == 200  # and it goes on
        assert httpx.get(f"{url}/healthz").status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.mark.parametrize("overlap", [0.0, 0.2, 0.5, 0.99])
def test_slice_boxes_are_supervisions(overlap):
    """Where the slices go (what the server bounds before any work, and this file's `union`): slice_boxes
    are supervision's InferenceSlicer's own layout (its `_generate_offset`), slice_count their number,
    for images smaller, equal and larger than a slice."""
    sv = pytest.importorskip("supervision", reason="supervision (the slice extra) is not installed")
    for image in [(1, 1), (63, 64), (64, 64), (65, 200), (300, 129), (3000, 2000)]:
        for size in [(1, 1), (64, 64), (100, 37)]:
            if slicing.slice_count(image, size, overlap) > 100_000:
                continue  # supervision's meshgrid of millions of slices (1 x 1, or a stride of 1 pixel): seconds
            laid_out = sv.InferenceSlicer._generate_offset(image, size, slicing.overlap_pixels(size, overlap))
            np.testing.assert_array_equal(np.int64(slicing.slice_boxes(image, size, overlap)), laid_out)
            assert slicing.slice_count(image, size, overlap) == len(laid_out), (image, size)
    assert slicing.slice_count((3000, 2000), (1, 1), 0.0) == 6_000_000


@pytest.mark.parametrize("names", [("--slice", "--overlap"), ("slice", "overlap")], ids=["command", "server"])
def test_one_parser_for_the_command_and_the_server(names):
    """slicing.parse_slice reads both (predict's --slice / --overlap, the server's slice / overlap): the
    values, and each refusal naming the caller's name."""
    size, overlap = names
    assert slicing.parse_slice("256,128", ".25", names) == ((256, 128), 0.25)
    assert slicing.parse_slice("64,64", None, names) == ((64, 64), slicing.OVERLAP)
    assert slicing.parse_slice(None, None, names) is None
    refused = {
        ("64", None): f"{size} '64': expected W,H",
        ("64,²", None): f"{size} '64,²': expected W,H",
        ("64,64,64", None): f"{size} '64,64,64': expected W,H",
        ("0,64", None): f"{size} 0,64: expected W,H",
        ("64,64", "1"): f"{overlap} 1.0: expected a fraction",
        ("64,64", "nan"): f"{overlap} 'nan': expected a decimal",
        ("64,64", "-0.1"): f"{overlap} '-0.1': expected a decimal",
        (None, "0.2"): f"{overlap} '0.2': the overlap of slices, with {size} W,H",
        ("9" * 50, None): f"{size} '{'9' * 40}'…: expected W,H",
    }
    for (text, fraction), words in refused.items():
        with pytest.raises(UsageError) as failed:
            slicing.parse_slice(text, fraction, names)
        assert str(failed.value).startswith(words), (text, fraction)


def test_the_small_shapes_tiles_are_the_canvas_cut_with_its_boxes_clipped():
    from deformable_detr.data.small_shapes import MIN_VISIBLE, cut_tiles, make_canvas

    image, objects = make_canvas(np.random.default_rng(3), (60, 80), size=(700, 500))
    assert 60 <= len(objects) <= 80 and all(10 + 1 <= o["bbox"][2] <= 30 + 1 for o in objects)
    tiles = cut_tiles(image, objects, (256, 200), origin=(30, 50))
    assert len(tiles) == 2 * 2  # whole tiles only: (700 - 30) // 256 across, (500 - 50) // 200 down
    pixels = np.asarray(image)
    partly, kept = {"kept": 0, "left out": 0}, 0
    for index, (tile, boxes) in enumerate(tiles):
        left, top = 30 + 256 * (index % 2), 50 + 200 * (index // 2)
        np.testing.assert_array_equal(np.asarray(tile), pixels[top : top + 200, left : left + 256])
        expected = []
        for o in objects:
            x, y, w, h = o["bbox"]
            x0, y0 = max(x - left, 0), max(y - top, 0)
            x1, y1 = min(x + w - left, 256), min(y + h - top, 200)
            visible = (x1 - x0) * (y1 - y0) if x1 > x0 and y1 > y0 else 0
            if 0 < visible < w * h:
                partly["kept" if visible >= MIN_VISIBLE * w * h else "left out"] += 1
            if visible >= MIN_VISIBLE * w * h:
                expected.append({"category_id": o["category_id"], "bbox": [x0, y0, x1 - x0, y1 - y0]})
        assert boxes == expected
        kept += len(boxes)
    assert kept > 0 and min(partly.values()) > 0  # objects on the tiles' edges, some mostly in, some mostly out
