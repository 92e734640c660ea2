"""COCO-format detection sets read with pycocotools, augmented per sample."""

import contextlib
import io
import math
from pathlib import Path

import numpy as np

from .classes import merge_classes
from .files import read_json
from .images import BadImageError, ImageFile, UnreadableImageError
from .transforms import normalize

# The 80 COCO detection categories at their ids (1..90, with gaps), as in instances_val2017.json:
# the classes of the authors' checkpoints (91 outputs, index = category id).
COCO_CATEGORY_NAMES = dict(
    zip(
        [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)],
        [
            name.replace("_", " ")
            for name in "person bicycle car motorcycle airplane bus train truck boat traffic_light fire_hydrant "
            "stop_sign parking_meter bench bird cat dog horse sheep cow elephant bear zebra giraffe backpack "
            "umbrella handbag tie suitcase frisbee skis snowboard sports_ball kite baseball_bat baseball_glove "
            "skateboard surfboard tennis_racket bottle wine_glass cup fork knife spoon bowl banana apple "
            "sandwich orange broccoli carrot hot_dog pizza donut cake chair couch potted_plant bed "
            "dining_table toilet tv laptop mouse remote keyboard cell_phone microwave oven toaster sink "
            "refrigerator book clock vase scissors teddy_bear hair_drier toothbrush".split()
        ],
        strict=True,
    )
)


def annotation_problems(data: dict, annotation_file, split: str = ""):
    """Before any step: every image an id and a file_name, every category id a non-negative integer
    (a negative one would index the class outputs from the end and train silently; a string stops a
    step with a TypeError), every bbox four finite numbers, some images. Yields each problem as a
    line naming the file, the image, annotation (or category) and the value."""
    if not isinstance(data, dict):
        yield f"{annotation_file}: expected a JSON object (images, annotations, categories), got {type(data).__name__}"
        return
    for image in data.get("images", []):
        if not (isinstance(image, dict) and _is_number(image.get("id")) and isinstance(image.get("file_name"), str)):
            yield f"{annotation_file}: image {image!r}: expected an id and a file_name"
    for category in data.get("categories", []):
        if not (isinstance(category, dict) and _is_index(category.get("id")) and "name" in category):
            yield f"{annotation_file}: category {category!r}: expected a name and an id, a non-negative integer"
    for annotation in data.get("annotations", []):
        if not isinstance(annotation, dict):
            yield f"{annotation_file}: annotation {annotation!r} is not a JSON object"
            continue
        where = f"{annotation_file}: annotation id {annotation.get('id')!r}"
        if "image_id" not in annotation or "id" not in annotation:
            yield f"{where}: expected an id and an image_id"
        if not _is_index(annotation.get("category_id")):
            yield f"{where}: category_id {annotation.get('category_id')!r} is not a non-negative integer"
        box = annotation.get("bbox")
        if not (isinstance(box, list) and len(box) == 4 and all(_is_number(v) and math.isfinite(v) for v in box)):
            yield f"{where}: bbox {box!r} is not four finite numbers (x, y, width, height)"
    if not data.get("images"):
        yield f"{annotation_file}: the {split} split has no images"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_index(value) -> bool:
    return _is_number(value) and isinstance(value, int) and value >= 0


def dropped_reason(box, width, height) -> str | None:
    """Why training drops a box (x, y, w, h) of an image of this size, as `CocoDetection.load` clips
    and drops: None when it is kept."""
    x, y, w, h = box
    if w <= 0 or h <= 0:
        return "zero size"
    if min(x + w, width) <= max(x, 0) or min(y + h, height) <= max(y, 0):
        return "outside the image"
    return None


def recorded_size(info: dict):
    """(width, height) an annotation file records for an image, or None."""
    width, height = info.get("width"), info.get("height")
    return (int(width), int(height)) if _is_number(width) and _is_number(height) else None


def image_size(image_dir, info: dict, exif_orientation: str = "auto") -> tuple[int, int]:
    """(width, height) of an image: the annotation file's, else its header's in the frame it is read in
    (FileNotFoundError or UnreadableImageError where it cannot be had)."""
    recorded = recorded_size(info)
    if recorded is not None:
        return recorded
    with ImageFile(Path(image_dir) / info["file_name"]) as header:
        return header.size_in(header.frame_for(None, exif_orientation))


