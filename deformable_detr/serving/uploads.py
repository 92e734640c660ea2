"""Uploaded images, decoded as the package reads image files (`data/images.py`: the same modes to RGB,
EXIF orientation, first frame, truncation and decompression-bomb errors), and the HTTP status of each
way an upload can be wrong.

    image = decode(body, "photo.jpg")  # RGB as a viewer shows it; ClientError(status, message) otherwise"""

import io

from PIL import Image, UnidentifiedImageError

from ..data.images import AVIF_BRANDS, HEIF_BRANDS, HEIF_READABLE, ImageFile, UnreadableImageError
from ..errors import install_hint


class ClientError(Exception):
    """What was wrong with a request, as its HTTP status and a one-line message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class ImageBytes(ImageFile):
    """`ImageFile` of an image held in memory: its header now, `rgb()` decodes as for a file. `path` is
    the name messages give it. Errors: 415 not an image, 413 too many pixels, 422 a broken header."""

    def __init__(self, data: bytes, name: str):
        self.path = name
        try:
            self._image = Image.open(io.BytesIO(data))
        except UnidentifiedImageError:
            raise ClientError(415, _unidentified(data, name)) from None
        except Image.DecompressionBombError as error:
            raise ClientError(413, f"{name}: too many pixels: {error}") from None
        except (OSError, SyntaxError, ValueError) as error:
            raise ClientError(422, f"{name}: cannot read image: {error}") from None
        self.format, self.mode, self.stored_size = self._image.format, self._image.mode, self._image.size
        self.orientation = self._orientation()


def decode(data: bytes, name: str) -> Image.Image:
    """The image in `data` as RGB in the displayed frame, carrying no EXIF (so `Detector.predict` does not
    turn it again). Truncated or corrupt pixel data: 422 (the request is well formed; the image is not)."""
    if not data:
        raise ClientError(400, f"{name}: empty: the body must be an image")
    try:
        image = ImageBytes(data, name).rgb("displayed")
    except UnreadableImageError as error:
        raise ClientError(422, str(error)) from None
    image.info = {}
    return image


def _unidentified(data: bytes, name: str) -> str:
    """Why Pillow does not identify `data`: a HEIF or AVIF image without its decoder, or no image."""
    brand = data[8:12] if data[4:8] == b"ftyp" else b""
    if brand in HEIF_BRANDS and not HEIF_READABLE:
        return f"{name}: a HEIC/HEIF image: reading it takes the heif extra ({install_hint('heif')})"
    if brand in AVIF_BRANDS:
        return f"{name}: an AVIF image this Pillow cannot decode ({install_hint('heif')} reads it)"
    return f"{name}: not an image: not a format Pillow (or an installed plugin) identifies"
