"""What detection takes: image files, folders of them, globs; arrays and PIL images."""

import glob
from pathlib import Path

import numpy as np
from PIL import Image

from ..data.images import IMAGE_SUFFIXES, ImageFile, UnreadableImageError, as_displayed, read_image
from ..errors import UsageError

VIDEO_SUFFIXES = {".mp4", ".mov", ".avi", ".mkv", ".webm", ".m4v"}
WAITING_BATCHES = 4  # grouped by key: at most this many batches' worth of images wait for others of their key


def find_inputs(arguments: list) -> list[Path]:
    """Each argument: a file as given, a folder's images (sorted), or a glob's matches (sorted)."""
    found = []
    for argument in arguments:
        path = Path(argument)
        if path.is_dir():
            images = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
            if not images:
                raise UsageError(f"{path}: a folder with no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
            found += images
        elif not path.exists() and glob.has_magic(str(argument)):
            matches = sorted(Path(p) for p in glob.glob(str(argument)) if Path(p).is_file())
            if not matches:
                raise UsageError(f"{argument}: no file matches")
            found += matches
        elif not path.is_file():
            raise FileNotFoundError(f"{path}: no such image file")
        else:
            found.append(path)
    return found


def open_image(path: Path) -> Image.Image:
    """The image at `path` in RGB as a viewer shows it (EXIF orientation applied: `data/images.py`);
    FileNotFoundError or a ValueError (`UnreadableImageError`) naming it otherwise."""
    return read_image(path, "displayed")


class Unreadable:
    """The skip-unreadable rule, for `Detector.predict` and the predict command alike: a file that cannot be read
    (FileNotFoundError, `UnreadableImageError`) stops the work, its error naming it and `hint`, how to go on
    without it (`skip_unreadable=True`, `--skip-unreadable`); with `skip`, it is left out: "skipped: <the error>"
    goes to `report` and (path, reason) to `skipped`, in order."""

    ERRORS = (FileNotFoundError, UnreadableImageError)

    def __init__(self, skip: bool, hint: str, report):
        self.skip, self.hint, self.report, self.skipped = skip, hint, report, []

    def __call__(self, path, error) -> None:
        if not self.skip:
            raise type(error)(f"{error}; {self.hint} leaves such images out") from None
        self.skipped.append((path, str(error).removeprefix(f"{path}: ")))
        self.report(f"skipped: {error}")

    def read(self, path, reader):
        """`reader(path)`, or None where the file cannot be read (and the rule lets it go)."""
        try:
            return reader(path)
        except self.ERRORS as error:
            self(path, error)
            return None


def grouped(items, key, batch_size: int):
    """The grouping rule, in one place: `items` (an iterable) in batches of one `key(item)` each
    (`Detector.batch_key`: the images a forward takes unpadded), at most `batch_size`, each in input order.
    Each key's items wait for the next of theirs; a batch leaves when full, or, once more than
    WAITING_BATCHES batches' worth wait, the one of the longest-waiting item leaves short (so memory stays
    bounded); at the end the rest, oldest first."""
    waiting = {}  # key -> its waiting items; dict order: that of each group's oldest item
    for item in items:
        group_key = key(item)
        waiting.setdefault(group_key, []).append(item)
        if len(waiting[group_key]) == batch_size:
            yield waiting.pop(group_key)
        elif sum(len(group) for group in waiting.values()) > WAITING_BATCHES * batch_size:
            yield waiting.pop(next(iter(waiting)))
    yield from waiting.values()


def opened_batches(sources: list, batch_size: int, unreadable: Unreadable, key):
    """`grouped` batches of (order, path, image): each of `sources` (path, None) opened here, (None, image) as
    given, grouped by `key(image)`; `order` counts the images opened. A file that does not open goes to the
    `unreadable` rule, which raises to stop or leaves it out; the next images fill its place."""

    def opened():
        order = 0
        for path, image in sources:
            image = unreadable.read(path, open_image) if image is None else image
            if image is not None:
                yield order, path, image
                order += 1

    return grouped(opened(), lambda item: key(item[2]), batch_size)


def displayed_size(path: Path) -> tuple[int, int]:
    """(width, height) of the image at `path` as a viewer shows it, from its header alone."""
    with ImageFile(path) as header:
        return header.displayed_size


def as_image(item) -> Image.Image:
    """A PIL image (turned by its EXIF orientation where it still carries one), or an (H, W, 3) /
    (H, W, 4) / (H, W) uint8 array (RGB, as PIL and imageio give them), as RGB."""
    if isinstance(item, Image.Image):
        return as_displayed(item)
    array = np.asarray(item)
    if array.dtype != np.uint8 or not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))):
        raise ValueError(
            f"an image array must be (H, W, 3) RGB, (H, W, 4) or (H, W) uint8; got {array.shape} {array.dtype}"
        )
    return as_displayed(Image.fromarray(array))
