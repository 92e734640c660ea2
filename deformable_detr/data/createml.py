"""Apple's Create ML object-detection JSON, as Roboflow exports it, read into COCO's format.

Layout: `data.path` is a folder holding `train/` and `valid/` (Roboflow's name; `val/` is taken too,
but not both), each with its images and one Create ML JSON file: `_annotations.createml.json` (Roboflow's
name), else the folder's only `.json` file. Roboflow's `test/` is not read (train and val are the splits).
The file is a list, an entry per image:

    [{"image": "a.jpg",
      "annotations": [{"label": "cat", "coordinates": {"x": 120, "y": 80, "width": 60, "height": 40}}]}]

`image` is relative to the JSON file's folder; `x`, `y` are the box's centre and `width`, `height` its
size, in the image's pixels. An image without boxes has `"annotations": []`; image files the list does not
name are not read (the check notes them).

- Category ids: 0, 1, ... in the sorted order of the labels of both splits' files, as `voc.py` numbers
  VOC's names (names that differ only in case or surrounding space are one class, named by its most
  frequent spelling: classes.py); both splits, so train and val agree whichever classes each holds.
- Image ids: the entry's place in the list, counted from 1, as every message counts entries and
  annotations, so an id in a message finds its entry.
- Sizes: the file records none, so every image's header is read (one that is missing or cannot be
  read is a problem, or with `data.skip_bad_images` is left out), in the frame a viewer shows (EXIF
  orientation applied, as Create ML and Roboflow's annotator show a photo; data.exif_orientation
  `stored`: the pixels as stored).
- Problems, each naming the file, the entry (and its image) and the annotation: not JSON, not a list,
  an entry or annotation that is not an object, a missing key (`image`, `annotations`, `label`,
  `coordinates`, `x`, `y`, `width`, `height`), a coordinate that is not a finite number, a negative
  width or height. Boxes of zero size or outside the image are dropped and counted, as for every format
  (`ground_truth.py`; the check names the first of each)."""

import math
from collections import Counter
from pathlib import Path

from .classes import chosen_spelling, spelling_groups
from .files import read_json
from .images import IMAGE_SUFFIXES
from .in_memory import ParsedSplit

ANNOTATION_FILE = "_annotations.createml.json"  # Roboflow's name for a split's Create ML file
SPLIT_FOLDERS = {"train": ("train",), "val": ("valid", "val")}  # Roboflow's names first
COORDINATES = ("x", "y", "width", "height")


def split_folder(root: Path, split: str) -> Path:
    """The folder of `split` in the set `root`: train/, valid/ or val/."""
    if not root.is_dir():
        raise FileNotFoundError(f"Create ML set {root} is not a folder (data.path: the folder holding train/, valid/)")
    found = [root / name for name in SPLIT_FOLDERS[split] if (root / name).is_dir()]
    if not found:
        wanted = " or ".join(f"{root / name}/" for name in SPLIT_FOLDERS[split])
        raise FileNotFoundError(f"Create ML {split} split: no {wanted} (data.path is {root})")
    if len(found) > 1:
        raise ValueError(f"Create ML {split} split: both {found[0]}/ and {found[1]}/: keep one (data.path is {root})")
    return found[0]


def annotation_file(folder: Path) -> Path:
    """The split's Create ML JSON: Roboflow's `_annotations.createml.json`, else the folder's only .json."""
    if (folder / ANNOTATION_FILE).is_file():
        return folder / ANNOTATION_FILE
    candidates = sorted(p for p in folder.iterdir() if p.suffix.lower() == ".json" and p.is_file())
    if not candidates:
        raise FileNotFoundError(f"{folder}: no Create ML JSON file ({ANNOTATION_FILE} or another .json)")
    if len(candidates) > 1:
        names = ", ".join(p.name for p in candidates)
        raise ValueError(f"{folder}: several .json files ({names}): name the Create ML one {ANNOTATION_FILE}")
    return candidates[0]


