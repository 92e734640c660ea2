"""Read a config's dataset as training would, without training: every annotation of the train and val
splits, and every image decoded fully as training decodes it (in a few threads; `--headers-only`: the
headers alone, fast, but blind to truncated data). Print images and boxes per class, the boxes training
drops, and every problem found (each a line naming the file and line, or annotation, or image id).
Notes, which do not stop training: annotations of no listed image, images listed twice, recorded sizes
other than the image's, EXIF-turned images and the frame each is read in, classes without boxes, class
names merged from several spellings.

    python -m deformable_detr.check --config CFG [--headers-only] [section.key=value ...]

Exit status 1 when a problem would stop training (train.py stops at the first), else 0."""

import os
from collections import Counter, defaultdict
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from ..config import load_config
from ..data import DATASETS, build_dataset, data_path
from ..data.coco import recorded_size
from ..data.ground_truth import box_counts
from ..data.images import ImageFile, UnreadableImageError
from ..errors import CommandError, entry_point
from .cli import command_parser

# their builders take strict=False: every problem kept
BUILT_IN = ("coco", "shapes", "small_shapes", "yolo", "voc", "createml")
SPLITS = ("train", "val")
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
    """One image as read: its header's sizes and EXIF orientation, the frame taken, or why it failed."""

    image_id: object
    path: Path
    recorded: tuple | None  # (width, height) the annotation file records
    frame: str = "stored"
    orientation: int = 1
    stored_size: tuple = (0, 0)
    displayed_size: tuple = (0, 0)
    error: str | None = None  # the reason it cannot be read (training stops on it, or skips it)

    @property
    def size(self) -> tuple:
        return self.displayed_size if self.frame == "displayed" else self.stored_size


def listed(items: list, limit: int = LISTED) -> str:
    """The first `limit` of `items`, then how many more."""
    more = f", ... ({len(items)} in all)" if len(items) > limit else ""
    return ", ".join(str(item) for item in items[:limit]) + more


def open_split(split: str, data_cfg):
    """The split read with every problem kept (built-in kinds), or as training builds it."""
    if data_cfg.dataset in BUILT_IN:
        return DATASETS[data_cfg.dataset](split, data_cfg, False, strict=False)
    return build_dataset(split, data_cfg, prepare=False)


def count_boxes(dataset, report: Report):
    """Boxes per class, crowd boxes, dropped boxes: the split as training and its evaluation count it
    (`ground_truth.box_counts`)."""
    counts = box_counts(dataset)
    report.images, report.crowd = len(dataset.coco.imgs), counts.crowd
    report.boxes, report.images_per_class = counts.per_class, counts.images_per_class
    report.dropped = {reason: [n, counts.first_dropped[reason]] for reason, n in counts.dropped.items()}


def failure_reason(error: Exception, facts: ImageFacts) -> str:
    """The reason alone: the reader's messages name the file, which the check's line names."""
    if isinstance(error, FileNotFoundError):
        return "image file not found"
    return str(error).removeprefix(f"{facts.path}: ")


def inspect_image(dataset, info: dict, decode: bool) -> ImageFacts:
    """The header of the image `info` names (sizes, orientation, the frame its recorded size asks for),
    then, with `decode`, the whole image decoded in that frame, as training reads it (`CocoDetection.
    read_image`: the same reader and rule), from the file opened once."""
    facts = ImageFacts(info["id"], dataset.image_dir / info["file_name"], recorded_size(info))
    try:
        with ImageFile(facts.path) as header:
            facts.frame = header.frame_for(facts.recorded, getattr(dataset, "exif_orientation", "auto"))
            facts.orientation = header.orientation
            facts.stored_size, facts.displayed_size = header.stored_size, header.displayed_size
            if decode:
                header.rgb(facts.frame)  # the pixels are dropped; only an error matters
    except (FileNotFoundError, UnreadableImageError) as error:
        facts.error = failure_reason(error, facts)
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


def frame_reason(facts: ImageFacts, rule: str, configured_rule: str) -> str:
    """Why an EXIF-turned image is read in the frame it is (`images.py` states the rule)."""
    if rule != "auto":
        return f"data.exif_orientation: {rule}" if rule == configured_rule else "the format's labels are in it"
    if facts.frame == "displayed":
        return "the recorded size is the displayed one"
    if facts.displayed_size == facts.stored_size:
        return "both frames are the same size: nothing tells them apart"
    if facts.recorded is None:
        return "no size recorded"
    if facts.recorded == facts.stored_size:
        return "the recorded size is the stored one"
    return "the recorded size is neither frame's"


def report_orientations(dataset, images: list[ImageFacts], report: Report, configured_rule: str):
    """EXIF-turned images (orientation 2-8), grouped by the frame taken and why."""
    rule = getattr(dataset, "exif_orientation", "auto")
    groups = defaultdict(list)
    for facts in images:
        if facts.error is None and facts.orientation != 1:
            reason = frame_reason(facts, rule, configured_rule)
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
    images = read_images(dataset, decode)
    report_unreadable(dataset, images, report)
    report_sizes(dataset, images, report)
    report_orientations(dataset, images, report, data_cfg.exif_orientation)
    report_orphans(dataset, report)
    report_duplicates(dataset, report)
    report_classes(dataset, split, report)
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
    parser = command_parser("check", __doc__)
    parser.add_argument("--config", required=True, help="a YAML file, or a shipped config's name (r50, shapes, ...)")
    parser.add_argument(
        "--headers-only", action="store_true", help="read image headers only (fast; misses truncated image data)"
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value, as for train.py (e.g. data.path=...)")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    print(f"data.dataset {cfg.data.dataset}, at {data_path(cfg.data)}")
    if cfg.data.dataset == "shapes" and not (Path(data_path(cfg.data)) / "annotations").exists():
        print(
            f"the shapes set is generated where it is absent, as training does: generating it in {data_path(cfg.data)}"
        )
        build_dataset("train", cfg.data, prepare=True)
    problems = 0
    for split in SPLITS:
        dataset, report = check_split(split, cfg.data, decode=not args.headers_only)
        print_report(split, dataset, report)
        problems += len(report.problems)
    if problems:
        raise CommandError(f"{problems} problem(s) found: training would stop at the first")
    print("no problems found")


if __name__ == "__main__":
    main()
