"""Apple's Create ML JSON as Roboflow exports it (`data.dataset: createml`): the shapes set written again
in that layout (dataset_writers.write_createml) reads back to the COCO JSON loader's targets and ground
truth, and a model scores on it exactly the AP it scores on the COCO files; every malformed entry stops
before training in one line naming the file, the entry and the annotation; `check` lists them all."""

import json
import shutil

from deformable_detr.check import main as check_main
from deformable_detr.data import build_dataset, num_classes_for
from deformable_detr.data.shapes import CATEGORIES, generate
from deformable_detr.inference.evaluation import STAT_NAMES

import numpy as np
import pytest
from dataset_writers import write_createml
from PIL import Image
from test_formats import SIZES, assert_same_targets, assert_scores_alike_through_the_class_map, by_class_name, data_cfg
from test_train import TINY

import eval as eval_script
import train

ANNOTATIONS = "_annotations.createml.json"


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """The same 8 train and 4 val images as COCO JSON and as Roboflow's Create ML export."""
    root = tmp_path_factory.mktemp("createml")
    coco = generate(root / "coco", 8, 4, seed=3, **SIZES)
    return {"coco": coco, "createml": write_createml(coco, root / "createml")}


def entries(root, folder="train") -> list:
    return json.loads((root / folder / ANNOTATIONS).read_text())


def rewrite(root, folder, content):
    """Write a split's Create ML file back -> its path."""
    path = root / folder / ANNOTATIONS
    path.write_text(json.dumps(content))
    return path


@pytest.mark.parametrize("split", ["train", "val"])
def test_targets_and_ground_truth_equal_the_coco_json_loaders(sets, split):
    reference = build_dataset(split, data_cfg("coco", sets["coco"]))
    dataset = build_dataset(split, data_cfg("createml", sets["createml"]))
    assert_same_targets(dataset, reference)
    assert dataset.notes == [] and dataset.problems == []
    assert dataset.annotation_file == sets["createml"] / {"train": "train", "val": "valid"}[split] / ANNOTATIONS


def test_a_val_folder_and_a_json_of_another_name_read_the_same(sets, tmp_path):
    """`val/` for `valid/`, and a split folder's only .json whatever its name."""
    root = write_createml(sets["coco"], tmp_path / "createml", val_folder="val")
    (root / "val" / ANNOTATIONS).rename(root / "val" / "labels.json")
    dataset = build_dataset("val", data_cfg("createml", root))
    assert dataset.annotation_file == root / "val" / "labels.json"
    assert_same_targets(dataset, build_dataset("val", data_cfg("coco", sets["coco"])))


def test_where_the_split_or_its_json_is_not_one_thing_it_is_named(sets, tmp_path):
    root = shutil.copytree(sets["createml"], tmp_path / "createml")
    shutil.copytree(root / "valid", root / "val")
    with pytest.raises(ValueError) as raised:
        build_dataset("val", data_cfg("createml", root))
    assert str(raised.value) == (
        f"Create ML val split: both {root / 'valid'}/ and {root / 'val'}/: keep one (data.path is {root})"
    )
    shutil.rmtree(root / "val")
    shutil.rmtree(root / "valid")
    with pytest.raises(FileNotFoundError) as raised:
        build_dataset("val", data_cfg("createml", root))
    assert str(raised.value) == f"Create ML val split: no {root / 'valid'}/ or {root / 'val'}/ (data.path is {root})"
    (root / "train" / ANNOTATIONS).rename(root / "train" / "a.json")
    (root / "train" / "b.json").write_text("[]")
    with pytest.raises(ValueError) as raised:
        build_dataset("train", data_cfg("createml", root))
    assert str(raised.value) == (
        f"{root / 'train'}: several .json files (a.json, b.json): name the Create ML one {ANNOTATIONS}"
    )


