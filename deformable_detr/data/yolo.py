"""YOLO text labels, as Ultralytics lays them out (and Roboflow exports them), read into COCO's format.

`data.yaml`: `path` (the dataset's root; relative: to the YAML's folder; absent: that folder),
`train` and `val` (each a folder of images, searched recursively, a .txt list of image paths,
relative to the list's folder, or a list of these; relative to `path`), `names` (a list, or a
mapping {index: name}), `nc` (optional, checked). An image's labels are the .txt file at its path
with the last `images` folder replaced by `labels`: one line per box, `class cx cy w h`, the class
a 0-based index into `names` and the box normalised to the image's width and height. A segmentation
line, `class x1 y1 x2 y2 x3 y3 ...` (Ultralytics' seg format, Roboflow's polygon export), is its
polygon's bounding box, as Ultralytics reads it; in a pose set (data.yaml has `kpt_shape`) a line's
keypoints after the box are ignored. Both are counted in the notes. An image without a label file
has no boxes, as Ultralytics reads it.

Category ids are the class indices; names those of data.yaml. Every image's header is read (its
size turns normalised boxes into pixels): one that cannot be read is a problem, or with
`data.skip_bad_images` is left out. Labels are in the frame a viewer shows (EXIF orientation
applied, as Ultralytics reads them; data.exif_orientation `stored`: the pixels as stored)."""

import math
from collections import Counter
from pathlib import Path

from .classes import merge_classes
from .files import read_yaml
from .images import IMAGE_SUFFIXES
from .in_memory import ParsedSplit


def find_data_yaml(path) -> Path:
    """`path` itself, or the data.yaml in the folder `path`."""
    path = Path(path)
    if path.is_dir():
        for name in ("data.yaml", "data.yml"):
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(f"{path}: no data.yaml in this folder (data.path: YOLO's data.yaml or its folder)")
    if not path.is_file():
        raise FileNotFoundError(f"YOLO data.yaml {path} does not exist (data.path)")
    return path


def read_names(names, yaml_path) -> dict[int, str]:
    """data.yaml's `names`: a list (index: name) or a mapping of integer indices to names."""
    if isinstance(names, list):
        names = dict(enumerate(names))
    if not isinstance(names, dict) or not names:
        raise ValueError(f"{yaml_path}: names {names!r}: expected a list of class names (or a mapping index: name)")
    for index, name in names.items():
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"{yaml_path}: names: key {index!r} is not a non-negative integer")
        if not isinstance(name, (str, int, float)) or isinstance(name, bool):
            raise ValueError(f"{yaml_path}: names: {index}: {name!r} is not a name")
    return {index: str(name) for index, name in sorted(names.items())}


def read_data_yaml(yaml_path: Path) -> tuple[dict, Path, dict[int, str]]:
    """-> (data.yaml's mapping, the dataset's root, {class index: name})."""
    data = read_yaml(yaml_path)
    if not isinstance(data, dict):
        raise ValueError(f"{yaml_path}: expected a mapping with train, val and names, got {type(data).__name__}")
    names = read_names(data.get("names"), yaml_path)
    if "nc" in data and data["nc"] != len(names):
        raise ValueError(f"{yaml_path}: nc is {data['nc']!r} but names has {len(names)} entries")
    root = yaml_path.parent / data["path"] if data.get("path") else yaml_path.parent
    return data, root, names


def split_images(data: dict, split: str, root: Path, yaml_path: Path) -> list[Path]:
    """The images of data.yaml's `split` entry, sorted."""
    entries = data.get(split)
    if not entries:
        raise ValueError(f"{yaml_path}: no {split!r} entry (the {split} split's images: a folder or a .txt list)")
    images = []
    for entry in entries if isinstance(entries, list) else [entries]:
        path = root / str(entry)
        if not path.exists() and str(entry).startswith("../"):  # Roboflow's data.yaml: ../train/images
            path = root / str(entry)[3:]
        if path.is_dir():
            images += [p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()]
        elif path.is_file():  # a list of images, relative to its folder
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}: not UTF-8 text, so not a list of images (byte {error.start})") from None
            images += [path.parent / line.strip() for line in lines if line.strip()]
        else:
            raise FileNotFoundError(f"{yaml_path}: {split}: {path} does not exist")
    return sorted(set(images))


def label_path(image: Path) -> Path:
    """Ultralytics' rule: the last `images` folder of the path becomes `labels`, the suffix `.txt`."""
    parts = list(image.parts)
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] == "images":
            parts[i] = "labels"
            break
    return Path(*parts).with_suffix(".txt")