def json_type(value) -> str:
    """What a JSON value is, in JSON's words."""
    if isinstance(value, bool) or value is None:
        return json_value(value)
    kinds = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}
    return kinds.get(type(value), type(value).__name__)


def json_value(value) -> str:
    """`value` as the JSON file writes it (true, null, "text"), for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if not isinstance(value, str) else '"' + value + '"'


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_entries(path: Path) -> list:
    """The file's list of entries; not JSON or not a list: a ValueError naming the file."""
    entries = read_json(path)  # not JSON: the file, line and column
    if not isinstance(entries, list):
        raise ValueError(
            f'{path}: expected a list of images ([{{"image": ..., "annotations": [...]}}, ...]), '
            f"got {json_type(entries)}"
        )
    return entries


def text_field(item, keys: tuple[str, str], where: str, meaning: str, kind: str) -> str:
    """`item[keys[0]]`, text that is not blank; a ValueError naming `where` where `item` is no object
    (one with both `keys` expected), lacks the key (`meaning`: what it holds) or its value is no `kind`."""
    key = keys[0]
    if not isinstance(item, dict):
        raise ValueError(f'{where}: expected an object with "{key}" and "{keys[1]}", got {json_type(item)}')
    if key not in item:
        raise ValueError(f'{where}: no "{key}" ({meaning})')
    value = item[key]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f'{where}: "{key}" {json_value(value)} is not {kind}')
    return value


def entry_image(entry, where: str) -> str:
    """The entry's image file name; a ValueError naming the entry where it has none."""
    return text_field(entry, ("image", "annotations"), where, "the image file's name", "a file name")


def entry_annotations(entry: dict, where: str) -> list:
    """The entry's list of annotations; a ValueError naming the entry where it is missing or no list."""
    if "annotations" not in entry:
        raise ValueError(f'{where}: no "annotations" (a list of boxes; [] for none)')
    if not isinstance(entry["annotations"], list):
        raise ValueError(f'{where}: "annotations" is {json_type(entry["annotations"])}, not a list')
    return entry["annotations"]


def annotation_label(annotation, where: str) -> str:
    """An annotation's label; a ValueError naming it where it is not an object with a name."""
    return text_field(annotation, ("label", "coordinates"), where, "the class name", "a class name")


def annotation_box(annotation: dict, where: str) -> list[float]:
    """COCO's [x0, y0, width, height] in pixels of a Create ML box (centre x, y, width, height); a
    ValueError naming the annotation and the coordinate that is missing, not a number or negative."""
    coordinates = annotation.get("coordinates")
    if coordinates is None:
        raise ValueError(f'{where}: no "coordinates" ({{"x", "y", "width", "height"}}, in pixels)')
    if not isinstance(coordinates, dict):
        raise ValueError(f'{where}: "coordinates" is {json_type(coordinates)}, not an object')
    values = []
    for key in COORDINATES:
        if key not in coordinates:
            raise ValueError(f'{where}: coordinates: no "{key}"')
        value = coordinates[key]
        if not _is_number(value):
            raise ValueError(f'{where}: coordinates: "{key}" {json_value(value)} is not a number')
        if not math.isfinite(value):
            raise ValueError(f'{where}: coordinates: "{key}" {value} is not finite')
        values.append(value)
    x, y, width, height = values
    for key, value in (("width", width), ("height", height)):
        if value < 0:
            raise ValueError(f'{where}: coordinates: "{key}" {json_value(value)} is negative')
    return [x - width / 2, y - height / 2, width, height]


def read_item(item, where: str, name_of, rest_of, problems: list) -> tuple[str, str, object] | None:
    """An entry (or annotation) read: `name_of` its image (or label), then `rest_of` its annotations (or
    box) -> (`where`, now naming it; the name; the rest); None where either fails, its ValueError's
    message (what is wrong, and where) added to `problems`."""
    try:
        name = name_of(item, where)
        where = f"{where} ({json_value(name)})"
        return where, name, rest_of(item, where)
    except ValueError as error:
        problems.append(str(error))
        return None


