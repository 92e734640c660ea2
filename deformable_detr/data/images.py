"""The one image reader: every dataset, `deformable_detr.check`, `predict`, `Detector` and evaluation open image
files here, so a file is read the same way everywhere.

    header = ImageFile(path)                      # the header only: format, size, EXIF orientation
    frame = header.frame_for((width, height))     # the frame an annotation file's recorded size means
    image = header.rgb(frame)                     # decoded fully, turned into that frame, as RGB
    image = read_image(path)                      # the same in one call, as a viewer shows it

**Frames.** A camera stores the sensor's pixels and an EXIF orientation tag (1-8); viewers, annotation
tools and Ultralytics show the image turned by it: the *displayed* frame. The *stored* frame is the
pixels as they are in the file. Images given to `predict` / `Detector` and YOLO sets are read in the
displayed frame. COCO and VOC files record each image's size, which says which frame their boxes are
in: `frame_for` takes the displayed frame where the recorded size is the displayed size and not the
stored one (a 90-degree photo annotated as seen), else the stored frame. Where both sizes are equal
(orientations 2, 3, 4, or a square image) nothing tells them apart and the stored frame is taken:
that is how the authors' pipeline (and torchvision, and pycocotools' COCO) read COCO, whose
annotations were drawn on the stored pixels of its EXIF-tagged photos. `data.exif_orientation`
overrides the rule: `displayed` or `stored` for every image.

**Modes to RGB** (what Pillow opens, as the pixels look):
- 16-bit grayscale (I;16*): divided by 257 and rounded (65535 -> 255, as OpenCV's reader scales),
  not clipped; 16-bit colour PNG and TIFF: Pillow's decoder keeps each sample's high byte (v // 256,
  within 1 of v / 257).
- 32-bit integer (I): as 16-bit where every value is in 0..65535 (16-bit files Pillow opens as I);
  otherwise stretched linearly from the image's own minimum (0) to its maximum (255).
- 32-bit float (F): values in [0, 1] times 255; otherwise stretched from minimum to maximum; NaN as 0.
- CMYK: through its embedded ICC profile to sRGB where it has one (littleCMS), else Pillow's
  conversion; CIELab: to sRGB (littleCMS).
- Transparency (RGBA, LA, PA, RGBa, palette or RGB/L with a transparent colour): composited over
  white, as a web page or document shows it (a fully opaque image keeps its colours exactly).
- Every other mode (1, L, P, RGBX, YCbCr, HSV, ...): Pillow's conversion. Multi-frame files (GIF,
  animated WebP, MPO, TIFF pages): the first frame.
- HEIC / HEIF: with the `heif` extra (pillow-heif) installed, registered here on import; AVIF: Pillow's
  own decoder (or pillow-heif where Pillow lacks it). Without the extra, the error says which extra
  reads the file.

`ImageFile` also reads an image file's bytes (an upload to the server). A file that is missing raises
FileNotFoundError, one that cannot be decoded `UnreadableImageError` (`NotAnImageError`: no format
Pillow identifies; `TooManyPixelsError`: over Pillow's decompression-bomb limit; itself: truncated or
corrupt); each message names the file and the reason (`unreadable_reason`: the reason alone). A
dataset's `sample` turns either into a `BadImageError` naming the image id (`BadImageError.of`)."""

import contextlib
import io
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageCms, UnidentifiedImageError

from ..config import EXIF_FRAMES
from ..errors import install_hint

ORIENTATION_TAG = 0x0112
# EXIF orientation -> the transposition that shows the stored pixels as a viewer does (as
# PIL.ImageOps.exif_transpose)
TRANSPOSITIONS = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
# what readers take as images (predict's folders, YOLO's image folders): Ultralytics' list, GIF, HEIF, AVIF
IMAGE_SUFFIXES = {".bmp", ".gif", ".jpeg", ".jpg", ".mpo", ".png", ".tif", ".tiff", ".webp", ".heic", ".heif", ".avif"}
HEIF_BRANDS = {b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"hevm", b"hevs", b"mif1", b"msf1"}
AVIF_BRANDS = {b"avif", b"avis"}
BACKGROUND = (255, 255, 255)  # what transparent pixels are composited over


def _register_heif() -> bool:
    """pillow-heif's HEIF opener (and its AVIF one where Pillow has no AVIF decoder), if installed."""
    try:
        import pillow_heif
    except ImportError:
        return False
    pillow_heif.register_heif_opener()
    from PIL import features

    if not features.check("avif") and hasattr(pillow_heif, "register_avif_opener"):
        pillow_heif.register_avif_opener()
    return True


HEIF_READABLE = _register_heif()


class UnreadableImageError(ValueError):
    """A file that is there but cannot be decoded as an image; the message names it and says why."""


