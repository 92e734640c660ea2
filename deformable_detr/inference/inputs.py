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


def opened_batches(sources: list, batch_size: int, unreadable, key=None):
    """Batches of (order, path, image): each of `sources` (path, None) opened here, (None, image) as
    given; `order` counts the images opened. A file that does not open goes to `unreadable(path,
    error)`, which raises to stop or returns to leave it out; the next images fill its place.

    Without `key`, batches of `batch_size` in input order (the last may be short). With `key(image)`,
    a batch holds images of one key only, at most `batch_size`: each key's images wait for the next of
    theirs; a batch leaves when full, or, once more than WAITING_BATCHES batches' worth wait, the one of
    the longest-waiting image leaves short (so memory stays bounded); at the end the rest, oldest first."""
    waiting = {}  # key -> its waiting (order, path, image); dict order: that of each group's oldest image
    order = 0
    for path, image in sources:
        if image is None:
            try:
                image = open_image(path)
            except (FileNotFoundError, UnreadableImageError) as error:
                unreadable(path, error)
                continue
        group_key = None if key is None else key(image)
        waiting.setdefault(group_key, []).append((order, path, image))
        order += 1
        if len(waiting[group_key]) == batch_size:
            yield waiting.pop(group_key)
        elif sum(len(group) for group in waiting.values()) > WAITING_BATCHES * batch_size:
            yield waiting.pop(next(iter(waiting)))
    yield from waiting.values()


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
