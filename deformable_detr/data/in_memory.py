"""Sets whose annotations are not COCO JSON (YOLO, Pascal VOC): read into COCO's format in memory, then
served and evaluated exactly as a COCO file would be (`CocoDetection`'s sampling, `dataset.coco`)."""

import contextlib
import io
from dataclasses import dataclass, field
from pathlib import Path

from .coco import CocoDetection
from .images import ImageFile, UnreadableImageError, unreadable_reason


@dataclass
class ParsedSplit:
    """A split read by a format's reader, before anything checks it.

    `data` is COCO's format: `images` (id, file_name relative to `image_dir` or absolute, width,
    height), `annotations` (id, image_id, category_id, bbox x, y, width, height in pixels, area,
    iscrowd: 1 for what is evaluated but not trained on, VOC's `difficult`), `categories` (id, name).
    `problems`: one line each, naming the file (and line), what stops training (the first is raised);
    `notes`: what `deformable_detr.check` prints but does not stop (images without labels, images left out)."""

    split: str  # "train" or "val"
    source: Path  # what messages name: the annotation file, data.yaml, the image list
    image_dir: Path
    data: dict
    problems: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    headers_read: bool = False  # every image's header read already (its size): the check need not
    exif_orientation: str = "auto"  # the frame rule its images are read by (data.exif_orientation)
    spellings: dict = field(default_factory=dict)  # {category id: Counter(spelling: boxes)}, classes.py

    def header_size(self, image_path: Path, frame: str, skip_bad_images: bool, where: str = ""):
        """(width, height) of the image in `frame`, from its header (formats that record no size); None
        where it is missing or cannot be read: a problem, or with `skip_bad_images` a note (left out),
        naming the image and `where` (the entry listing it), if given."""
        try:
            with ImageFile(image_path) as header:
                return header.size_in(frame)
        except (FileNotFoundError, UnreadableImageError) as error:
            reason = unreadable_reason(error, image_path)
        listed = (f" ({where})", f"{where}; ") if where else ("", "")
        if skip_bad_images:
            self.notes.append(f"{image_path}: {reason}{listed[0]}; left out (data.skip_bad_images)")
        else:
            self.problems.append(f"{image_path}: {reason} ({listed[1]}data.skip_bad_images=true leaves it out)")
        return None


def coco_from_dict(data: dict):
    """A pycocotools COCO of `data` (COCO's format) without a file, quietly."""
    from pycocotools.coco import COCO

    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress
        coco.createIndex()
    return coco


class InMemoryDetection(CocoDetection):
    """`CocoDetection` over a `ParsedSplit`: the first problem found is raised (a ValueError naming
    the file and line; a split without images is one) unless `strict` is False (the check command
    lists them all)."""

    def __init__(self, split: ParsedSplit, transforms=None, skip_bad_images: bool = False, strict: bool = True):
        # CocoDetection's state, from the parsed split instead of a JSON file
        self.image_dir = Path(split.image_dir)
        self.annotation_file = split.source
        self.problems, self.notes = list(split.problems), list(split.notes)
        self.headers_read = split.headers_read
        if not split.data["images"]:
            self.problems.append(f"{split.source}: the {split.split} split has no images")
        if strict and self.problems:
            raise ValueError(self.problems[0])
        self.coco = coco_from_dict(split.data)
        self.ids = sorted(self.coco.imgs)
        self.transforms = transforms
        self.skip_bad_images = skip_bad_images
        self.exif_orientation = split.exif_orientation
        self.spellings = split.spellings