class NotAnImageError(UnreadableImageError):
    """Data in no format Pillow (or an installed plugin) identifies."""


class TooManyPixelsError(UnreadableImageError):
    """An image over Pillow's decompression-bomb limit."""


def unreadable_reason(error: Exception, path) -> str:
    """Why the image file `path` cannot be had, without its name (the caller's message names it, with
    more): "image file not found" for a FileNotFoundError, else the `UnreadableImageError`'s reason."""
    if isinstance(error, FileNotFoundError):
        return "image file not found"
    return str(error).removeprefix(f"{path}: ")


class BadImageError(RuntimeError):
    """A dataset's image that is missing or cannot be decoded, met by `sample`: the message names the
    file, the reason (`unreadable_reason`) and the image id. The loader skips it where the dataset's
    `skip_bad_images` is set; training otherwise saves and stops on it (training/stops.py). A
    RuntimeError, not the reader's ValueError: a failure of a run's data, which a command names by its
    type, not a mistake in what the user typed."""

    @classmethod
    def of(cls, error: Exception, path, image_id) -> "BadImageError":
        """The error for the image `image_id` at `path`, from the reader's FileNotFoundError or
        UnreadableImageError."""
        return cls(f"{path}: {unreadable_reason(error, path)} (image id {image_id})")


def _head(source) -> bytes:
    """The first 12 bytes of `source` (bytes, or a file's path); b"" where the file cannot be read."""
    if isinstance(source, (bytes, bytearray)):
        return bytes(source[:12])
    with contextlib.suppress(OSError), open(source, "rb") as file:
        return file.read(12)
    return b""


def _unidentified(name, head: bytes) -> NotAnImageError:
    """Why Pillow identified no image in data starting `head`: a HEIF or AVIF file without its decoder, or
    no image of a format it reads (the ISO base media file's major brand tells the first two)."""
    brand = head[8:12] if head[4:8] == b"ftyp" else b""
    if brand in HEIF_BRANDS and not HEIF_READABLE:
        return NotAnImageError(f"{name}: a HEIC/HEIF image: reading it takes the heif extra ({install_hint('heif')})")
    if brand in AVIF_BRANDS:
        return NotAnImageError(f"{name}: an AVIF image this Pillow cannot decode ({install_hint('heif')} reads it)")
    return NotAnImageError(
        f"{name}: cannot read image: not a format Pillow (or an installed plugin) identifies "
        "(not an image, or one of another format)"
    )


class ImageFile:
    """An image file's header: `format`, `mode`, `stored_size` (width, height of the pixels as stored),
    `orientation` (EXIF, 1-8; 1 where there is none or it is not one of those), `displayed_size` and
    `transparency` (a transparent colour declared, as palette images do).
    Opening reads the header alone; `rgb` decodes. A context manager (the file stays open until
    closed, or until `rgb` has decoded it)."""

    def __init__(self, source, name: str | None = None):
        """`source`: the file's path, or an image file's bytes (an upload) that messages call `name`."""
        in_memory = isinstance(source, (bytes, bytearray))
        self.path = name if in_memory else Path(source)
        try:
            self._image = Image.open(io.BytesIO(source) if in_memory else self.path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.path}: no such image file") from None
        except IsADirectoryError:
            raise UnreadableImageError(f"{self.path}: a folder, not an image file") from None
        except UnidentifiedImageError:
            raise _unidentified(self.path, _head(source)) from None
        except Image.DecompressionBombError as error:
            raise TooManyPixelsError(f"{self.path}: cannot read image: {error}") from None
        except (OSError, SyntaxError, ValueError) as error:
            raise UnreadableImageError(f"{self.path}: cannot read image: {error}") from None
        self.format, self.mode, self.stored_size = self._image.format, self._image.mode, self._image.size
        self.transparency = "transparency" in self._image.info  # a transparent colour (RGBA etc.: the mode says)
        self.orientation = self._orientation()

    def _orientation(self) -> int:
        image = self._image
        if image.format == "PNG" and "exif" not in image.info:
            return 1  # an eXIf chunk after the pixels: Pillow would decode the whole image to find it
        try:
            value = image.getexif().get(ORIENTATION_TAG, 1)
        except Exception:  # noqa: BLE001 (a malformed EXIF block: Pillow raises many kinds; no tag then)
            return 1
        return value if value in TRANSPOSITIONS else 1

    @property
    def displayed_size(self) -> tuple[int, int]:
        width, height = self.stored_size
        return (height, width) if self.orientation in (5, 6, 7, 8) else (width, height)

    def size_in(self, frame: str) -> tuple[int, int]:
        return self.displayed_size if frame == "displayed" else self.stored_size

    def frame_for(self, recorded_size=None, rule: str = "auto") -> str:
        """ "displayed" or "stored": the frame whose size an annotation file records as `recorded_size`
        (width, height; None: not recorded), by `rule` (data.exif_orientation; see the module's
        docstring)."""
        return self.frame_and_reason(recorded_size, rule)[0]

    def frame_and_reason(self, recorded_size=None, rule: str = "auto") -> tuple[str, str]:
        """-> (`frame_for`'s frame, why: the rule's words, as the check prints them)."""
        if rule in ("displayed", "stored"):
            return rule, f"data.exif_orientation: {rule}"
        if rule != "auto":
            raise ValueError(f"data.exif_orientation {rule!r}: expected one of {', '.join(EXIF_FRAMES)}")
        if self.displayed_size == self.stored_size:
            return "stored", "both frames are the same size: nothing tells them apart"
        if recorded_size is None:
            return "stored", "no size recorded"
        if tuple(recorded_size) == self.displayed_size:
            return "displayed", "the recorded size is the displayed one"
        if tuple(recorded_size) == self.stored_size:
            return "stored", "the recorded size is the stored one"
        return "stored", "the recorded size is neither frame's"

    def rgb(self, frame: str = "displayed") -> Image.Image:
        """The whole image decoded (truncated data is an error), in `frame`, as RGB, carrying no EXIF or
        XMP of the file's: its pixels are in their frame, with no orientation tag left for another reader
        (`as_displayed`, a caller's `ImageOps.exif_transpose`) to turn them by again."""
        image = self._image
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image.load()
            rgb = to_rgb(image)
        except Image.DecompressionBombError as error:
            raise TooManyPixelsError(f"{self.path}: cannot read image: {error}") from None
        except (OSError, SyntaxError, ValueError, EOFError) as error:
            raise UnreadableImageError(f"{self.path}: cannot read image: {error}") from None
        finally:
            self.close()
        if frame == "displayed" and self.orientation in TRANSPOSITIONS:
            rgb = rgb.transpose(TRANSPOSITIONS[self.orientation])
        rgb.info = {}
        return rgb

    def close(self):
        self._image.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_image(path, frame: str = "displayed") -> Image.Image:
    """The image file `path` decoded as RGB, in `frame` ("displayed": as a viewer shows it)."""
    return ImageFile(path).rgb(frame)


