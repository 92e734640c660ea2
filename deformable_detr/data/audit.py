"""A dataset audited as training would read it, without training: `check_split(split, data_cfg)` reads
every annotation of the split and every image (decoded fully as training decodes it, in a few threads;
`decode=False`: the headers alone, fast, but blind to truncated data) and returns a `Report`.

    from deformable_detr.config import load_config
    from deformable_detr.data.audit import check_split

    dataset, report = check_split("train", load_config("custom.yaml").data)
    report.problems  # [] where training would start; else each a line (the first stops training)

A `Report` holds the images and boxes per class, the crowd boxes, the boxes training drops (each
reason with its count and first place), `problems` (what stops training: each a line naming the
file and line, annotation or image id) and `notes` (what does not: annotations of no listed image,
images listed twice, recorded sizes other than the image's, EXIF-turned images and the frame each is
read in, classes without boxes, class names merged from several spellings). The check command
(`deformable-detr check`) prints one per split."""

import os
from collections import Counter, defaultdict
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from . import build_dataset
from .coco import recorded_size
from .ground_truth import box_counts
from .images import ImageFile, UnreadableImageError, unreadable_reason

THREADS = min(4, max(2, os.cpu_count() or 2))  # Pillow releases the GIL while decoding
LISTED = 5  # a note about many images or annotations names the first few (a broken set has thousands)


@dataclass
class Report:
    """What a split holds: training targets and images per category id, the boxes training drops."""

    images: int = 0
    boxes: Counter = field(default_factory=Counter)
    images_per_class: dict = field(default_factory=dict)  # category id -> image ids
    crowd: int = 0  # iscrowd (VOC: difficult): evaluated, not trained on
    dropped: dict = field(default_factory=dict)  # reason -> [count, the first one's place]
    problems: list = field(default_factory=list)
    notes: list = field(default_factory=list)


@dataclass
class ImageFacts:
    """One image as read: its EXIF orientation, the frame taken and why, its size in it, or why it failed."""

    image_id: object
    path: Path
    recorded: tuple | None  # (width, height) the annotation file records
    frame: str = "stored"
    why: str = ""  # why that frame (`ImageFile.frame_and_reason`)
    orientation: int = 1
    size: tuple = (0, 0)  # (width, height) in `frame`
    error: str | None = None  # the reason it cannot be read (training stops on it, or skips it)


def listed(items: list, limit: int = LISTED) -> str:
    """The first `limit` of `items`, then how many more."""
    more = f", ... ({len(items)} in all)" if len(items) > limit else ""
    return ", ".join(str(item) for item in items[:limit]) + more


def count_boxes(dataset, report: Report):
    """Boxes per class, crowd boxes, dropped boxes: the split as training and its evaluation count it
    (`ground_truth.box_counts`)."""
    counts = box_counts(dataset)
    report.images, report.crowd = len(dataset.coco.imgs), counts.crowd
    report.boxes, report.images_per_class = counts.per_class, counts.images_per_class
    report.dropped = {reason: [n, counts.first_dropped[reason]] for reason, n in counts.dropped.items()}


def inspect_image(dataset, info: dict, decode: bool) -> ImageFacts:
    """The header of the image `info` names (orientation, the frame its recorded size asks for, the size
    in it), then, with `decode`, the whole image decoded in that frame, as training reads it
    (`CocoDetection.read_image`: the same reader and rule), from the file opened once."""
    facts = ImageFacts(info["id"], dataset.image_dir / info["file_name"], recorded_size(info))
    try:
        with ImageFile(facts.path) as header:
            rule = getattr(dataset, "exif_orientation", "auto")
            facts.frame, facts.why = header.frame_and_reason(facts.recorded, rule)
            facts.orientation, facts.size = header.orientation, header.size_in(facts.frame)
            if decode:
                header.rgb(facts.frame)  # the pixels are dropped; only an error matters
    except (FileNotFoundError, UnreadableImageError) as error:
        facts.error = unreadable_reason(error, facts.path)  # the reason alone: the check's line names the file
    return facts


def read_images(dataset, decode: bool) -> list[ImageFacts]:
    """Every image of the split, `inspect_image`d in THREADS threads, with a progress bar."""
    infos = list(dataset.coco.imgs.values())
    desc = "decoding images" if decode else "image headers"
    with ThreadPoolExecutor(THREADS) as pool:
        facts = pool.map(lambda info: inspect_image(dataset, info, decode), infos)
        return list(tqdm(facts, total=len(infos), desc=desc, leave=False, disable=None))


def report_unreadable(dataset, images: list[ImageFacts], report: Report):
    """A missing or undecodable image stops training, unless data.skip_bad_images skips it."""
    for facts in images:
        if facts.error is None:
            continue
        where = f"{facts.path}: {facts.error} (image id {facts.image_id}"
        if dataset.skip_bad_images:
            report.notes.append(f"{where}); skipped in training (data.skip_bad_images)")
        else:
            report.problems.append(f"{where}; data.skip_bad_images=true skips it)")