def test_class_ids_are_the_sorted_labels_of_both_splits(sets, tmp_path):
    """VOC's rule: ids in the sorted order of both splits' labels, so a class that only val holds has the
    same id in train; spellings that differ in case are one class, named by the most frequent."""
    dataset = build_dataset("train", data_cfg("createml", sets["createml"]))
    assert dataset.class_names() == dict(enumerate(sorted(CATEGORIES)))
    assert num_classes_for(dataset, "auto") == 5

    root = shutil.copytree(sets["createml"], tmp_path / "createml")
    train_entries = entries(root)
    crosses = [a for e in train_entries for a in e["annotations"] if a["label"] == "cross"]
    for entry in train_entries:  # no cross in train, and one circle written "Circle "
        entry["annotations"] = [a for a in entry["annotations"] if a["label"] != "cross"]
    circles = [a for e in train_entries for a in e["annotations"] if a["label"] == "circle"]
    circles[0]["label"] = "Circle "
    rewrite(root, "train", train_entries)
    val_circles = [a for e in entries(root, "valid") for a in e["annotations"] if a["label"] == "circle"]
    dataset = build_dataset("train", data_cfg("createml", root))
    assert dataset.class_names() == dict(enumerate(sorted(CATEGORIES)))
    assert dataset.class_spellings() == {0: {"Circle ": 1, "circle": len(circles) - 1 + len(val_circles)}}
    boxes = [a["category_id"] for a in dataset.coco.anns.values()]
    assert len(crosses) > 0 and 1 not in boxes and boxes.count(0) == len(circles)


@pytest.fixture(scope="module")
def coco_model(sets, tmp_path_factory):
    """The quick start's kind of model, tiny, trained a few epochs on the COCO JSON set (its category ids
    1..5), long enough that its AP is not all zeros."""
    output = tmp_path_factory.mktemp("coco_run")
    train.main(
        ["--config", str(TINY), "--output-dir", str(output), f"data.path={sets['coco']}"]
        + ["schedule.epochs=6", "train.eval_every=0", "model.num_queries=20"]
    )
    return output / "checkpoint.safetensors"


def test_eval_on_the_createml_set_gives_the_coco_files_ap(sets, coco_model, tmp_path):
    """eval.py on the val split as Create ML (ids: sorted names): the same detections, their ids the
    dataset's of the same name, and every number of eval_results.json equal to the COCO JSON's."""
    argv = ["--checkpoint", str(coco_model)]  # the config the checkpoint records
    want = eval_script.main([*argv, "--output-dir", str(tmp_path / "coco"), f"data.path={sets['coco']}"])
    got = eval_script.main(
        [*argv, "--output-dir", str(tmp_path / "createml"), "data.dataset=createml", f"data.path={sets['createml']}"]
    )
    assert by_class_name(got) == by_class_name(want)
    assert want["AP"] > 0 and want["AR100"] > 0  # the model finds something: the comparison is not of zeros
    assert list(got["per_class"]) == sorted(CATEGORIES)
    ids = {name: i for i, name in enumerate(sorted(CATEGORIES))}
    coco_detections = json.loads((tmp_path / "coco" / "detections_val.json").read_text())
    detections = json.loads((tmp_path / "createml" / "detections_val.json").read_text())
    expected = [
        {k: d[k] for k in ("image_id", "bbox", "score")} | {"category_id": ids[CATEGORIES[d["category_id"] - 1]]}
        for d in coco_detections
    ]
    assert len(expected) == len(coco_detections) > 100
    assert [{k: d[k] for k in ("image_id", "bbox", "score", "category_id")} for d in detections] == expected


