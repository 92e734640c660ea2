"""`python -m deformable_detr.check`: every image decoded as training decodes it (a truncated
file stops training, so it is a problem; `--headers-only` cannot see it), and the notes that do not
stop training (orphan annotations, images listed twice, EXIF-turned images and their frame, recorded
sizes that disagree, classes without boxes, merged spellings), each asserted on the printed lines."""

import json

from deformable_detr.check import main

import numpy as np
import pytest
from PIL import Image
from test_train import TINY

CATEGORIES = [{"id": 1, "name": "circle"}, {"id": 2, "name": "square"}]
SIZE = (40, 30)  # width, height: not square, so a turned image shows


def save_jpeg(path, size=SIZE, orientation=1):
    """A noisy JPEG (its header survives cutting the file in half), EXIF-tagged unless `orientation` is 1."""
    pixels = np.random.default_rng(len(path.name)).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    Image.fromarray(pixels).save(path, "JPEG", quality=95, exif=exif)


def image_entry(image_id, file_name, size=SIZE) -> dict:
    return {"id": image_id, "file_name": file_name, "width": size[0], "height": size[1]}


def box(annotation_id, image_id, category_id=1) -> dict:
    return {"id": annotation_id, "image_id": image_id, "category_id": category_id, "bbox": [5, 5, 10, 10]}


@pytest.fixture
def coco(tmp_path):
    """A clean COCO set: two train images, one val image, both classes boxed in each split. -> (root,
    {split: its JSON}); `write(root, data)` writes changed JSON back."""
    root = tmp_path / "coco"
    (root / "annotations").mkdir(parents=True)
    data = {}
    for split, names in (("train", ["a.jpg", "b.jpg"]), ("val", ["c.jpg"])):
        (root / f"{split}2017").mkdir()
        for name in names:
            save_jpeg(root / f"{split}2017" / name)
        images = [image_entry(i, name) for i, name in enumerate(names, 1)]
        annotations = [box(1, 1, 1), box(2, 1, 2)]
        data[split] = {"images": images, "annotations": annotations, "categories": [dict(c) for c in CATEGORIES]}
    write(root, data)
    return root, data


def write(root, data: dict):
    for split, content in data.items():
        (root / "annotations" / f"instances_{split}2017.json").write_text(json.dumps(content))


def check(capsys, root, *args, kind="coco") -> tuple[int, list[str], str]:
    """Run the command -> (exit status, stdout's lines stripped, the error line it exits with). A status-1
    stop is `SystemExit("error: ...")`, which the interpreter prints and exits 1 on (`errors.entry_point`)."""
    status, error = 0, ""
    try:
        main(["--config", str(TINY), *args, f"data.dataset={kind}", f"data.path={root}"])
    except SystemExit as stop:
        status, error = (stop.code, "") if isinstance(stop.code, int) else (1, stop.code)
    return status, [line.strip() for line in capsys.readouterr().out.splitlines()], error


def notes(lines) -> list[str]:
    return [line.removeprefix("note: ") for line in lines if line.startswith("note: ")]


def problems(lines) -> list[str]:
    return [line.removeprefix("problem: ") for line in lines if line.startswith("problem: ")]


def train_json(root):
    return root / "annotations" / "instances_train2017.json"


def test_a_clean_set_has_no_notes_and_exits_0(coco, capsys):
    root, _ = coco
    status, lines, _ = check(capsys, root)
    assert status == 0
    assert notes(lines) == [] and problems(lines) == []
    assert lines[-1] == "no problems found"


def test_a_truncated_jpeg_is_found_by_decoding_not_by_headers(coco, capsys):
    root, _ = coco
    path = root / "train2017" / "b.jpg"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    status, lines, error = check(capsys, root)
    assert status == 1
    assert len(problems(lines)) == 1
    assert problems(lines)[0].startswith(f"{path}: cannot read image: image file is truncated")
    assert problems(lines)[0].endswith("(image id 2; data.skip_bad_images=true skips it)")
    assert error == "error: 1 problem(s) found: training would stop at the first"

    status, lines, _ = check(capsys, root, "--headers-only")
    assert status == 0 and problems(lines) == [] and lines[-1] == "no problems found"

    status, lines, _ = check(capsys, root, "data.skip_bad_images=true")
    assert status == 0 and problems(lines) == []
    assert [n for n in notes(lines) if n.startswith(str(path))][0].endswith(
        "(image id 2); skipped in training (data.skip_bad_images)"
    )


