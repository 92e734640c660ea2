"""Uploaded images, decoded by the package's one image reader (`data/images.py`: the same modes to RGB,
EXIF orientation, first frame, truncation and decompression-bomb errors), the HTTP status of each way an
upload can be wrong, and the budget of decoded pixels the server holds at once.

    header = read_header(body, "photo.jpg")  # the header alone: its size; ClientError(status, message)
    with budget.reserved(decoding_cost(header)):    # 413 over the whole budget, OverBudget (503) over what is left
        image = decode(header)               # RGB as a viewer shows it; ClientError otherwise
    budget.return_memory()                   # once nothing refers to the image any more"""

import contextlib
import ctypes
import ctypes.util

from PIL import Image

from ..data.images import ImageFile, NotAnImageError, TooManyPixelsError, UnreadableImageError

ALPHA_MODES = {"RGBA", "RGBa", "LA", "La", "PA"}  # composited over white: RGBA copies on the way
WIDE_MODES = {"I", "F"}  # 32-bit values: converted through float64 arrays
# glibc keeps freed heap memory for reuse; after this many pixels are given back, malloc_trim returns it to
# the system (measured: a server at 131 MiB kept 424 after six 16 M-pixel uploads without it, 131 to 262 with
# it, by which threads decoded)
TRIM_AFTER_PIXELS = 16_000_000


class ClientError(Exception):
    """What was wrong with a request, as its HTTP status and a one-line message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class OverBudget(Exception):
    """The pixel budget is taken by images in flight now: try again later (503 with Retry-After)."""


def read_header(data: bytes, name: str) -> ImageFile:
    """The header of the image in `data` (format, size; nothing decoded). 400 empty, 415 not an image,
    413 over Pillow's pixel limit, 422 a header that cannot be read."""
    if not data:
        raise ClientError(400, f"{name}: empty: the body must be an image")
    with _client_errors():
        return ImageFile(data, name)


def decode(header: ImageFile) -> Image.Image:
    """The image `header` opened, decoded as RGB in the displayed frame: 413 too many pixels, 422 a truncated
    or corrupt image (the request is well formed; the image is not)."""
    with _client_errors():
        return header.rgb("displayed")


def decoding_cost(header: ImageFile) -> int:
    """What the image counts in the pixel budget (not its pixel count): its pixels, times what decoding one holds at
    its peak over an RGB one's 8 bytes (measured, Pillow 13: RGB 8, L and P 5, with alpha 20, 16-bit 22, 32-bit 36)."""
    width, height = header.stored_size
    if header.mode in WIDE_MODES:
        return width * height * 5
    if header.mode in ALPHA_MODES or header.transparency or header.mode.startswith("I;16"):
        return width * height * 3
    return width * height


@contextlib.contextmanager
def _client_errors():
    try:
        yield
    except NotAnImageError as error:
        raise ClientError(415, str(error)) from None
    except TooManyPixelsError as error:
        raise ClientError(413, str(error)) from None
    except UnreadableImageError as error:
        raise ClientError(422, str(error)) from None


class PixelBudget:
    """Decoded pixels held at once (images decoding, queued and in a forward), at most `limit`: each request
    reserves its images' pixels, read from their headers, before any is decoded, and gives them back once
    it is answered. Used on the event loop's thread alone."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self._given_back = 0  # pixels given back since the last trim
        self._trim = _malloc_trim()

    @contextlib.contextmanager
    def reserved(self, count: int):
        """Holds `count` pixels for the block: ClientError 413 where they are over the whole budget (never
        served), OverBudget where they are over what other requests leave now."""
        budget = f"the server's budget of {self.limit / 1e6:g} M (--max-megapixels)"
        if count > self.limit:
            raise ClientError(413, f"images counting {count / 1e6:.1f} M pixels (`pixels`) to decode: over {budget}")
        if self.held + count > self.limit:
            raise OverBudget(f"{self.held / 1e6:.1f} M pixels are being decoded or detected, {budget}: try again soon")
        self.held += count
        try:
            yield
        finally:
            self.held -= count
            self._given_back += count

    def return_memory(self) -> None:
        """Once TRIM_AFTER_PIXELS have been given back, returns the heap's free memory to the system: called
        where the images of those pixels are no longer referenced (after the request's answer is built)."""
        if self._given_back >= TRIM_AFTER_PIXELS and self._trim is not None:
            self._trim(0)
            self._given_back = 0

    @property
    def megapixels(self) -> float:
        return round(self.held / 1e6, 3)


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (macOS, musl)."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    return None
