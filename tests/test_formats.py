"""Datasets in YOLO and Pascal VOC layouts: a shapes set written again in each (dataset_writers.py) reads
back to the COCO JSON loader's targets and ground truth; each trains two steps and evaluates; a model
meets their classes by name; every unreadable input stops before training in one line naming the file
and line; `python -m deformable_detr.check` counts and lists, with its exit status."""

import json
import os
import re
import shutil
import subprocess
import sys

from deformable_detr import load_config
from deformable_detr.data import build_dataset, num_classes_for
from deformable_detr.data.classes import describe_match, match_classes, to_dataset_classes
from deformable_detr.data.shapes import CATEGORIES, generate
from deformable_detr.inference.evaluation import STAT_NAMES

import numpy as np
import pytest
from dataset_writers import write_voc, write_yolo
from PIL import Image
from test_evaluate import coco_stats
from test_train import ROOT, TINY

import eval as eval_script
import train

FOUR_FIELDS = "expected 5 fields 'class cx cy w h' or a polygon 'class x1 y1 x2 y2 x3 y3 ...', got 4: '0 0.5 0.5 0.2'"
SIZES = dict(height=(48, 80), width=(56, 96), max_size=40)  # width != height: a swapped axis shows


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """The same 8 train and 4 val images as COCO JSON, YOLO and VOC."""
    root = tmp_path_factory.mktemp("formats")
    coco = generate(root / "coco", 8, 4, seed=3, **SIZES)
    return {"coco": coco, "yolo": write_yolo(coco, root / "yolo"), "voc": write_voc(coco, root / "voc")}


def data_cfg(kind: str, path, *overrides):
    return load_config(TINY, [f"data.dataset={kind}", f"data.path={path}", *overrides]).data


def named(labels, names) -> list[str]:
    return [names[int(label)] for label in labels]


def ground_truth(dataset) -> list:
    """Per image (in id order): its annotations as (class name, bbox, area, iscrowd), sorted."""
    names = dataset.class_names()
    return [
        sorted(
            (names[a["category_id"]], *np.round(a["bbox"], 9), round(a["area"], 6), a.get("iscrowd", 0))
            for a in dataset.coco.imgToAnns.get(image_id, [])
        )
        for image_id in dataset.ids
    ]


def assert_same_targets(dataset, reference):
    """Image for image: pixels, boxes (pixels, then augmented and normalised), class names, ids, sizes."""
    assert len(dataset) == len(reference)
    names, reference_names = dataset.class_names(), reference.class_names()
    for i in range(len(reference)):
        (image, target), (want_image, want) = dataset.load(i), reference.load(i)
        np.testing.assert_array_equal(np.asarray(image), np.asarray(want_image))
        np.testing.assert_allclose(target["boxes"], want["boxes"], atol=1e-4)
        assert named(target["labels"], names) == named(want["labels"], reference_names)
        assert target["image_id"] == want["image_id"]
        np.testing.assert_array_equal(target["orig_size"], want["orig_size"])
        (pixels, sample), (want_pixels, want_sample) = [
            d.sample(i, np.random.default_rng([7, i])) for d in (dataset, reference)
        ]
        np.testing.assert_array_equal(pixels, want_pixels)
        np.testing.assert_allclose(sample["boxes"], want_sample["boxes"], atol=1e-6)
    assert ground_truth(dataset) == ground_truth(reference)


@pytest.mark.parametrize("split", ["train", "val"])
@pytest.mark.parametrize("kind", ["yolo", "voc"])
def test_targets_and_ground_truth_equal_the_coco_json_loaders(sets, kind, split):
    reference = build_dataset(split, data_cfg("coco", sets["coco"]))
    assert_same_targets(build_dataset(split, data_cfg(kind, sets[kind])), reference)


