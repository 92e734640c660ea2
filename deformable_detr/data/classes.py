"""Classes by name. Names that differ only in case or surrounding space are one class (`class_key`):
"Dog", "dog " and "dog" in one set are one class, named by its most frequent spelling among the boxes
(ties: the first met), and a model meets a dataset's classes, or fine-tuning its weights' classes,
by the same key. A model trained on COCO-format shapes (ids 1..5) evaluated on the same images written
as YOLO (0..4) or VOC (sorted names) scores each class against that class's boxes."""

from collections import Counter


def class_key(name) -> str:
    """What two spellings of one class share: the name without surrounding space, case folded."""
    return str(name).strip().casefold()


def spelling_groups(spellings: Counter) -> dict[str, Counter]:
    """{class_key: Counter(spelling: boxes)} of `spellings` (Counter(spelling: boxes), in the order met)."""
    groups = {}
    for spelling, boxes in spellings.items():
        groups.setdefault(class_key(spelling), Counter())[spelling] += boxes
    return groups


def chosen_spelling(group: Counter) -> str:
    """A class's name: its most frequent spelling among the boxes, the first met on a tie."""
    return max(group, key=lambda spelling: (group[spelling], -list(group).index(spelling))).strip()


def merge_classes(data: dict) -> dict[int, Counter]:
    """COCO-format `data` (categories, annotations) with the categories whose names share a `class_key`
    merged in place into the lowest of their ids, named by `chosen_spelling`; the annotations' category
    ids follow. -> {kept id: Counter(spelling: boxes)} for each class that had several spellings."""
    categories = [c for c in data.get("categories", []) if isinstance(c, dict) and isinstance(c.get("id"), int)]
    categories = [c for c in categories if "name" in c]
    boxes = Counter(a.get("category_id") for a in data.get("annotations", []) if isinstance(a, dict))
    members = {}  # class_key -> the categories of that class, lowest id first
    for category in sorted(categories, key=lambda c: c["id"]):
        members.setdefault(class_key(category["name"]), []).append(category)
    merged, moved = {}, {}
    for group in members.values():
        spellings = Counter()
        for category in group:
            spellings[str(category["name"])] += boxes[category["id"]]
        if len(spellings) < 2 and len(group) < 2:
            continue
        kept = group[0]
        kept["name"] = chosen_spelling(spellings)
        merged[kept["id"]] = spellings
        moved |= {category["id"]: kept["id"] for category in group[1:]}
    if moved:
        data["categories"] = [c for c in data["categories"] if not (isinstance(c, dict) and c.get("id") in moved)]
        for annotation in data.get("annotations", []):
            if isinstance(annotation, dict) and annotation.get("category_id") in moved:
                annotation["category_id"] = moved[annotation["category_id"]]
    return merged


def match_classes(model_names: dict, dataset_names: dict) -> dict | None:
    """{model's category id: the dataset's id of the same name (by `class_key`)}; None (ids are taken
    as they are) when either side names no classes or no name is shared. A model id whose name the
    dataset lacks is left out: its detections are of no class of the dataset."""
    dataset_ids = {}
    for category, name in sorted(dataset_names.items()):
        dataset_ids.setdefault(class_key(name), category)
    matched = {
        category: dataset_ids[class_key(name)]
        for category, name in sorted(model_names.items())
        if class_key(name) in dataset_ids
    }
    return matched or None


def to_dataset_classes(detections: list, class_map: dict | None) -> list:
    """COCO results with the model's category ids replaced by the dataset's (`match_classes`); those
    of a model class the dataset does not have are left out. None: unchanged."""
    if class_map is None:
        return detections
    return [{**d, "category_id": class_map[d["category_id"]]} for d in detections if d["category_id"] in class_map]


def describe_match(model_names: dict, dataset_names: dict, class_map: dict | None, source) -> list[str]:
    """Lines for eval.py: which ids changed, and the dataset's classes the model has no name for
    (their AP is 0), or why ids are compared as they are."""
    if class_map is None:
        if model_names and dataset_names:
            return [f"warning: no class name of the model is one of {source}'s: category ids compared as they are"]
        return []
    lines = []
    moved = [f"{model_names[m]} {m} -> {d}" for m, d in class_map.items() if m != d]
    if moved:
        lines.append(f"classes met by name (model id -> {source}'s id): {', '.join(moved)}")
    missing = [f"{name} ({i})" for i, name in sorted(dataset_names.items()) if i not in set(class_map.values())]
    if missing:
        lines.append(f"warning: the model has no class named {', '.join(missing)} of {source}: their AP is 0")
    return lines
