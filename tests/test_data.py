"""COCO reading, the authors' augmentations, deterministic batching, bad files."""

import json

from deformable_detr import load_config
from deformable_detr.data import BadImageError, CocoDetection, DataLoader, build_dataset
from deformable_detr.data.shapes import generate
from deformable_detr.data.transforms import crop, hflip, resize, resized_shape

import numpy as np
import pytest
from PIL import Image


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("shapes"), 12, 4, seed=5)


def target(*boxes):
    return {"boxes": np.array(boxes, np.float32).reshape(-1, 4), "labels": np.arange(len(boxes), dtype=np.int64)}


def test_resized_shape_is_the_authors():
    # get_size_with_aspect_ratio: shorter side to size, unless the longer would pass max_size
    assert resized_shape(640, 480, 800, 1333) == (800, 1066)
    assert resized_shape(480, 640, 800, 1333) == (1066, 800)
    assert resized_shape(2000, 500, 800, 1333) == (333, 1332)  # size shrunk to round(1333 * 500 / 2000)
    assert resized_shape(600, 800, 600) == (800, 600)  # already there


def test_resize_scales_boxes():
    image, t = resize(Image.new("RGB", (200, 100)), target([10, 20, 50, 60]), 50)
    assert image.size == (100, 50)
    np.testing.assert_allclose(t["boxes"], [[5, 10, 25, 30]])


def test_hflip_mirrors_boxes():
    image, t = hflip(Image.new("RGB", (100, 40)), target([10, 5, 30, 25]))
    np.testing.assert_allclose(t["boxes"], [[70, 5, 90, 25]])


def test_crop_clips_and_drops_boxes():
    _, t = crop(
        Image.new("RGB", (100, 100)), target([10, 10, 40, 40], [70, 70, 90, 90], [45, 5, 60, 50]), 20, 30, 40, 40
    )
    # region rows 20..60, cols 30..70: box 1 clipped, box 2 gone, box 3 clipped
    np.testing.assert_allclose(t["boxes"], [[0, 0, 10, 20], [15, 0, 30, 30]])
    np.testing.assert_array_equal(t["labels"], [0, 2])


def test_coco_reading_drops_crowd_and_degenerate_boxes(tmp_path):
    (tmp_path / "train2017").mkdir()
    Image.new("RGB", (50, 40)).save(tmp_path / "train2017" / "a.png")
    annotations = [
        {"id": 1, "image_id": 1, "category_id": 3, "bbox": [5, 5, 10, 10], "iscrowd": 0, "area": 100},
        {"id": 2, "image_id": 1, "category_id": 4, "bbox": [5, 5, 10, 10], "iscrowd": 1, "area": 100},
        {"id": 3, "image_id": 1, "category_id": 5, "bbox": [20, 20, 0, 10], "iscrowd": 0, "area": 0},
        {"id": 4, "image_id": 1, "category_id": 6, "bbox": [45, 30, 20, 20], "iscrowd": 0, "area": 400},
    ]
    (tmp_path / "annotations").mkdir()
    (tmp_path / "annotations" / "instances_train2017.json").write_text(
        json.dumps(
            {
                "images": [{"id": 1, "file_name": "a.png", "height": 40, "width": 50}],
                "annotations": annotations,
                "categories": [{"id": i, "name": str(i)} for i in range(1, 7)],
            }
        )
    )
    _, t = CocoDetection(tmp_path, "train").load(0)
    np.testing.assert_array_equal(t["labels"], [3, 6])
    np.testing.assert_allclose(t["boxes"], [[5, 5, 15, 15], [45, 30, 50, 40]])  # the last clipped to the image


def micro_batches(loader, epoch, start=0):
    return [batch for step in loader.epoch(epoch, start) for batch in step]


def test_a_step_is_the_same_images_however_it_is_split():
    """Over processes (rank r takes the r-th share) and micro-batches, in order: the images of one
    process's step with no micro-batches."""
    whole = DataLoader(SlowDataset(), batch_size=8, seed=3)._steps(0)
    assert len(whole) == 3 and all(len(step) == 1 and len(step[0]) == 8 for step in whole)
    for world_size, micro in [(1, 4), (2, 4), (2, 1), (4, 2), (8, 1)]:
        ranks = [
            DataLoader(SlowDataset(), 8, seed=3, rank=r, world_size=world_size, micro_batch_size=micro)._steps(0)
            for r in range(world_size)
        ]
        for index, step in enumerate(whole):
            parts = [batch for rank in ranks for batch in rank[index]]
            assert all(len(batch) == micro for batch in parts)
            np.testing.assert_array_equal(np.concatenate(parts), step[0])
    with pytest.raises(ValueError, match="a batch of 8 does not split into 2 x 3"):
        DataLoader(SlowDataset(), 8, world_size=2, micro_batch_size=3)


