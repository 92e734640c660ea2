"""A COCO-format set (data/shapes.py's) written again as YOLO labels, as Pascal VOC XML and as Create ML
JSON, the way Ultralytics, the VOC devkit and Roboflow lay them out, for the readers' tests: the same
images and boxes, so every loader's targets can be compared with the COCO JSON loader's."""

import json
import shutil
from pathlib import Path


def coco_split(coco_root: Path, split: str) -> tuple[dict, dict]:
    """-> (the split's annotation file as a dict, {image id: its annotations})."""
    data = json.loads((Path(coco_root) / "annotations" / f"instances_{split}2017.json").read_text())
    by_image = {image["id"]: [] for image in data["images"]}
    for annotation in data["annotations"]:
        by_image[annotation["image_id"]].append(annotation)
    return data, by_image


def write_yolo(coco_root: Path, out: Path) -> Path:
    """out/images/{train,val}/, out/labels/{train,val}/*.txt (`class cx cy w h`, class = category id - 1,
    the shapes' ids being 1..5), out/data.yaml. Numbers as Python's shortest round-trip text."""
    out = Path(out)
    for split in ("train", "val"):
        data, by_image = coco_split(coco_root, split)
        for folder in ("images", "labels"):
            (out / folder / split).mkdir(parents=True, exist_ok=True)
        for image in data["images"]:
            shutil.copy(Path(coco_root) / f"{split}2017" / image["file_name"], out / "images" / split)
            width, height = image["width"], image["height"]
            lines = []
            for a in by_image[image["id"]]:
                x, y, w, h = a["bbox"]
                values = ((x + w / 2) / width, (y + h / 2) / height, w / width, h / height)
                lines.append(" ".join([str(a["category_id"] - 1), *map(repr, values)]))
            (out / "labels" / split / f"{Path(image['file_name']).stem}.txt").write_text("\n".join(lines) + "\n")
    names = [c["name"] for c in sorted(data["categories"], key=lambda c: c["id"])]
    (out / "data.yaml").write_text(f"path: .\ntrain: images/train\nval: images/val\nnc: {len(names)}\nnames: {names}\n")
    return out


def write_voc(coco_root: Path, out: Path, difficult=()) -> Path:
    """out/Annotations/<id>.xml, out/ImageSets/Main/{train,val}.txt, out/JPEGImages/<id>.png, image ids
    `<split>_<stem>` in the COCO file's order; boxes in the devkit's 1-based inclusive pixels; the
    annotations in `difficult`, (split, COCO annotation id) pairs, marked difficult."""
    out = Path(out)
    for folder in ("Annotations", "ImageSets/Main", "JPEGImages"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        data, by_image = coco_split(coco_root, split)
        names = {c["id"]: c["name"] for c in data["categories"]}
        ids = []
        for image in data["images"]:
            stem = f"{split}_{Path(image['file_name']).stem}"
            ids.append(stem)
            shutil.copy(Path(coco_root) / f"{split}2017" / image["file_name"], out / "JPEGImages" / f"{stem}.png")
            objects = []
            for a in by_image[image["id"]]:
                x, y, w, h = a["bbox"]
                flag = int((split, a["id"]) in difficult)
                objects.append(
                    f"  <object>\n    <name>{names[a['category_id']]}</name>\n    <difficult>{flag}</difficult>\n"
                    f"    <bndbox>\n      <xmin>{x + 1}</xmin>\n      <ymin>{y + 1}</ymin>\n"
                    f"      <xmax>{x + w}</xmax>\n      <ymax>{y + h}</ymax>\n    </bndbox>\n  </object>\n"
                )
            (out / "Annotations" / f"{stem}.xml").write_text(
                f"<annotation>\n  <filename>{stem}.png</filename>\n"
                f"  <size><width>{image['width']}</width><height>{image['height']}</height><depth>3</depth></size>\n"
                + "".join(objects)
                + "</annotation>\n"
            )
        (out / "ImageSets" / "Main" / f"{split}.txt").write_text("\n".join(ids) + "\n")
    return out


def write_createml(coco_root: Path, out: Path, val_folder: str = "valid") -> Path:
    """Roboflow's Create ML export: out/train/, out/<val_folder>/, each the split's images and
    `_annotations.createml.json`, an entry per image in the COCO file's order, each box's centre and
    size in pixels."""
    out = Path(out)
    for split, folder in (("train", "train"), ("val", val_folder)):
        data, by_image = coco_split(coco_root, split)
        names = {c["id"]: c["name"] for c in data["categories"]}
        (out / folder).mkdir(parents=True, exist_ok=True)
        entries = []
        for image in data["images"]:
            shutil.copy(Path(coco_root) / f"{split}2017" / image["file_name"], out / folder)
            boxes = []
            for a in by_image[image["id"]]:
                x, y, w, h = a["bbox"]
                centre = {"x": x + w / 2, "y": y + h / 2, "width": w, "height": h}
                boxes.append({"label": names[a["category_id"]], "coordinates": centre})
            entries.append({"image": image["file_name"], "annotations": boxes})
        (out / folder / "_annotations.createml.json").write_text(json.dumps(entries))
    return out
