"""The batching rule (issue 48): a batch never changes an answer. `Detector.predict` and the predict
command put only images of one resized size in a forward, so each image's results in a batch are those
it has alone; the old padded batch of mixed sizes gave other scores."""

import json

from deformable_detr import Detector
from deformable_detr.data.loader import collate
from deformable_detr.data.transforms import normalize, resize
from deformable_detr.inference.inputs import WAITING_BATCHES, grouped, opened_batches
from deformable_detr.models import post_process
from deformable_detr.predict import main as predict_main

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image
from test_evaluate import trained  # noqa: F401  (the fixture: a tiny model trained a few epochs)

# (width, height) of the copies, in turn: three resized sizes, (64, 64), (48, 64) and (51, 63) at the
# tiny config's val_size 64 and max_size 64
SIZES = [(64, 64), (96, 72), (80, 64)]
# One image's small matrix products round differently in the CPU BLAS from a batch's (the 1x1 input
# projection of the 4 x 4 level: 16 rows alone, 32 and more in a batch): measured at most 5e-7 in score
# and 5e-5 pixels in a box; the mixed padded batch differs by about 1e-2 in score.
SCORE_ROUNDING, BOX_ROUNDING = 2e-6, 2e-4


@pytest.fixture(scope="module")
def detector(trained):  # noqa: F811
    _, output = trained
    return Detector.load(output / "checkpoint.safetensors", precision="float32")


@pytest.fixture(scope="module")
def mixed(trained, tmp_path_factory):  # noqa: F811
    """A folder of 7 images, their sizes taking turns (each size's images are different pictures)."""
    root, _ = trained
    folder = tmp_path_factory.mktemp("mixed")
    originals = sorted((root / "val2017").iterdir())
    for i in range(7):
        image = Image.open(originals[i % len(originals)]).convert("RGB")
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if i >= len(originals) else image
        image.resize(SIZES[i % len(SIZES)], Image.BILINEAR).save(folder / f"{i}.png")
    return folder


def assert_same_detections(found, alone):
    np.testing.assert_array_equal(found.labels, alone.labels)
    np.testing.assert_array_equal(found.queries, alone.queries)
    np.testing.assert_allclose(found.scores, alone.scores, rtol=0, atol=SCORE_ROUNDING)
    np.testing.assert_allclose(found.boxes, alone.boxes, rtol=0, atol=BOX_ROUNDING)


@pytest.mark.parametrize("batch_size", [2, 5])
def test_a_batch_of_mixed_sizes_gives_each_image_its_results_alone(detector, mixed, monkeypatch, batch_size):
    alone = detector.predict(mixed, threshold=0.0, batch_size=1)
    forwards = []  # the batch keys of each forward's images
    forward = detector._forward
    monkeypatch.setattr(
        detector,
        "_forward",
        lambda images, *rest: forwards.append([detector.batch_key(i) for i in images]) or forward(images, *rest),
    )
    batched = detector.predict(mixed, threshold=0.0, batch_size=batch_size)
    assert [r.path.name for r in batched] == [f"{i}.png" for i in range(7)]  # input order
    assert all(len(set(keys)) == 1 and len(keys) <= batch_size for keys in forwards)
    assert sorted(len(keys) for keys in forwards) == ([1, 2, 2, 2] if batch_size == 2 else [2, 2, 3])
    for found, reference in zip(batched, alone, strict=True):
        assert len(found) == 100  # threshold 0: all of the top 100
        assert_same_detections(found, reference)


def test_the_padded_batch_of_mixed_sizes_changed_the_scores(detector, mixed):
    """What `detect` did before the rule: one forward, each image padded to the largest of the batch."""
    images = [Image.open(path).convert("RGB") for path in sorted(mixed.iterdir())]
    empty = {"boxes": np.zeros((0, 4), np.float32), "labels": np.zeros(0, np.int64)}
    data = detector.cfg.data
    pixels, mask, _ = collate([normalize(*resize(image, empty, data.val_size, data.max_size)) for image in images])
    assert mask.any()  # some images padded
    padded = post_process(detector.model(mx.array(pixels), mx.array(mask)), [[i.height, i.width] for i in images])
    alone = [detector.detect([image])[0] for image in images]
    differences = [np.abs(np.array(p["scores"]) - a["scores"]).max() for p, a in zip(padded, alone, strict=True)]
    assert max(differences) > 100 * SCORE_ROUNDING
    # the rule's detect on the same list: one forward per size, each image as alone
    for found, reference in zip(detector.detect(images), alone, strict=True):
        np.testing.assert_allclose(found["scores"], reference["scores"], rtol=0, atol=SCORE_ROUNDING)


def test_the_predict_command_batches_as_predict(trained, detector, mixed, tmp_path):  # noqa: F811
    _, output = trained
    argv = [
        "--checkpoint",
        str(output / "checkpoint.safetensors"),
        "--output-dir",
        str(tmp_path),
        "--threshold",
        "0",
        "--precision",
        "float32",
    ]
    predict_main([*argv, "--batch-size", "5", str(mixed)])
    alone = detector.predict(mixed, threshold=0.0, batch_size=1)
    for reference in alone:
        written = json.loads((tmp_path / f"{reference.path.stem}.json").read_text())
        assert [record["label"] for record in written] == reference.labels.tolist()
        scores = np.array([record["score"] for record in written])
        np.testing.assert_allclose(scores, reference.scores, rtol=0, atol=SCORE_ROUNDING)
        np.testing.assert_allclose([r["box"] for r in written], reference.boxes, rtol=0, atol=BOX_ROUNDING)


def test_batch_key_is_the_size_the_model_sees(detector):
    for width, height in [*SIZES, (56, 48), (200, 30)]:
        image = Image.new("RGB", (width, height))
        resized, _ = resize(image, {"boxes": np.zeros((0, 4), np.float32)}, 64, 64)
        assert detector.batch_key(image) == detector.batch_key((width, height)) == (resized.height, resized.width)
    assert [detector.batch_key(Image.new("RGB", size)) for size in SIZES] == [(64, 64), (48, 64), (51, 63)]


def test_groups_keep_input_order_within_and_between():
    sizes = ["a", "b", "a", "c", "a", "b", "a"]
    # all at once (`detect`'s list: a batch as large as the list), one group per key in order of its first
    assert list(grouped(range(len(sizes)), sizes.__getitem__, len(sizes))) == [[0, 2, 4, 6], [1, 5], [3]]
    assert list(grouped([], str, 1)) == []


def test_opened_batches_by_key_leave_full_or_when_too_many_wait():
    def batches(keys, batch_size):
        sources = [(None, key) for key in keys]  # the "images" are their keys here
        return [
            [(order, image) for order, _, image in batch] for batch in opened_batches(sources, batch_size, None, str)
        ]

    assert batches("abab", 2) == [[(0, "a"), (2, "a")], [(1, "b"), (3, "b")]]
    assert batches("abca", 2) == [[(0, "a"), (3, "a")], [(1, "b")], [(2, "c")]]  # the rest, oldest first
    # past WAITING_BATCHES x batch_size waiting images, the group of the oldest leaves short
    keys = "abcdefghij"[: WAITING_BATCHES * 2 + 1]
    assert batches(keys, 2)[0] == [(0, "a")]