def test_batches_are_deterministic_padded_and_normalised(shapes):
    cfg = load_config(
        None,
        [
            f"data.path={shapes}",
            "data.scales=[64, 96]",
            "data.max_size=128",
            "data.crop_resize=[96]",
            "data.crop_size=[48, 96]",
        ],
    )
    loader = DataLoader(build_dataset("train", cfg.data), batch_size=3, seed=7)
    first = micro_batches(loader, 0)
    again = micro_batches(loader, 0)
    other = micro_batches(loader, 1)
    assert len(first) == 4
    for (images, mask, targets), (images2, _, targets2) in zip(first, again, strict=True):
        np.testing.assert_array_equal(images, images2)
        assert [t["image_id"] for t in targets] == [t["image_id"] for t in targets2]
        for i, t in enumerate(targets):
            h, w = t["size"]
            assert not mask[i, :h, :w].any() and mask[i, h:].all() and mask[i, :, w:].all()
            assert (t["boxes"] > 0).all() and (t["boxes"] <= 1).all()  # cx, cy, w, h normalised
    assert [t["image_id"] for _, _, ts in first for t in ts] != [t["image_id"] for _, _, ts in other for t in ts]
    resumed = micro_batches(loader, 0, 2)
    np.testing.assert_array_equal(resumed[0][0], first[2][0])


def test_missing_image_names_its_path(shapes, tmp_path):
    import shutil

    root = tmp_path / "broken"
    shutil.copytree(shapes, root)
    (root / "train2017" / "000000000003.png").unlink()
    (root / "train2017" / "000000000005.png").write_bytes(b"not a png")
    cfg = load_config(None, [f"data.path={root}"])
    loader = DataLoader(build_dataset("train", cfg.data), batch_size=2, shuffle=False)
    with pytest.raises(BadImageError, match=r"000000000003\.png: image file not found \(image id 3\)"):
        micro_batches(loader, 0)
    skipping = load_config(None, [f"data.path={root}", "data.skip_bad_images=true"])
    loader = DataLoader(build_dataset("train", skipping.data), batch_size=2, shuffle=False)
    with pytest.warns(UserWarning) as warned:
        batches = micro_batches(loader, 0)
    messages = sorted(str(w.message) for w in warned)
    assert len(messages) == 2
    assert "000000000003.png: image file not found" in messages[0]
    assert "000000000005.png: cannot read image" in messages[1]
    assert len(loader.take_skipped()) == 2 and loader.take_skipped() == []  # taken once, for the log
    assert sum(len(targets) for _, _, targets in batches) == 10


def test_missing_dataset_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"COCO val split: .*val2017 does not exist"):
        CocoDetection(tmp_path, "val")


class SlowDataset:
    """Samples that take random times, so worker threads finish them out of order."""

    skip_bad_images = False

    def __len__(self):
        return 24

    def sample(self, index, rng):
        import time

        time.sleep(float(np.random.default_rng(index).uniform(0, 0.02)))
        return np.full((4, 4, 3), index, np.float32), {
            "labels": np.array([1]),
            "boxes": np.full((1, 4), 0.5, np.float32),
            "image_id": index,
            "orig_size": np.array([4, 4]),
            "size": np.array([4, 4]),
        }


def test_batches_come_in_order_whatever_the_threads_do():
    import time

    loader = DataLoader(SlowDataset(), batch_size=2, shuffle=False, num_workers=4, prefetch=6)
    for trial in range(3):
        ids = []
        for _, _, targets in micro_batches(loader, trial):
            ids += [t["image_id"] for t in targets]
            time.sleep(0.01)  # a consumer busy with a training step
        assert ids == list(range(24))


def test_registered_datasets_are_built_by_name(shapes):
    from deformable_detr.data import DATASETS, dataset_reads, register_dataset

    cfg = load_config(None, [f"data.path={shapes}", "data.dataset=mine"])
    with pytest.raises(ValueError, match=r"data.dataset 'mine': expected one of coco, createml, shapes"):
        build_dataset("val", cfg.data)
    built = []

    @register_dataset("mine")
    def mine(split, data_cfg, prepare=True):
        built.append((split, data_cfg.path, prepare))
        return CocoDetection(data_cfg.path, split)

    try:
        dataset = build_dataset("val", cfg.data, prepare=False)
        build_dataset("val", cfg.data, prepare=False, strict=False)  # a builder without `strict`: as training's
        assert dataset_reads("mine") is None and dataset_reads("yolo") == "yaml" and dataset_reads("voc") == "folder"
    finally:
        del DATASETS["mine"]
    assert built == [("val", str(shapes), False)] * 2 and len(dataset) == 4
    assert dataset.class_names() == {1: "square", 2: "circle", 3: "triangle", 4: "diamond", 5: "cross"}
    assert dataset.max_category_id() == 5


def test_shapes_set_is_not_generated_without_prepare(tmp_path):
    cfg = load_config(None, [f"data.path={tmp_path / 'shapes'}", "data.dataset=shapes"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_dataset("val", cfg.data, prepare=False)
    assert not (tmp_path / "shapes").exists()