def parse_label_line(fields: list[str], names: dict, pose: bool = False) -> tuple[int, list[float], str]:
    """`class cx cy w h` -> (class index, [cx, cy, w, h], "box"); a polygon `class x1 y1 ... xn yn` (3 or
    more points) -> its bounding box, "polygon"; with `pose`, `class cx cy w h` and keypoints -> the box,
    "pose". A ValueError says what is wrong."""
    kind = "box" if len(fields) == 5 else "pose" if pose and len(fields) > 5 else "polygon"
    if kind == "polygon" and (len(fields) < 7 or len(fields) % 2 == 0):
        raise ValueError(
            f"expected 5 fields 'class cx cy w h' or a polygon 'class x1 y1 x2 y2 x3 y3 ...', got {len(fields)}"
        )
    try:
        values = [float(f) for f in fields]
    except ValueError:
        bad = next(f for f in fields if not _is_float(f))
        raise ValueError(f"{bad!r} is not a number") from None
    if not all(math.isfinite(v) for v in values):
        raise ValueError("a value is not finite")
    if not values[0].is_integer():
        raise ValueError(f"class {fields[0]!r} is not an integer")
    if int(values[0]) not in names:
        raise ValueError(f"class {int(values[0])} is not one of the {len(names)} names (0..{max(names)})")
    if kind != "polygon":
        return int(values[0]), values[1:5], kind
    xs, ys = values[1::2], values[2::2]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    return int(values[0]), [(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], kind


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def read_labels(path: Path, names: dict, width: int, height: int, problems: list, pose: bool = False) -> list[dict]:
    """The boxes of one label file as COCO annotations (pixels; unclipped, as a COCO file would hold
    them; "kind": box, polygon or pose, as `parse_label_line`); each line that does not parse becomes a
    problem naming the file and line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        problems.append(f"{path}: not UTF-8 text (byte {error.start})")
        return []
    annotations = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            category, (cx, cy, w, h), kind = parse_label_line(line.split(), names, pose)
        except ValueError as error:
            problems.append(f"{path}, line {number}: {error}: {line.strip()!r}")
            continue
        box = [(cx - w / 2) * width, (cy - h / 2) * height, w * width, h * height]
        annotations.append(
            {
                "category_id": category,
                "bbox": box,
                "area": box[2] * box[3],
                "iscrowd": 0,
                "where": f"{path}, line {number}",
                "kind": kind,
            }
        )
    return annotations


def read_yolo(path, split: str, skip_bad_images: bool = False, exif_orientation: str = "auto") -> ParsedSplit:
    """The `split` ("train" or "val") of the YOLO set whose data.yaml is `path` (or in the folder `path`);
    images in the displayed frame unless `exif_orientation` is "stored"."""
    yaml_path = find_data_yaml(path)
    data, root, names = read_data_yaml(yaml_path)
    parsed = ParsedSplit(split, yaml_path, root, {"images": [], "annotations": [], "categories": []})
    parsed.headers_read = True
    frame = "stored" if exif_orientation == "stored" else "displayed"
    parsed.exif_orientation = frame  # the recorded sizes are this frame's: every image is read in it
    parsed.data["categories"] = [{"id": i, "name": name} for i, name in names.items()]
    unlabelled = []
    for image_path in split_images(data, split, root, yaml_path):
        size = parsed.header_size(image_path, frame, skip_bad_images)
        if size is None:
            continue
        width, height = size
        image_id = len(parsed.data["images"]) + 1
        file_name = image_path.relative_to(root) if image_path.is_relative_to(root) else image_path
        parsed.data["images"].append({"id": image_id, "file_name": str(file_name), "width": width, "height": height})
        labels = label_path(image_path)
        if not labels.is_file():
            unlabelled.append(labels)
            continue
        for annotation in read_labels(labels, names, width, height, parsed.problems, "kpt_shape" in data):
            annotation.update(id=len(parsed.data["annotations"]) + 1, image_id=image_id)
            parsed.data["annotations"].append(annotation)
    parsed.spellings = merge_classes(parsed.data)  # names that differ only in case: one class
    read_as = Counter(a["kind"] for a in parsed.data["annotations"] if a["kind"] != "box")
    if read_as["polygon"]:
        parsed.notes.append(
            f"{read_as['polygon']} label line(s) are segmentation polygons: each read as its bounding box "
            "(as Ultralytics reads them)"
        )
    if read_as["pose"]:
        parsed.notes.append(f"{read_as['pose']} label line(s) carry keypoints (kpt_shape): their boxes read")
    if unlabelled:
        parsed.notes.append(
            f"{len(unlabelled)} image(s) without a label file, so without boxes (as Ultralytics reads them): "
            f"{unlabelled[0]}{', ...' if len(unlabelled) > 1 else ''}"
        )
    return parsed
