"""Label files as users' tools write them: class names that differ only in case or surrounding space are
one class in COCO, YOLO and VOC sets (and a model meets them by the same key), YOLO segmentation and pose
lines read as Ultralytics reads them."""

import json
from collections import Counter

from deformable_detr import load_config
from deformable_detr.data import build_dataset
from deformable_detr.data.classes import class_key, match_classes, merge_classes

import numpy as np
import pytest
from PIL import Image
from test_train import TINY


def voc_set(root, objects_per_image: list[list[str]]):
    """A VOC set whose train and val images hold objects of these names, one 20 x 20 box each."""
    for folder in ("Annotations", "ImageSets/Main", "JPEGImages"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    ids = []
    for i, names in enumerate(objects_per_image):
        ids.append(f"image{i}")
        Image.new("RGB", (64, 48)).save(root / "JPEGImages" / f"image{i}.jpg")
        objects = "".join(
            f"<object><name>{name}</name><bndbox><xmin>{1 + 20 * j}</xmin><ymin>1</ymin>"
            f"<xmax>{20 + 20 * j}</xmax><ymax>20</ymax></bndbox></object>"
            for j, name in enumerate(names)
        )
        size = "<size><width>64</width><height>48</height><depth>3</depth></size>"
        xml = f"<annotation><filename>image{i}.jpg</filename>{size}{objects}</annotation>"
        (root / "Annotations" / f"image{i}.xml").write_text(xml)
    for split in ("train", "val"):
        (root / "ImageSets" / "Main" / f"{split}.txt").write_text("\n".join(ids) + "\n")
    return root


def test_voc_names_by_case_are_one_class(tmp_path):
    root = voc_set(tmp_path, [["Dog", "dog "], ["dog", "cat"], [" dog", "Cat"]])
    dataset = build_dataset("val", load_config(TINY, ["data.dataset=voc", f"data.path={root}"]).data)
    assert dataset.class_names() == {0: "cat", 1: "dog"}  # each named by its most frequent spelling
    # objects in both splits' files (here the same images): a tie for "cat", the first met
    assert dataset.class_spellings() == {0: Counter(cat=2, Cat=2), 1: Counter(dog=6, Dog=2)}
    labels = [list(dataset.load(i)[1]["labels"]) for i in range(3)]
    assert labels == [[1, 1], [1, 0], [1, 0]]


def coco_json(root, categories, annotation_categories):
    """A COCO set (train and val alike) of one 64 x 48 image, a 10 x 10 box per category id given."""
    for split in ("train", "val"):
        (root / f"{split}2017").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (64, 48)).save(root / f"{split}2017" / "a.png")
        annotations = [
            {"id": i + 1, "image_id": 1, "category_id": c, "bbox": [5 * i, 5, 10, 10]}
            for i, c in enumerate(annotation_categories)
        ]
        data = {
            "images": [{"id": 1, "file_name": "a.png", "width": 64, "height": 48}],
            "annotations": annotations,
            "categories": [{"id": i, "name": name} for i, name in categories.items()],
        }
        (root / "annotations").mkdir(exist_ok=True)
        (root / "annotations" / f"instances_{split}2017.json").write_text(json.dumps(data))
    return root


def test_coco_categories_by_case_are_one_class(tmp_path):
    root = coco_json(tmp_path, {1: "Dog", 2: "dog ", 3: "cat", 4: "DOG"}, [1, 2, 2, 3, 4])
    dataset = build_dataset("val", load_config(TINY, [f"data.path={root}"]).data)
    assert dataset.class_names() == {1: "dog", 3: "cat"}  # the lowest id, "dog " twice: the most frequent
    assert dataset.class_spellings() == {1: Counter({"dog ": 2, "Dog": 1, "DOG": 1})}
    assert list(dataset.load(0)[1]["labels"]) == [1, 1, 1, 3, 1]
    assert sorted(dataset.coco.getCatIds()) == [1, 3]  # the evaluation's ground truth: one class too


def test_merging_leaves_distinct_names_and_ties_to_the_first_spelling():
    data = {"categories": [{"id": 0, "name": "Cat"}, {"id": 5, "name": "cat"}, {"id": 2, "name": "dog"}]}
    data["annotations"] = [{"category_id": 0}, {"category_id": 5}]
    assert merge_classes(data) == {0: Counter(Cat=1, cat=1)}
    assert data["categories"] == [{"id": 0, "name": "Cat"}, {"id": 2, "name": "dog"}]
    assert [a["category_id"] for a in data["annotations"]] == [0, 0]
    untouched = {"categories": [{"id": 1, "name": "person"}], "annotations": [{"category_id": 1}]}
    assert merge_classes(untouched) == {} and untouched["categories"] == [{"id": 1, "name": "person"}]


def test_a_model_meets_classes_by_the_same_key():
    assert class_key("  Dog ") == class_key("dog") == "dog" and class_key("hot dog") != class_key("hotdog")
    assert match_classes({0: "cat", 1: " Dog"}, {3: "dog", 7: "CAT "}) == {0: 7, 1: 3}


def yolo_set(root, label_lines: list[str], extra_yaml: str = ""):
    """A YOLO set of one 100 x 50 image (train and val) with these label lines."""
    for split in ("train", "val"):
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "labels" / split).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (100, 50)).save(root / "images" / split / "a.png")
        (root / "labels" / split / "a.txt").write_text("\n".join(label_lines) + "\n")
    (root / "data.yaml").write_text(f"train: images/train\nval: images/val\nnames: [Dog, cat, dog]\n{extra_yaml}")
    return root


def test_yolo_segmentation_lines_are_their_polygons_bounding_box(tmp_path):
    polygon = "1 0.1 0.2 0.5 0.1 0.4 0.8 0.2 0.6"  # x from 0.1 to 0.5, y from 0.1 to 0.8
    root = yolo_set(tmp_path, [polygon, "2 0.5 0.5 0.2 0.2"])
    dataset = build_dataset("train", load_config(TINY, ["data.dataset=yolo", f"data.path={root}"]).data)
    _, target = dataset.load(0)
    np.testing.assert_allclose(target["boxes"], [[10, 5, 50, 40], [40, 20, 60, 30]], atol=1e-4)
    assert list(target["labels"]) == [1, 0]  # "dog" (2) is "Dog" (0): one class
    assert dataset.class_names() == {0: "dog", 1: "cat"}  # the lowest index, named as its boxes are
    assert "1 label line(s) are segmentation polygons: each read as its bounding box" in dataset.notes[0]


@pytest.mark.parametrize("line", ["0 0.5 0.5 0.2 0.2 0.9", "0 0.1 0.1 0.2 0.2"[:11]])
def test_a_line_neither_box_nor_polygon_is_named(tmp_path, line):
    root = yolo_set(tmp_path, [line])
    with pytest.raises(ValueError, match=r"a\.txt, line 1: expected 5 fields 'class cx cy w h' or a polygon"):
        build_dataset("train", load_config(TINY, ["data.dataset=yolo", f"data.path={root}"]).data)


def test_pose_lines_read_their_box(tmp_path):
    root = yolo_set(tmp_path, ["1 0.5 0.5 0.2 0.4 0.45 0.4 2 0.55 0.6 2"], "kpt_shape: [2, 3]\n")
    dataset = build_dataset("train", load_config(TINY, ["data.dataset=yolo", f"data.path={root}"]).data)
    np.testing.assert_allclose(dataset.load(0)[1]["boxes"], [[40, 15, 60, 35]], atol=1e-4)
    assert any("1 label line(s) carry keypoints" in note for note in dataset.notes)