def report_sizes(dataset, images: list[ImageFacts], report: Report):
    """Recorded sizes other than the image's in the frame it is read in: boxes are clipped to the image
    read, so boxes drawn on another size land elsewhere."""
    for facts in images:
        if facts.error is None and facts.recorded is not None and facts.size != facts.recorded:
            width, height = facts.size
            recorded = f"{facts.recorded[0]} x {facts.recorded[1]}"
            report.notes.append(
                f"{facts.path}: {width} x {height} ({facts.frame} frame), but {recorded} in {dataset.annotation_file}"
            )


def report_orientations(dataset, images: list[ImageFacts], report: Report, configured_rule: str):
    """EXIF-turned images (orientation 2-8), grouped by the frame taken and why (`images.py` states the
    rule; a format whose labels are in one frame (YOLO, Create ML) sets its own)."""
    rule = getattr(dataset, "exif_orientation", "auto")
    groups = defaultdict(list)
    for facts in images:
        if facts.error is None and facts.orientation != 1:
            reason = facts.why if rule in ("auto", configured_rule) else "the format's labels are in it"
            groups[facts.frame, reason].append(f"{facts.path} (orientation {facts.orientation})")
    for (frame, reason), paths in groups.items():
        report.notes.append(
            f"{len(paths)} image(s) carry an EXIF orientation: read as {frame} ({reason}): {listed(paths)}"
        )


def report_orphans(dataset, report: Report):
    """Annotations whose image_id names no listed image: never trained on nor evaluated."""
    images = dataset.coco.imgs
    orphans = [
        f"annotation id {a.get('id')!r} (image id {a['image_id']!r})"
        for a in dataset.coco.anns.values()
        if "image_id" in a and not (isinstance(a["image_id"], Hashable) and a["image_id"] in images)
    ]
    if orphans:
        report.notes.append(
            f"{len(orphans)} annotation(s) of {dataset.annotation_file} name no listed image "
            f"(never trained on nor evaluated): {listed(orphans)}"
        )


def report_duplicates(dataset, report: Report):
    """A file listed under several image ids (trained on as often), and an image id listed several
    times in the images list (pycocotools keeps the last entry, and gives it every entry's boxes)."""
    ids_per_file = defaultdict(list)
    for image_id, info in dataset.coco.imgs.items():
        ids_per_file[info.get("file_name")].append(image_id)
    files = [f"{name} (image ids {', '.join(map(str, ids))})" for name, ids in ids_per_file.items() if len(ids) > 1]
    if files:
        report.notes.append(
            f"{len(files)} file(s) listed more than once in {dataset.annotation_file} (trained on as often as "
            f"listed): {listed(files)}"
        )
    entries = [i for i in dataset.coco.dataset.get("images", []) if isinstance(i, dict) and "id" in i]
    times = Counter(i["id"] for i in entries if isinstance(i["id"], Hashable))
    repeated = [f"image id {image_id!r} ({n} times)" for image_id, n in times.items() if n > 1]
    if repeated:
        report.notes.append(
            f"{len(repeated)} image id(s) listed more than once in {dataset.annotation_file} (pycocotools keeps "
            f"the last entry of each): {listed(repeated)}"
        )


def report_classes(dataset, split: str, report: Report):
    """Classes without a box to train on in this split, and class names merged from several spellings."""
    names = dataset.class_names()
    empty = [f'"{names[category]}" (id {category})' for category in sorted(names) if not report.boxes[category]]
    if empty:
        report.notes.append(f"{len(empty)} class(es) with no boxes to train on in {split}: {', '.join(empty)}")
    spellings = dataset.class_spellings() if hasattr(dataset, "class_spellings") else {}
    for category, counts in sorted(spellings.items()):
        merged = ", ".join(f'"{spelling}" ({boxes})' for spelling, boxes in counts.items())
        report.notes.append(f'class "{names.get(category, category)}" merged from spellings {merged}')


def check_split(split: str, data_cfg, decode: bool = True) -> tuple[object, Report]:
    """The `split` ("train" or "val") of the dataset `data_cfg` (a config's `data` section) names,
    audited: -> (the dataset, or None where it cannot be read at all; its `Report`). Every problem is
    kept (`build_dataset(strict=False)`), not the first raised; `decode=False` reads image headers only.
    A set that is absent is not generated here (the check command generates the shapes set first)."""
    report = Report()
    try:
        dataset = build_dataset(split, data_cfg, prepare=False, strict=False)
    except (OSError, ValueError) as error:
        report.problems.append(str(error))
        return None, report
    report.problems += list(getattr(dataset, "problems", []))
    report.notes += list(getattr(dataset, "notes", []))
    count_boxes(dataset, report)
    images = read_images(dataset, decode)
    report_unreadable(dataset, images, report)
    report_sizes(dataset, images, report)
    report_orientations(dataset, images, report, data_cfg.exif_orientation)
    report_orphans(dataset, report)
    report_duplicates(dataset, report)
    report_classes(dataset, split, report)
    return dataset, report
