"""Pascal VOC's layout read into COCO's format: `ImageSets/Main/{train,val}.txt` (an image id a line),
`Annotations/<id>.xml` (`size`, and per `object`: `name`, `difficult`, `bndbox` xmin, ymin, xmax,
ymax), `JPEGImages/` (the XML's `filename`, else `<id>.jpg`).

- Category ids: 0, 1, ... in the sorted order of the `name`s of both splits' files (names that differ
  only in case are one class, named by its most frequent spelling: classes.py). Sorted because
  VOC's own 20 classes are listed alphabetically by its devkit (VOCinit.m: aeroplane, bicycle, ...),
  so VOC itself gets its usual ids; both splits, so train and val agree whichever classes each holds.
- Boxes: the devkit's pixel indices are 1-based and inclusive, so a box covers x in [xmin - 1, xmax]
  (as Detectron2 reads VOC): x = xmin - 1, width = xmax - xmin + 1.
- `difficult` boxes are not training targets and are ignored by the evaluation, as by VOC's own
  metric: in the ground truth they are COCO's `iscrowd` 1 (which COCO AP ignores: a detection on one
  is neither a true nor a false positive; COCO measures that overlap by the detection's area)."""

import math
from collections import Counter
from pathlib import Path

from .classes import chosen_spelling, spelling_groups
from .files import read_xml
from .images import ImageFile, UnreadableImageError
from .in_memory import ParsedSplit

SPLITS = ("train", "val")


def image_list(root: Path, split: str) -> tuple[Path, list[tuple[int, str]]]:
    """-> (ImageSets/Main/<split>.txt, [(line number, image id)])."""
    listing = root / "ImageSets" / "Main" / f"{split}.txt"
    for path in (root / "Annotations", listing):
        if not path.exists():
            raise FileNotFoundError(f"VOC {split} split: {path} does not exist (data.path is {root})")
    try:
        lines = listing.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise ValueError(f"{listing}: not UTF-8 text, so not a list of image ids (byte {error.start})") from None
    return listing, [(number, line.split()[0]) for number, line in enumerate(lines, 1) if line.strip()]


def _number(element, tag: str, path) -> float:
    """The number in `element`'s child `tag`; a ValueError naming the file and line when there is none."""
    child = element.find(tag)
    try:
        value = float(child.text)
    except (AttributeError, ValueError):
        where = f"{path}, line {(child or element).line}"
        got = "missing" if child is None else repr(child.text)
        raise ValueError(f"{where}: <{element.tag}> <{tag}> is {got}, not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{path}, line {child.line}: <{tag}> {child.text!r} is not finite")
    return value


def read_objects(path: Path) -> tuple[object, list[dict]]:
    """One annotation file -> (its root element, [{name, box x0 y0 x1 y1 as written, difficult, line}])."""
    root = read_xml(path)
    objects = []
    for element in root.find_all("object"):
        name = element.find("name")
        if name is None or not name.text:
            raise ValueError(f"{path}, line {element.line}: <object> without a <name>")
        box = element.find("bndbox")
        if box is None:
            raise ValueError(f"{path}, line {element.line}: <object> {name.text!r} without a <bndbox>")
        coordinates = [_number(box, tag, path) for tag in ("xmin", "ymin", "xmax", "ymax")]
        difficult = element.find("difficult")
        if difficult is not None and difficult.text not in ("", "0", "1"):
            raise ValueError(f"{path}, line {difficult.line}: <difficult> {difficult.text!r} is not 0 or 1")
        flag = difficult is not None and difficult.text == "1"
        objects.append({"name": name.text, "box": coordinates, "difficult": flag, "line": element.line})
    return root, objects


def image_size(root, path: Path, image_path: Path, exif_orientation: str = "auto") -> tuple[int, int]:
    """(width, height) from the XML's <size>, else from the image's header (in the frame it is read in)."""
    size = root.find("size")
    try:
        width, height = int(_number(size, "width", path)), int(_number(size, "height", path))
    except (AttributeError, ValueError):
        width = height = 0
    if width > 0 and height > 0:
        return width, height
    try:
        with ImageFile(image_path) as header:
            return header.size_in(header.frame_for(None, exif_orientation))
    except (OSError, UnreadableImageError) as error:  # missing or not an image
        raise ValueError(f"{image_path}: cannot read the image for its size ({path} gives none): {error}") from None


def class_spellings(root: Path) -> Counter:
    """Counter(name as written: objects) of both splits' annotation files, in the order met (unreadable
    files skipped here: reading their split names them)."""
    spellings = Counter()
    for split in SPLITS:
        listing = root / "ImageSets" / "Main" / f"{split}.txt"
        if not listing.is_file():
            continue
        for _, image_id in image_list(root, split)[1]:
            try:
                spellings.update(o["name"] for o in read_objects(root / "Annotations" / f"{image_id}.xml")[1])
            except (OSError, ValueError):
                continue
    return spellings


def class_names(root: Path) -> tuple[dict[int, str], dict[str, int], dict[int, Counter]]:
    """-> ({id: name}: the sorted names of both splits' classes, each its most frequent spelling (names
    that differ only in case are one class: classes.py), {spelling: id}, {id: Counter(spelling: objects)}
    of the classes written several ways)."""
    groups = spelling_groups(class_spellings(root))
    names = sorted((chosen_spelling(group), group) for group in groups.values())
    ids = {spelling: i for i, (_, group) in enumerate(names) for spelling in group}
    several = {i: group for i, (_, group) in enumerate(names) if len(group) > 1}
    return {i: name for i, (name, _) in enumerate(names)}, ids, several


def read_voc(path, split: str, exif_orientation: str = "auto") -> ParsedSplit:
    """The `split` ("train" or "val") of the VOC set in the folder `path` (holding Annotations/)."""
    root = Path(path)
    listing, image_ids = image_list(root, split)
    names, ids, spellings = class_names(root)
    parsed = ParsedSplit(split, listing, root / "JPEGImages", {"images": [], "annotations": [], "categories": []})
    parsed.data["categories"] = [{"id": i, "name": name} for i, name in names.items()]
    parsed.exif_orientation = exif_orientation
    parsed.spellings = spellings
    for number, name in image_ids:
        xml = root / "Annotations" / f"{name}.xml"
        if not xml.is_file():
            parsed.problems.append(f"{xml}: no such annotation file for image {name!r} ({listing}, line {number})")
            continue
        try:
            tree, objects = read_objects(xml)
            file_name = getattr(tree.find("filename"), "text", "") or f"{name}.jpg"
            width, height = image_size(tree, xml, parsed.image_dir / file_name, exif_orientation)
        except ValueError as error:
            parsed.problems.append(str(error))
            continue
        image_id = len(parsed.data["images"]) + 1
        parsed.data["images"].append({"id": image_id, "file_name": file_name, "width": width, "height": height})
        for o in objects:
            x0, y0, x1, y1 = o["box"]
            box = [x0 - 1, y0 - 1, x1 - x0 + 1, y1 - y0 + 1]
            parsed.data["annotations"].append(
                {
                    "id": len(parsed.data["annotations"]) + 1,
                    "image_id": image_id,
                    "category_id": ids[o["name"]],
                    "bbox": box,
                    "area": box[2] * box[3],
                    "iscrowd": int(o["difficult"]),
                    "where": f"{xml}, line {o['line']}",
                }
            )
    return parsed