def test_roboflow_layout_and_image_lists_read_the_same(sets, tmp_path):
    """Roboflow's export (train/images, valid/images; data.yaml without path, entries ../train/images)
    and Ultralytics' image lists (a .txt of ./images/... lines) give the same sets."""
    roboflow = tmp_path / "roboflow"
    for split, folder in (("train", "train"), ("val", "valid")):
        for kind in ("images", "labels"):
            shutil.copytree(sets["yolo"] / kind / split, roboflow / folder / kind)
    names = CATEGORIES
    (roboflow / "data.yaml").write_text(f"train: ../train/images\nval: ../valid/images\nnc: 5\nnames: {names}\n")
    listed = shutil.copytree(sets["yolo"], tmp_path / "listed")
    images = sorted((listed / "images" / "val").iterdir())
    (listed / "val.txt").write_text("".join(f"./images/val/{p.name}\n" for p in images))
    (listed / "data.yaml").write_text(f"train: images/train\nval: val.txt\nnames: {dict(enumerate(names))}\n")
    for split in ("train", "val"):
        reference = build_dataset(split, data_cfg("yolo", sets["yolo"]))
        assert_same_targets(build_dataset(split, data_cfg("yolo", roboflow)), reference)
        assert_same_targets(build_dataset(split, data_cfg("yolo", listed)), reference)


def test_class_ids_yolo_its_indices_voc_the_sorted_names(sets):
    yolo = build_dataset("train", data_cfg("yolo", sets["yolo"] / "data.yaml"))  # the file itself, or its folder
    voc = build_dataset("train", data_cfg("voc", sets["voc"]))
    assert yolo.class_names() == dict(enumerate(CATEGORIES))
    assert voc.class_names() == dict(enumerate(sorted(CATEGORIES)))
    assert num_classes_for(yolo, "auto") == num_classes_for(voc, "auto") == 5


def test_voc_difficult_boxes_are_crowd_in_the_ground_truth_and_not_trained_on(sets, tmp_path):
    """VOC with two boxes difficult == the COCO file with those two iscrowd (targets without them,
    ground truth with them, ignored by COCO AP)."""
    crowd = tmp_path / "coco"
    shutil.copytree(sets["coco"], crowd)
    marked = set()
    for split in ("train", "val"):
        path = crowd / "annotations" / f"instances_{split}2017.json"
        data = json.loads(path.read_text())
        data["annotations"][1]["iscrowd"] = 1
        marked.add((split, data["annotations"][1]["id"]))
        path.write_text(json.dumps(data))
    voc = write_voc(sets["coco"], tmp_path / "voc", difficult=marked)
    for split in ("train", "val"):
        reference = build_dataset(split, data_cfg("coco", crowd))
        dataset = build_dataset(split, data_cfg("voc", voc))
        assert sum(a["iscrowd"] for a in dataset.coco.anns.values()) == 1
        assert_same_targets(dataset, reference)


def test_an_image_without_a_label_file_has_no_boxes(sets, tmp_path):
    yolo = shutil.copytree(sets["yolo"], tmp_path / "yolo")
    (yolo / "labels" / "val" / "000000000002.txt").unlink()
    dataset = build_dataset("val", data_cfg("yolo", yolo))
    reference = build_dataset("val", data_cfg("yolo", sets["yolo"]))
    for i in range(len(dataset)):
        boxes, want = dataset.load(i)[1]["boxes"], reference.load(i)[1]["boxes"]
        np.testing.assert_array_equal(boxes, want if dataset.ids[i] != 2 else np.zeros((0, 4), np.float32))
    assert len(reference.load(1)[1]["boxes"]) > 0
    assert dataset.notes == [
        "1 image(s) without a label file, so without boxes (as Ultralytics reads them): "
        f"{yolo / 'labels' / 'val' / '000000000002.txt'}"
    ]