class CocoDetection:
    """`root/{split}2017/` images and `root/annotations/instances_{split}2017.json`. Crowd boxes are
    dropped, boxes clipped to the image, degenerate boxes removed (as the authors). An EXIF-tagged
    photo is read in the frame whose size the file records (`exif_orientation`: data.exif_orientation,
    `images.py`)."""

    def __init__(
        self,
        root,
        split: str,
        transforms=None,
        skip_bad_images: bool = False,
        strict: bool = True,
        exif_orientation: str = "auto",
    ):
        root = Path(root)
        self.image_dir = root / f"{split}2017"
        self.annotation_file = root / "annotations" / f"instances_{split}2017.json"
        for path in (self.image_dir, self.annotation_file):
            if not path.exists():
                raise FileNotFoundError(f"COCO {split} split: {path} does not exist (data.path is {root})")
        from pycocotools.coco import COCO

        data = read_json(self.annotation_file)  # not JSON: the file, line and column
        # strict: stop at the first problem; else keep them all for the check command
        self.problems, self.notes = list(annotation_problems(data, self.annotation_file, split)), []
        if strict and self.problems:
            raise ValueError(self.problems[0])
        # names that differ only in case or surrounding space: one class (classes.py)
        self.spellings = merge_classes(data) if isinstance(data, dict) else {}
        self.coco = COCO()
        self.coco.dataset = data if isinstance(data, dict) else {}
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(KeyError, TypeError):
            self.coco.createIndex()  # pycocotools prints its progress; malformed entries: listed problems
        self.ids = sorted(self.coco.imgs)
        self.transforms = transforms
        self.skip_bad_images = skip_bad_images
        self.exif_orientation = exif_orientation

    def __len__(self):
        return len(self.ids)

    def image_sizes(self) -> list[tuple[int, int]]:
        """(width, height) of every image, from the annotation file (or the image's header, in the
        frame it is read in)."""
        return [image_size(self.image_dir, self.coco.imgs[i], self.exif_orientation) for i in self.ids]

    def read_image(self, image_id):
        """The image `image_id` decoded as RGB in the frame its recorded size names (a BadImageError
        naming the file and image id where it is missing or cannot be decoded)."""
        info = self.coco.imgs[image_id]
        path = self.image_dir / info["file_name"]
        try:
            with ImageFile(path) as header:
                return header.rgb(header.frame_for(recorded_size(info), self.exif_orientation))
        except (FileNotFoundError, UnreadableImageError) as error:
            raise BadImageError.of(error, path, image_id) from None

    def class_names(self) -> dict[int, str]:
        """{category id: name} of the annotation file's `categories`."""
        return {int(c["id"]): str(c["name"]) for c in self.coco.cats.values()}

    def class_spellings(self) -> dict[int, dict[str, int]]:
        """{category id: {spelling: boxes}} for each class whose name came in several spellings that
        differ only in case or surrounding space (merged into one class: `classes.py`); {} when none."""
        return dict(self.spellings)

    def max_category_id(self) -> int:
        """The largest category id of the annotations and the category list (-1 when both are empty)."""
        ids = [a["category_id"] for a in self.coco.anns.values()] + list(self.coco.cats)
        return int(max(ids, default=-1))

    def load(self, index: int):
        """-> (PIL RGB image, target with `boxes` x0, y0, x1, y1 pixels, `labels`, `image_id`, `orig_size`)."""
        image_id = self.ids[index]
        image = self.read_image(image_id)
        width, height = image.size
        annotations = [a for a in self.coco.imgToAnns.get(image_id, []) if not a.get("iscrowd", 0)]
        boxes = np.array([a["bbox"] for a in annotations], dtype=np.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes[:, 0::2] = boxes[:, 0::2].clip(0, width)
        boxes[:, 1::2] = boxes[:, 1::2].clip(0, height)
        labels = np.array([a["category_id"] for a in annotations], dtype=np.int64)
        keep = (boxes[:, 3] > boxes[:, 1]) & (boxes[:, 2] > boxes[:, 0])
        target = {
            "boxes": boxes[keep],
            "labels": labels[keep],
            "image_id": image_id,
            "orig_size": np.array([height, width], np.int64),
        }
        return image, target

    def sample(self, index: int, rng: np.random.Generator):
        """-> (pixels (H, W, 3) normalised, target with boxes cx, cy, w, h normalised, `size`)."""
        image, target = self.load(index)
        if self.transforms is not None:
            image, target = self.transforms(image, target, rng)
        pixels, target = normalize(image, target)
        return pixels, {**target, "size": np.array(pixels.shape[:2], np.int64)}