def test_a_missing_image_is_a_problem_in_both_passes(coco, capsys):
    root, _ = coco
    path = root / "val2017" / "c.jpg"
    path.unlink()
    for args in ((), ("--headers-only",)):
        status, lines, _ = check(capsys, root, *args)
        assert status == 1
        assert problems(lines) == [f"{path}: image file not found (image id 1; data.skip_bad_images=true skips it)"]


def test_a_truncated_yolo_image_is_decoded_though_its_header_was_read(tmp_path, capsys):
    root = tmp_path / "yolo"
    for split in ("train", "val"):
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
        save_jpeg(root / "images" / split / "a.jpg")
        (root / "labels" / split / "a.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    (root / "data.yaml").write_text("train: images/train\nval: images/val\nnames: [circle]\n")
    path = root / "images" / "val" / "a.jpg"
    path.write_bytes(path.read_bytes()[:1100])
    status, lines, _ = check(capsys, root, kind="yolo")
    assert status == 1
    assert len(problems(lines)) == 1 and problems(lines)[0].startswith(f"{path}: cannot read image: image file is")
    status, lines, _ = check(capsys, root, "--headers-only", kind="yolo")
    assert status == 0


def test_an_annotation_of_no_listed_image_is_noted(coco, capsys):
    root, data = coco
    data["train"]["annotations"] += [box(7, 99), box(8, 98)]
    write(root, data)
    status, lines, _ = check(capsys, root)
    assert status == 0
    assert notes(lines) == [
        f"2 annotation(s) of {train_json(root)} name no listed image (never trained on nor evaluated): "
        "annotation id 7 (image id 99), annotation id 8 (image id 98)"
    ]


def test_images_listed_twice_are_noted(coco, capsys):
    root, data = coco
    data["train"]["images"] += [image_entry(3, "a.jpg"), image_entry(2, "b.jpg")]
    write(root, data)
    status, lines, _ = check(capsys, root)
    assert status == 0
    assert notes(lines) == [
        f"1 file(s) listed more than once in {train_json(root)} (trained on as often as listed): "
        "a.jpg (image ids 1, 3)",
        f"1 image id(s) listed more than once in {train_json(root)} (pycocotools keeps the last entry of each): "
        "image id 2 (2 times)",
    ]


def test_exif_turned_images_are_noted_with_the_frame_taken(coco, capsys):
    root, data = coco
    turned, kept = root / "train2017" / "a.jpg", root / "train2017" / "b.jpg"
    save_jpeg(turned, orientation=6)  # stored 40 x 30, displayed 30 x 40
    save_jpeg(kept, orientation=6)
    data["train"]["images"][0].update(width=30, height=40)  # annotated as a viewer shows it
    write(root, data)
    status, lines, _ = check(capsys, root)
    assert status == 0
    assert notes(lines) == [
        "1 image(s) carry an EXIF orientation: read as displayed (the recorded size is the displayed one): "
        f"{turned} (orientation 6)",
        "1 image(s) carry an EXIF orientation: read as stored (the recorded size is the stored one): "
        f"{kept} (orientation 6)",
    ]
    status, lines, _ = check(capsys, root, "data.exif_orientation=displayed")
    assert status == 0
    assert notes(lines) == [
        f"{kept}: 30 x 40 (displayed frame), but 40 x 30 in {train_json(root)}",
        "2 image(s) carry an EXIF orientation: read as displayed (data.exif_orientation: displayed): "
        f"{turned} (orientation 6), {kept} (orientation 6)",
    ]


def test_a_recorded_size_that_disagrees_is_noted(coco, capsys):
    root, data = coco
    data["val"]["images"][0].update(width=50)
    write(root, data)
    status, lines, _ = check(capsys, root, "--headers-only")
    assert status == 0
    val_json = root / "annotations" / "instances_val2017.json"
    assert notes(lines) == [f"{root / 'val2017' / 'c.jpg'}: 40 x 30 (stored frame), but 50 x 30 in {val_json}"]


def test_a_class_without_boxes_is_noted(coco, capsys):
    root, data = coco
    data["val"]["categories"].append({"id": 3, "name": "triangle"})
    data["val"]["annotations"] = [box(1, 1, 2)]
    write(root, data)
    status, lines, _ = check(capsys, root)
    assert status == 0
    assert notes(lines) == ['2 class(es) with no boxes to train on in val: "circle" (id 1), "triangle" (id 3)']


def test_a_class_name_in_several_spellings_is_noted(coco, capsys):
    root, data = coco
    data["train"]["categories"].append({"id": 3, "name": "Square "})
    data["train"]["annotations"] += [box(3, 2, 3), box(4, 2, 3)]
    write(root, data)
    status, lines, _ = check(capsys, root)
    assert status == 0
    assert notes(lines) == ['class "Square" merged from spellings "square" (1), "Square " (2)']
