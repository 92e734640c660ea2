"""Uploaded images, decoded by the package's one image reader (`data/images.py`: the same modes to RGB,
EXIF orientation, first frame, truncation and decompression-bomb errors), and the HTTP status of each
way an upload can be wrong.

    image = decode(body, "photo.jpg")  # RGB as a viewer shows it; ClientError(status, message) otherwise"""

from PIL import Image

from ..data.images import ImageFile, NotAnImageError, TooManyPixelsError, UnreadableImageError


class ClientError(Exception):
    """What was wrong with a request, as its HTTP status and a one-line message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def decode(data: bytes, name: str) -> Image.Image:
    """The image in `data` as RGB in the displayed frame. 400 empty, 415 not an image, 413 too many pixels,
    422 a truncated or corrupt image (the request is well formed; the image is not)."""
    if not data:
        raise ClientError(400, f"{name}: empty: the body must be an image")
    try:
        return ImageFile(data, name).rgb("displayed")
    except NotAnImageError as error:
        raise ClientError(415, str(error)) from None
    except TooManyPixelsError as error:
        raise ClientError(413, str(error)) from None
    except UnreadableImageError as error:
        raise ClientError(422, str(error)) from None