def append_line(path, line: str) -> int:
    """Add a line to a text file -> its line number."""
    lines = path.read_text().splitlines() + [line]
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def test_boxes_training_drops_are_dropped_and_counted(sets, tmp_path):
    yolo = shutil.copytree(sets["yolo"], tmp_path / "yolo")
    label = yolo / "labels" / "train" / "000000000003.txt"
    zero = append_line(label, "0 0.5 0.5 0.0 0.2")
    outside = append_line(label, "1 1.5 0.5 0.2 0.2")  # x from 1.4 to 1.6 of the width
    dataset = build_dataset("train", data_cfg("yolo", yolo))
    reference = build_dataset("train", data_cfg("yolo", sets["yolo"]))
    np.testing.assert_array_equal(dataset.load(2)[1]["boxes"], reference.load(2)[1]["boxes"])
    assert len(dataset.coco.anns) == len(reference.coco.anns) + 2  # kept in the ground truth, as COCO's would be
    done = check_command(f"data.path={yolo}", "data.dataset=yolo")
    assert done.returncode == 0, done.stderr
    assert (
        f"boxes dropped as training drops them: 1 zero size (first: {label}, line {zero}), "
        f"1 outside the image (first: {label}, line {outside})"
    ) in done.stdout


def check_command(*overrides):
    command = [sys.executable, "-m", "deformable_detr.check", "--config", str(TINY), *overrides]
    return subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )


def test_check_command_counts_every_class_and_exits_0(sets):
    done = check_command(f"data.path={sets['voc']}", "data.dataset=voc")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for split in ("train", "val"):
        data = json.loads((sets["coco"] / "annotations" / f"instances_{split}2017.json").read_text())
        names = {c["id"]: c["name"] for c in data["categories"]}
        listing = sets["voc"] / "ImageSets" / "Main" / f"{split}.txt"
        header = f"{split}: {len(data['images'])} images, {len(data['annotations'])} boxes ({listing})"
        rows = lines[lines.index(header) + 2 : lines.index(header) + 7]
        for i, name in enumerate(sorted(CATEGORIES)):
            ids = [a["image_id"] for a in data["annotations"] if names[a["category_id"]] == name]
            assert rows[i].split() == [str(i), name, str(len(set(ids))), str(len(ids))]
    assert lines[-1] == "no problems found"


def test_check_command_lists_every_problem_and_exits_1(sets, tmp_path):
    yolo = shutil.copytree(sets["yolo"], tmp_path / "yolo")
    first = yolo / "labels" / "train" / "000000000001.txt"
    second = yolo / "labels" / "val" / "000000000004.txt"
    bad = [append_line(first, "0 0.5 0.5 0.2"), append_line(second, "9 0.5 0.5 0.2 0.2")]
    done = check_command(f"data.path={yolo}", "data.dataset=yolo")
    assert done.returncode == 1
    problems = [line.strip() for line in done.stdout.splitlines() if line.strip().startswith("problem:")]
    assert problems == [
        f"problem: {first}, line {bad[0]}: {FOUR_FIELDS}",
        f"problem: {second}, line {bad[1]}: class 9 is not one of the 5 names (0..4): '9 0.5 0.5 0.2 0.2'",
    ]
    assert done.stderr.strip().splitlines()[-1] == "error: 2 problem(s) found: training would stop at the first"


def break_yolo_label(root, line):
    path = root / "labels" / "train" / "000000000002.txt"
    return path, append_line(path, line)


def write_text(path, text: str, line: int):
    """Replace a file's text -> (the file, the line its error is on)."""
    path.write_text(text)
    return path, line


def break_voc_box(root):
    path = root / "Annotations" / "train_000000000002.xml"
    text = path.read_text()
    spoilt = re.sub(r"<xmax>[^<]*</xmax>", "<xmax>5px</xmax>", text, count=1)  # a unit is not VOC's
    return write_text(path, spoilt, text[: text.index("<xmax>")].count("\n") + 1)