def as_displayed(image: Image.Image) -> Image.Image:
    """A PIL image given in memory, as RGB in the frame a viewer shows: one opened from a file still
    carries its EXIF orientation (`ImageOps.exif_transpose` removes the tag, so nothing turns twice)."""
    try:
        orientation = image.getexif().get(ORIENTATION_TAG, 1)
    except Exception:  # noqa: BLE001 (malformed EXIF: no tag)
        orientation = 1
    rgb = to_rgb(image)
    return rgb.transpose(TRANSPOSITIONS[orientation]) if orientation in TRANSPOSITIONS else rgb


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` in RGB as its pixels look (the module's docstring says how each mode is read)."""
    mode = image.mode
    if mode == "RGB" and "transparency" not in image.info:
        return image.convert("RGB")  # a copy: the file's image is closed after decoding
    if mode.startswith("I;16"):
        return _gray(np.round(np.asarray(image, np.float64) / 257.0))
    if mode == "I":
        values = np.asarray(image, np.float64)
        if values.size and values.min() >= 0 and values.max() <= 65535:
            return _gray(np.round(values / 257.0))
        return _gray(_stretched(values))
    if mode == "F":
        values = np.nan_to_num(np.asarray(image, np.float64), nan=0.0, posinf=0.0, neginf=0.0)
        if values.size and values.min() >= 0 and values.max() <= 1:
            return _gray(np.round(values * 255.0))
        return _gray(_stretched(values))
    if mode == "CMYK" and image.info.get("icc_profile"):
        with contextlib.suppress(ImageCms.PyCMSError, OSError):
            profile = ImageCms.ImageCmsProfile(io.BytesIO(image.info["icc_profile"]))
            return ImageCms.profileToProfile(image, profile, ImageCms.createProfile("sRGB"), outputMode="RGB")
    if mode == "LAB":
        return ImageCms.profileToProfile(
            image, ImageCms.createProfile("LAB"), ImageCms.createProfile("sRGB"), outputMode="RGB"
        )
    if mode in ("RGBA", "LA", "PA", "RGBa") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (*BACKGROUND, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _gray(values: np.ndarray) -> Image.Image:
    return Image.fromarray(np.clip(values, 0, 255).astype(np.uint8)).convert("RGB")


def _stretched(values: np.ndarray) -> np.ndarray:
    """Linearly from the minimum (0) to the maximum (255); a constant image is 0."""
    low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
    return np.round((values - low) * 255.0 / (high - low)) if high > low else np.zeros_like(values)