def test_evaluate_names_the_json_file_given_for_the_folder(sets, coco_model, tmp_path, capsys):
    json_file = sets["createml"] / "valid" / ANNOTATIONS
    argv = ["--checkpoint", str(coco_model), "--output-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as stopped:
        eval_script.main([*argv, "--data-path", str(json_file), "data.dataset=createml"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"error: {json_file}: a file, not a dataset; evaluate takes a dataset: a folder")


def test_jittered_detections_score_alike_through_the_class_map(sets):
    """A non-trivial AP (0 < AP < 1): COCO-id detections mapped by name score on the Create ML ground
    truth what they score on the COCO file's, to 1e-12 (pycocotools on both); taken as they are, lower."""
    assert_scores_alike_through_the_class_map(
        *(build_dataset("val", data_cfg(k, sets[k])) for k in ("coco", "createml"))
    )


def spoil(change):
    """A BAD_INPUTS case: `change(entries)` on train's entries (the second entry is 000000000002.png)."""

    def apply(root):
        content = entries(root)
        change(content)
        return rewrite(root, "train", content)

    return apply


DELETE = object()


def set_key(key, value=DELETE):
    """A BAD_INPUTS case: `key` of the second annotation of train's second entry (of its coordinates for
    x, y, width, height) set to `value`, or deleted."""

    def change(content):
        target = content[1]["annotations"][1]
        if key in ("x", "y", "width", "height"):
            target = target["coordinates"]
        if value is DELETE:
            del target[key]
        else:
            target[key] = value

    return spoil(change)


def write_file(text):
    def apply(root):
        (root / "train" / ANNOTATIONS).write_text(text)
        return root / "train" / ANNOTATIONS

    return apply


def remove_image(root):
    path = root / "train" / "000000000002.png"
    path.unlink()
    return path


ENTRY = '{path}, entry 2 ("000000000002.png")'
BAD_INPUTS = {  # how, the message (after "error: ")
    "not JSON": (
        write_file('[{"image": "a.png",\n "annotations": [}]'),
        "{path}, line 2, column 18: not valid JSON (Expecting value)",
    ),
    "not a list": (
        write_file('{"image": "a.png", "annotations": []}'),
        '{path}: expected a list of images ([{{"image": ..., "annotations": [...]}}, ...]), got an object',
    ),
    "an entry not an object": (
        spoil(lambda c: c.insert(1, "000000000002.png")),
        '{path}, entry 2: expected an object with "image" and "annotations", got a string',
    ),
    "no image": (spoil(lambda c: c[1].pop("image")), '{path}, entry 2: no "image" (the image file\'s name)'),
    "image not a name": (spoil(lambda c: c[1].update(image=7)), '{path}, entry 2: "image" 7 is not a file name'),
    "no annotations": (
        spoil(lambda c: c[1].pop("annotations")),
        ENTRY + ': no "annotations" (a list of boxes; [] for none)',
    ),
    "annotations an object": (
        spoil(lambda c: c[1].update(annotations={"label": "circle"})),
        ENTRY + ': "annotations" is an object, not a list',
    ),
    "no label": (set_key("label"), ENTRY + ', annotation 2: no "label" (the class name)'),
    "label not a name": (set_key("label", ""), ENTRY + ', annotation 2: "label" "" is not a class name'),
    "no coordinates": (
        set_key("coordinates"),
        ENTRY + ', annotation 2 ("{label}"): no "coordinates" ({{"x", "y", "width", "height"}}, in pixels)',
    ),
    "no width": (set_key("width"), ENTRY + ', annotation 2 ("{label}"): coordinates: no "width"'),
    "x not a number": (
        set_key("x", "12px"),
        ENTRY + ', annotation 2 ("{label}"): coordinates: "x" "12px" is not a number',
    ),
    "y null": (set_key("y", None), ENTRY + ', annotation 2 ("{label}"): coordinates: "y" null is not a number'),
    "height negative": (
        set_key("height", -3),
        ENTRY + ', annotation 2 ("{label}"): coordinates: "height" -3 is negative',
    ),
    "width not finite": (
        set_key("width", float("inf")),
        ENTRY + ', annotation 2 ("{label}"): coordinates: "width" inf is not finite',
    ),
    "image missing": (
        remove_image,
        "{path}: image file not found ({root}/train/" + ANNOTATIONS + ', entry 2 ("000000000002.png"); '
        "data.skip_bad_images=true leaves it out)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_a_malformed_entry_stops_before_training_in_one_line_naming_file_entry_and_annotation(sets, tmp_path, case):
    how, message = BAD_INPUTS[case]
    root = shutil.copytree(sets["createml"], tmp_path / "createml")
    label = entries(root)[1]["annotations"][1]["label"]
    path = how(root)
    output = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:
        train.main(["--config", str(TINY), "--output-dir", str(output), "data.dataset=createml", f"data.path={root}"])
    assert str(stopped.value) == "error: " + message.format(path=path, label=label, root=root)
    assert not output.exists()


def check(capsys, root, *overrides) -> tuple[int, list[str], str]:
    """`python -m deformable_detr.check` in this process -> (exit status, stdout's lines stripped, the
    error line it exits with)."""
    status, error = 0, ""
    try:
        check_main(["--config", str(TINY), "data.dataset=createml", f"data.path={root}", *overrides])
    except SystemExit as stop:
        status, error = (stop.code, "") if isinstance(stop.code, int) else (1, stop.code)
    return status, [line.strip() for line in capsys.readouterr().out.splitlines()], error


def test_check_counts_every_class_as_the_coco_file_and_exits_0(sets, capsys):
    status, lines, _ = check(capsys, sets["createml"])
    assert status == 0
    for split, folder in (("train", "train"), ("val", "valid")):
        data = json.loads((sets["coco"] / "annotations" / f"instances_{split}2017.json").read_text())
        names = {c["id"]: c["name"] for c in data["categories"]}
        source = sets["createml"] / folder / ANNOTATIONS
        header = f"{split}: {len(data['images'])} images, {len(data['annotations'])} boxes ({source})"
        rows = lines[lines.index(header) + 2 : lines.index(header) + 7]
        for i, name in enumerate(sorted(CATEGORIES)):
            ids = [a["image_id"] for a in data["annotations"] if names[a["category_id"]] == name]
            assert rows[i].split() == [str(i), name, str(len(set(ids))), str(len(ids))]
    assert not [line for line in lines if line.startswith(("note:", "problem:"))]
    assert lines[-1] == "no problems found"


def test_check_lists_every_problem_of_both_splits_and_exits_1(sets, tmp_path, capsys):
    root = shutil.copytree(sets["createml"], tmp_path / "createml")
    train_entries, val_entries = entries(root), entries(root, "valid")
    del train_entries[0]["annotations"][0]["label"]
    train_entries[2]["annotations"][0]["coordinates"]["width"] = -1
    val_entries[1]["annotations"][0]["coordinates"].pop("y")
    train_json, val_json = rewrite(root, "train", train_entries), rewrite(root, "valid", val_entries)
    (root / "valid" / "000000000004.png").unlink()
    status, lines, error = check(capsys, root)
    assert status == 1
    first_label = train_entries[2]["annotations"][0]["label"]
    val_label = val_entries[1]["annotations"][0]["label"]
    assert [line.removeprefix("problem: ") for line in lines if line.startswith("problem:")] == [
        f'{train_json}, entry 1 ("000000000001.png"), annotation 1: no "label" (the class name)',
        f'{train_json}, entry 3 ("000000000003.png"), annotation 1 ("{first_label}"): coordinates: "width" -1 is '
        "negative",
        f'{val_json}, entry 2 ("000000000002.png"), annotation 1 ("{val_label}"): coordinates: no "y"',
        f'{root / "valid" / "000000000004.png"}: image file not found ({val_json}, entry 4 ("000000000004.png"); '
        "data.skip_bad_images=true leaves it out)",
    ]
    assert error == "error: 4 problem(s) found: training would stop at the first"


def test_boxes_training_drops_are_counted_where_they_are_and_kept_out_of_training(sets, tmp_path, capsys):
    """A box of zero size and one outside the image: dropped, counted, named (as for every format);
    the targets are the clean set's, the ground truth holds two more boxes."""
    root = shutil.copytree(sets["createml"], tmp_path / "createml")
    content = entries(root)
    width = Image.open(root / "train" / content[2]["image"]).size[0]
    content[2]["annotations"] += [
        {"label": "circle", "coordinates": {"x": 20, "y": 20, "width": 0, "height": 8}},
        {"label": "square", "coordinates": {"x": width + 10, "y": 20, "width": 8, "height": 8}},
    ]
    path = rewrite(root, "train", content)
    dataset = build_dataset("train", data_cfg("createml", root))
    reference = build_dataset("train", data_cfg("createml", sets["createml"]))
    np.testing.assert_array_equal(dataset.load(2)[1]["boxes"], reference.load(2)[1]["boxes"])
    assert len(dataset.coco.anns) == len(reference.coco.anns) + 2
    status, lines, _ = check(capsys, root)
    assert status == 0
    entry, count = f'{path}, entry 3 ("000000000003.png")', len(content[2]["annotations"])
    assert (
        f'boxes dropped as training drops them: 1 zero size (first: {entry}, annotation {count - 1} ("circle")), '
        f'1 outside the image (first: {entry}, annotation {count} ("square"))'
    ) in lines


def test_unlisted_images_are_noted_and_bad_images_left_out_when_asked(sets, tmp_path):
    root = shutil.copytree(sets["createml"], tmp_path / "createml")
    shutil.copy(root / "valid" / "000000000001.png", root / "valid" / "extra.png")
    broken = root / "valid" / "000000000003.png"
    broken.write_bytes(b"not a png")
    dataset = build_dataset("val", data_cfg("createml", root, "data.skip_bad_images=true"))
    assert dataset.ids == [1, 2, 4]  # the entries' places in the list
    assert dataset.notes[0].startswith(f"{broken}: cannot read image: ")
    assert dataset.notes[0].endswith(
        f'({root / "valid" / ANNOTATIONS}, entry 3 ("000000000003.png")); left out (data.skip_bad_images)'
    )
    assert dataset.notes[1] == (
        f"1 image file(s) in {root / 'valid'} that {ANNOTATIONS} does not list (not read): "
        f"{root / 'valid' / 'extra.png'}"
    )


def test_photos_are_read_in_the_displayed_frame_unless_stored_is_asked(tmp_path):
    """The file records no sizes: a photo tagged orientation 6 (stored 40 x 30) is 30 x 40 as shown,
    as viewers and Roboflow's annotator show it; data.exif_orientation=stored keeps 40 x 30."""
    root = tmp_path / "createml"
    for folder in ("train", "valid"):
        (root / folder).mkdir(parents=True)
        exif = Image.Exif()
        exif[0x0112] = 6
        Image.new("RGB", (40, 30), (200, 10, 10)).save(root / folder / "photo.jpg", exif=exif)
        box = {"label": "circle", "coordinates": {"x": 15, "y": 30, "width": 10, "height": 20}}
        (root / folder / ANNOTATIONS).write_text(json.dumps([{"image": "photo.jpg", "annotations": [box]}]))
    dataset = build_dataset("val", data_cfg("createml", root))
    assert dataset.image_sizes() == [(30, 40)]
    image, target = dataset.load(0)
    assert image.size == (30, 40)
    np.testing.assert_array_equal(target["boxes"], [[10, 20, 20, 40]])
    stored = build_dataset("val", data_cfg("createml", root, "data.exif_orientation=stored"))
    assert stored.image_sizes() == [(40, 30)] and stored.load(0)[0].size == (40, 30)
    np.testing.assert_array_equal(stored.load(0)[1]["boxes"], [[10, 20, 20, 30]])  # clipped to the stored height


def test_two_training_steps_and_an_evaluation(sets, tmp_path):
    argv = ["--config", str(TINY), "--output-dir", str(tmp_path), "data.dataset=createml"]
    train.main(
        [*argv, f"data.path={sets['createml']}", "model.num_classes=auto", "train.max_steps=2", "schedule.epochs=1"]
    )
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in records if "grad_norm" in r] == [1, 2]
    results = json.loads((tmp_path / "eval_results.json").read_text())
    assert list(results["per_class"]) == sorted(CATEGORIES)
    assert results["ground_truth"]["boxes"] == sum(len(e["annotations"]) for e in entries(sets["createml"], "valid"))
    assert all(0 <= results[name] <= 1 for name in STAT_NAMES if results[name] != -1)
