"""A model meets a dataset's classes by name, as `--finetune` carries class-head rows: a model trained
on COCO-format shapes (ids 1..5) evaluated on the same images written as YOLO (0..4) or VOC (sorted
names) scores each class against that class's boxes."""


def match_classes(model_names: dict, dataset_names: dict) -> dict | None:
    """{model's category id: the dataset's id of the same name (ignoring case)}; None (ids are taken
    as they are) when either side names no classes or no name is shared. A model id whose name the
    dataset lacks is left out: its detections are of no class of the dataset."""
    dataset_ids = {}
    for category, name in sorted(dataset_names.items()):
        dataset_ids.setdefault(str(name).casefold(), category)
    matched = {
        category: dataset_ids[str(name).casefold()]
        for category, name in sorted(model_names.items())
        if str(name).casefold() in dataset_ids
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