BAD_INPUTS = {  # kind, how, the message (after "error: ")
    "yolo line of 4 fields": (
        "yolo",
        lambda root: break_yolo_label(root, "0 0.5 0.5 0.2"),
        "{path}, line {line}: " + FOUR_FIELDS,
    ),
    "yolo value not a number": (
        "yolo",
        lambda root: break_yolo_label(root, "0 0.5 0.5 0.2 O.3"),
        "{path}, line {line}: 'O.3' is not a number: '0 0.5 0.5 0.2 O.3'",
    ),
    "yolo class outside the names": (
        "yolo",
        lambda root: break_yolo_label(root, "5 0.5 0.5 0.2 0.2"),
        "{path}, line {line}: class 5 is not one of the 5 names (0..4): '5 0.5 0.5 0.2 0.2'",
    ),
    "yolo data.yaml not YAML": (
        "yolo",
        lambda root: write_text(root / "data.yaml", "path: .\ntrain: [images/train\nval: images/val\n", 3),
        "{path}, line {line}, column 4: not valid YAML (expected ',' or ']', but got ':')",
    ),
    "voc XML not XML": (
        "voc",
        lambda root: write_text(
            root / "Annotations" / "train_000000000002.xml", "<annotation>\n<size>\n</annotation>", 3
        ),
        "{path}, line {line}, column 3: not valid XML (mismatched tag)",
    ),
    "voc coordinate not a number": (
        "voc",
        break_voc_box,
        "{path}, line {line}: <bndbox> <xmax> is '5px', not a number",
    ),
    "coco JSON not JSON": (  # the issue's: "error: Expecting value: line 2 column 1 (char 13)", no file named
        "coco",
        lambda root: write_text(root / "annotations" / "instances_train2017.json", '{"images":\n]', 2),
        "{path}, line {line}, column 1: not valid JSON (Expecting value)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_an_unreadable_input_stops_before_training_in_one_line_naming_file_and_line(sets, tmp_path, case):
    kind, spoil, message = BAD_INPUTS[case]
    root = shutil.copytree(sets[kind], tmp_path / kind)
    path, line = spoil(root)
    output = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:
        train.main(["--config", str(TINY), "--output-dir", str(output), f"data.dataset={kind}", f"data.path={root}"])
    assert str(stopped.value) == "error: " + message.format(path=path, line=line)
    assert not output.exists()


def empty_split(kind, root):
    """Leave the train split without images -> the file its error names."""
    if kind == "coco":
        path = root / "annotations" / "instances_train2017.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "images": [], "annotations": []}))
        return path
    if kind == "yolo":
        for image in (root / "images" / "train").iterdir():
            image.unlink()
        return root / "data.yaml"
    (root / "ImageSets" / "Main" / "train.txt").write_text("\n")
    return root / "ImageSets" / "Main" / "train.txt"


@pytest.mark.parametrize("kind", ["coco", "yolo", "voc"])
def test_a_split_without_images_is_named(sets, tmp_path, kind):
    """The issue's `error: max() arg is an empty sequence`, now the file and split."""
    root = shutil.copytree(sets[kind], tmp_path / kind)
    source = empty_split(kind, root)
    output = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:
        train.main(["--config", str(TINY), "--output-dir", str(output), f"data.dataset={kind}", f"data.path={root}"])
    assert str(stopped.value) == f"error: {source}: the train split has no images"
    assert not output.exists()


def test_the_command_line_says_it_in_one_line_with_exit_1(sets, tmp_path):
    root = shutil.copytree(sets["yolo"], tmp_path / "yolo")
    path, line = break_yolo_label(root, "0 0.5 0.5 0.2")
    command = [sys.executable, str(ROOT / "train.py"), "--config", str(TINY), "--output-dir", str(tmp_path / "run")]
    done = subprocess.run(
        [*command, "data.dataset=yolo", f"data.path={root}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"error: {path}, line {line}: {FOUR_FIELDS}"]


@pytest.mark.parametrize("kind", ["yolo", "voc"])
def test_two_training_steps_and_an_evaluation(sets, tmp_path, kind):
    argv = ["--config", str(TINY), "--output-dir", str(tmp_path), f"data.dataset={kind}", f"data.path={sets[kind]}"]
    train.main([*argv, "model.num_classes=auto", "train.max_steps=2", "schedule.epochs=1"])
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in records if "grad_norm" in r] == [1, 2]
    results = json.loads((tmp_path / "eval_results.json").read_text())
    names = build_dataset("val", data_cfg(kind, sets[kind])).class_names()
    assert list(results["per_class"]) == list(names.values())
    assert all(0 <= results[name] <= 1 for name in STAT_NAMES if results[name] != -1)


@pytest.fixture(scope="module")
def coco_model(sets, tmp_path_factory):
    """The quick start's kind of model, tiny, two steps on the COCO JSON set: its category ids 1..5."""
    output = tmp_path_factory.mktemp("coco_run")
    train.main(
        ["--config", str(TINY), "--output-dir", str(output), f"data.path={sets['coco']}", "train.max_steps=2"]
        + ["schedule.epochs=1", "train.eval_every=0"]
    )
    return output / "checkpoint.safetensors"


def by_class_name(stats: dict) -> dict:
    """eval_results.json's numbers with the confusion matrix's counts keyed by (ground truth, predicted)
    class name: a dataset that numbers the classes otherwise gives the same record."""
    matrix = dict(stats["confusion_matrix"])
    names = matrix.pop("classes")
    counts = matrix.pop("counts")
    matrix["counts"] = {(names[i], names[j]): n for i, row in enumerate(counts) for j, n in enumerate(row)}
    assert sum(matrix["counts"].values()) > 0  # the comparison is not of empty matrices
    return stats | {"confusion_matrix": matrix}


@pytest.mark.parametrize("kind", ["yolo", "voc"])
def test_a_model_is_evaluated_on_other_ids_by_class_name(sets, coco_model, tmp_path, kind):
    """eval.py on the val split written as YOLO (ids 0..4) or VOC (sorted names): the same detections,
    their ids the dataset's of the same name, the same AP as on the COCO JSON."""
    argv = ["--checkpoint", str(coco_model), "--config", str(TINY)]
    want = eval_script.main([*argv, "--output-dir", str(tmp_path / "coco"), f"data.path={sets['coco']}"])
    got = eval_script.main(
        [*argv, "--output-dir", str(tmp_path / kind), f"data.dataset={kind}", f"data.path={sets[kind]}"]
    )
    assert by_class_name(got) == by_class_name(want)
    names = build_dataset("val", data_cfg(kind, sets[kind])).class_names()
    ids = {name: i for i, name in names.items()}
    coco_detections = json.loads((tmp_path / "coco" / "detections_val.json").read_text())
    detections = json.loads((tmp_path / kind / "detections_val.json").read_text())
    expected = [
        {k: d[k] for k in ("image_id", "bbox", "score")} | {"category_id": ids[CATEGORIES[d["category_id"] - 1]]}
        for d in coco_detections
    ]
    assert len(expected) == len(coco_detections) > 100  # output 0 has no name: left out on COCO JSON too
    assert [{k: d[k] for k in ("image_id", "bbox", "score", "category_id")} for d in detections] == expected


def jittered_detections(coco_gt, seed=0) -> list:
    """COCO results around the ground truth, in its category ids: shifted boxes, a fifth of them of
    another class, scores at random, and a false positive per image."""
    rng = np.random.default_rng(seed)
    categories = sorted(coco_gt.cats)
    detections = []
    for a in coco_gt.anns.values():
        x, y, w, h = a["bbox"]
        label = int(rng.choice(categories)) if rng.uniform() < 0.2 else a["category_id"]
        box = [x + rng.normal(0, 2), y + rng.normal(0, 2), w * rng.uniform(0.8, 1.2), h * rng.uniform(0.8, 1.2)]
        detections.append({"image_id": a["image_id"], "category_id": label, "bbox": box, "score": rng.uniform()})
    for image_id in coco_gt.imgs:
        box = [float(v) for v in rng.uniform(0, 30, 4)]
        detections.append({"image_id": image_id, "category_id": int(rng.choice(categories)), "bbox": box, "score": 0.3})
    return detections


@pytest.mark.parametrize("kind", ["yolo", "voc"])
def test_detections_in_coco_ids_score_alike_on_yolo_and_voc_through_the_class_map(sets, kind):
    """A non-trivial AP (0 < AP < 1): the COCO ids mapped by name score the same on the other
    layout's ground truth to 1e-12; taken as they are, they would not."""
    assert_scores_alike_through_the_class_map(*(build_dataset("val", data_cfg(k, sets[k])) for k in ("coco", kind)))


def assert_scores_alike_through_the_class_map(coco, other):
    """Jittered detections in `coco`'s ids (pycocotools on both): mapped by name to `other`'s ids, the same
    numbers to 1e-12 and a non-trivial AP (0.1 < AP < 0.9); taken as they are, at least 0.1 lower."""
    detections = jittered_detections(coco.coco)
    want = coco_stats(coco.coco, [dict(d) for d in detections], verbose=False, backend="pycocotools")
    assert 0.1 < want["AP"] < 0.9
    class_map = match_classes(coco.class_names(), other.class_names())
    got = coco_stats(other.coco, to_dataset_classes(detections, class_map), verbose=False, backend="pycocotools")
    for name in STAT_NAMES:
        assert got[name] == pytest.approx(want[name], abs=1e-12), name
    assert got["per_class"] == want["per_class"]
    unmapped = coco_stats(other.coco, [dict(d) for d in detections], verbose=False, backend="pycocotools")
    assert unmapped["AP"] < want["AP"] - 0.1


def test_classes_meet_by_name_ignoring_case():
    model = {1: "square", 2: "Circle", 3: "triangle", 7: "hexagon"}
    assert match_classes(model, {0: "circle", 1: "SQUARE", 2: "star"}) == {1: 1, 2: 0}
    assert match_classes(model, {}) is None and match_classes({}, {0: "circle"}) is None
    assert match_classes(model, {0: "star"}) is None  # nothing shared: ids as they are
    detections = [{"category_id": c, "score": 0.5} for c in (1, 2, 3, 7)]
    assert to_dataset_classes(detections, {1: 1, 2: 0}) == [
        {"category_id": 1, "score": 0.5},
        {"category_id": 0, "score": 0.5},
    ]
    assert to_dataset_classes(detections, None) is detections
    lines = describe_match(model, {0: "circle", 1: "SQUARE", 2: "star"}, {1: 1, 2: 0}, "val.txt")
    assert lines == [
        "classes met by name (model id -> val.txt's id): Circle 2 -> 0",
        "warning: the model has no class named star (2) of val.txt: their AP is 0",
    ]
    assert describe_match(model, {0: "star"}, None, "val.txt") == [
        "warning: no class name of the model is one of val.txt's: category ids compared as they are"
    ]


def test_an_image_that_cannot_be_read_is_named_or_left_out(sets, tmp_path):
    yolo = shutil.copytree(sets["yolo"], tmp_path / "yolo")
    broken = yolo / "images" / "val" / "000000000003.png"
    broken.write_bytes(b"not a png")
    with pytest.raises(
        ValueError, match=f"^{re.escape(str(broken))}: cannot read image: .*skip_bad_images=true leaves"
    ):
        build_dataset("val", data_cfg("yolo", yolo))
    dataset = build_dataset("val", data_cfg("yolo", yolo, "data.skip_bad_images=true"))
    assert len(dataset) == 3 and "left out (data.skip_bad_images)" in dataset.notes[0]
    assert Image.open(sets["yolo"] / "images" / "val" / "000000000003.png").size  # the original is fine
