"""Read a config's dataset as training would, without training: every annotation and image header of
the train and val splits; print images and boxes per class, the boxes training drops, and every
problem found (each a line naming the file and line, or annotation).

    python -m deformable_detr.data.check --config CFG [section.key=value ...]

Exit status 1 when a problem would stop training (train.py stops at the first), else 0."""

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from PIL import Image
from tqdm import tqdm

from ..cli import ArgumentParser, entry_point
from ..config import load_config
from ..errors import CommandError
from . import DATASETS, build_dataset
from .coco import dropped_reason

BUILT_IN = ("coco", "shapes", "yolo", "voc")  # their builders take strict=False: every problem kept
SPLITS = ("train", "val")


@dataclass
class Report:
    """What a split holds: training targets and images per category id, the boxes training drops."""

    images: int = 0
    boxes: Counter = field(default_factory=Counter)
    images_per_class: dict = field(default_factory=lambda: defaultdict(set))
    crowd: int = 0  # iscrowd (VOC: difficult): evaluated, not trained on
    dropped: dict = field(default_factory=dict)  # reason -> [count, the first one's place]
    problems: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def drop(self, reason: str, where: str):
        self.dropped.setdefault(reason, [0, where])[0] += 1


def open_split(split: str, data_cfg):
    """The split read with every problem kept (built-in kinds), or as training builds it."""
    if data_cfg.dataset in BUILT_IN:
        return DATASETS[data_cfg.dataset](split, data_cfg, False, strict=False)
    return build_dataset(split, data_cfg, prepare=False)


def count_boxes(dataset, report: Report):
    """Boxes per class, crowd boxes, dropped boxes, from the split's ground truth (`dataset.coco`)."""
    images = dataset.coco.imgs
    report.images = len(images)
    for annotation in dataset.coco.anns.values():
        category, box = annotation.get("category_id"), annotation.get("bbox")
        image = images.get(annotation.get("image_id"))
        if not (isinstance(category, int) and isinstance(box, list) and len(box) == 4 and image is not None):
            continue  # a problem already listed (or an annotation of no listed image: never read)
        if annotation.get("iscrowd", 0):
            report.crowd += 1
            continue
        where = annotation.get("where") or f"{dataset.annotation_file}: annotation id {annotation.get('id')!r}"
        reason = dropped_reason(box, image.get("width", float("inf")), image.get("height", float("inf")))
        if reason:
            report.drop(reason, where)
        else:
            report.boxes[category] += 1
            report.images_per_class[category].add(annotation["image_id"])


def check_images(dataset, report: Report):
    """Every image's header: a missing or unreadable one stops training (unless data.skip_bad_images);
    a size other than the annotations' is noted."""
    if getattr(dataset, "headers_read", False):
        return  # the reader has read them all (YOLO)
    for info in tqdm(list(dataset.coco.imgs.values()), desc="image headers", leave=False, disable=None):
        path = dataset.image_dir / info["file_name"]
        try:
            with Image.open(path) as image:
                size = image.size
        except OSError as error:
            reason = "image file not found" if isinstance(error, FileNotFoundError) else f"cannot read image: {error}"
            if dataset.skip_bad_images:
                report.notes.append(f"{path}: {reason}; skipped in training (data.skip_bad_images)")
            else:
                report.problems.append(f"{path}: {reason} (image id {info['id']}; data.skip_bad_images=true skips it)")
            continue
        if "width" in info and size != (info["width"], info["height"]):
            recorded = f"{info['width']} x {info['height']}"
            report.notes.append(f"{path}: {size[0]} x {size[1]}, but {recorded} in {dataset.annotation_file}")


def check_split(split: str, data_cfg) -> tuple[object, Report]:
    """-> (the dataset or None when it cannot be read at all, its report)."""
    report = Report()
    try:
        dataset = open_split(split, data_cfg)
    except (OSError, ValueError) as error:
        report.problems.append(str(error))
        return None, report
    report.problems += list(getattr(dataset, "problems", []))
    report.notes += list(getattr(dataset, "notes", []))
    count_boxes(dataset, report)
    check_images(dataset, report)
    return dataset, report


def print_report(split: str, dataset, report: Report):
    if dataset is None:
        print(f"{split}: cannot be read")
    else:
        names = dataset.class_names()
        total = sum(report.boxes.values())
        print(f"{split}: {report.images} images, {total} boxes ({dataset.annotation_file})")
        print(f"  {'id':>5}  {'class':<24} {'images':>8} {'boxes':>8}")
        for category in sorted(set(names) | set(report.boxes)):
            images = len(report.images_per_class.get(category, ()))
            name = names.get(category, "(not in the category list)")
            print(f"  {category:>5}  {name:<24} {images:>8} {report.boxes[category]:>8}")
        print(f"  crowd or difficult boxes (evaluated, not trained on): {report.crowd}")
        dropped = ", ".join(f"{n} {reason} (first: {where})" for reason, (n, where) in report.dropped.items())
        print(f"  boxes dropped as training drops them: {dropped or 'none'}")
    for note in report.notes:
        print(f"  note: {note}")
    for problem in report.problems:
        print(f"  problem: {problem}")


@entry_point
def main(argv=None):
    parser = ArgumentParser(prog="python -m deformable_detr.data.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a YAML file of configs/")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as for train.py (e.g. data.path=...)")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    print(f"data.dataset {cfg.data.dataset}, at {cfg.data.path or cfg.data.coco_path}")
    problems = 0
    for split in SPLITS:
        dataset, report = check_split(split, cfg.data)
        print_report(split, dataset, report)
        problems += len(report.problems)
    if problems:
        raise CommandError(f"{problems} problem(s) found: train.py would stop at the first")
    print("no problems found")


if __name__ == "__main__":
    main()
