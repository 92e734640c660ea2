"""What detection takes: image files, folders of them, globs; arrays and PIL images."""

import glob
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..errors import UsageError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
VIDEO_SUFFIXES = {".mp4", ".mov", ".avi", ".mkv", ".webm", ".m4v"}


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


def open_image(path: Path, header_only: bool = False) -> Image.Image:
    """The image at `path` in RGB (`header_only`: opened, not decoded); an error naming it otherwise."""
    try:
        with Image.open(path) as image:
            return image if header_only else image.convert("RGB")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such image file") from None
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"{path}: cannot read it as an image ({error})") from None


def as_image(item) -> Image.Image:
    """A PIL image, or an (H, W, 3) / (H, W) uint8 array (RGB, as PIL and imageio give them), as RGB."""
    if isinstance(item, Image.Image):
        return item.convert("RGB")
    array = np.asarray(item)
    if array.dtype != np.uint8 or not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))):
        raise ValueError(
            f"an image array must be (H, W, 3) RGB, (H, W, 4) or (H, W) uint8; got {array.shape} {array.dtype}"
        )
    return Image.fromarray(array).convert("RGB")