def add_annotations(parsed: ParsedSplit, annotations: list, where: str, image_id: int, ids: dict):
    """The entry's annotations (at `where`, of the image `image_id`) into `parsed`, as COCO's, the
    category of each label its id in `ids`; each that cannot be read a problem."""
    for place, annotation in enumerate(annotations, 1):
        read = read_item(annotation, f"{where}, annotation {place}", annotation_label, annotation_box, parsed.problems)
        if read is None:
            continue
        at, label, box = read
        parsed.data["annotations"].append(
            {
                "id": len(parsed.data["annotations"]) + 1,
                "image_id": image_id,
                "category_id": ids[label],
                "bbox": box,
                "area": box[2] * box[3],
                "iscrowd": 0,
                "where": at,
            }
        )


def class_spellings(root: Path) -> Counter:
    """Counter(label as written: boxes) of both splits' files, in the order met (a split or entry that
    cannot be read is skipped here: reading its split names it)."""
    spellings = Counter()
    for split in SPLIT_FOLDERS:
        try:
            entries = read_entries(annotation_file(split_folder(root, split)))
        except (OSError, ValueError):
            continue
        for entry in entries:
            annotations = entry.get("annotations") if isinstance(entry, dict) else None
            for annotation in annotations if isinstance(annotations, list) else []:
                label = annotation.get("label") if isinstance(annotation, dict) else None
                if isinstance(label, str) and label.strip():
                    spellings[label] += 1
    return spellings


def class_names(root: Path) -> tuple[dict[int, str], dict[str, int], dict[int, Counter]]:
    """-> ({id: name}: the sorted labels of both splits, each class its most frequent spelling,
    {spelling: id}, {id: Counter(spelling: boxes)} of the classes written several ways); voc.py's rule."""
    groups = spelling_groups(class_spellings(root))
    names = sorted((chosen_spelling(group), group) for group in groups.values())
    ids = {spelling: i for i, (_, group) in enumerate(names) for spelling in group}
    several = {i: group for i, (_, group) in enumerate(names) if len(group) > 1}
    return {i: name for i, (name, _) in enumerate(names)}, ids, several


def read_createml(path, split: str, skip_bad_images: bool = False, exif_orientation: str = "auto") -> ParsedSplit:
    """The `split` ("train" or "val") of the Create ML set in the folder `path`; images in the displayed
    frame unless `exif_orientation` is "stored"."""
    root = Path(path)
    folder = split_folder(root, split)
    source = annotation_file(folder)
    entries = read_entries(source)
    names, ids, spellings = class_names(root)
    parsed = ParsedSplit(split, source, folder, {"images": [], "annotations": [], "categories": []})
    parsed.data["categories"] = [{"id": i, "name": name} for i, name in names.items()]
    parsed.headers_read = True
    frame = "stored" if exif_orientation == "stored" else "displayed"
    parsed.exif_orientation = frame  # the sizes below are this frame's: every image is read in it
    parsed.spellings = spellings
    listed = set()
    for number, entry in enumerate(entries, 1):
        read = read_item(entry, f"{source}, entry {number}", entry_image, entry_annotations, parsed.problems)
        if read is None:
            continue
        where, name, annotations = read
        image_path = folder / name
        listed.add(image_path)
        size = parsed.header_size(image_path, frame, skip_bad_images, where)
        if size is None:
            continue
        width, height = size
        parsed.data["images"].append({"id": number, "file_name": name, "width": width, "height": height})
        add_annotations(parsed, annotations, where, number, ids)
    unlisted = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p not in listed)
    if unlisted:
        more = ", ..." if len(unlisted) > 1 else ""
        parsed.notes.append(
            f"{len(unlisted)} image file(s) in {folder} that {source.name} does not list (not read): "
            f"{unlisted[0]}{more}"
        )
    return parsed
