"""The one image reader (deformable_detr/data/images.py), on files built the way users' own photos are:
EXIF-tagged phone photos in YOLO and COCO sets (the box over the object in the loaded pixels, in the
frame the annotations mean), predictions in the displayed frame, every Pillow mode to RGB as its pixels
look (16-bit by 257, not clipped), the formats Pillow reads, HEIC through the `heif` extra."""

import io
import json
import struct
import zlib

from deformable_detr import Detector, build_model, load_config
from deformable_detr.data import build_dataset
from deformable_detr.data import images as reader
from deformable_detr.data.images import ImageFile, UnreadableImageError, read_image, to_rgb
from deformable_detr.inference.inputs import displayed_size

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image, ImageCms, features
from test_train import TINY

DISPLAYED = (160, 96)  # (width, height) of the scene as a viewer shows it: wider than high
OBJECT = (100, 20, 140, 60)  # x0, y0, x1, y1 of the red object in the displayed frame
# EXIF orientation -> how the camera stored the displayed scene (the inverse of the viewer's turn)
STORED_BY = {
    3: Image.Transpose.ROTATE_180,
    6: Image.Transpose.ROTATE_90,
    8: Image.Transpose.ROTATE_270,
}


def scene() -> Image.Image:
    """Grey, with a red object at OBJECT: what the user sees."""
    image = Image.new("RGB", DISPLAYED, (90, 90, 90))
    image.paste((230, 20, 20), OBJECT)
    return image


def phone_photo(path, orientation: int):
    """The scene stored as a camera stores it, with the EXIF orientation that turns it back."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    scene().transpose(STORED_BY[orientation]).save(path, quality=95, exif=exif)
    return path


def redness(pixels: np.ndarray) -> float:
    """How red a region is: red minus the mean of green and blue."""
    pixels = pixels.astype(np.float64)
    return float((pixels[..., 0] - (pixels[..., 1] + pixels[..., 2]) / 2).mean())


def assert_box_over_the_object(image: Image.Image, box):
    """The box covers the red object: inside it red, a band around it grey."""
    x0, y0, x1, y1 = (int(round(v)) for v in box)
    pixels = np.asarray(image)
    assert redness(pixels[y0 + 2 : y1 - 2, x0 + 2 : x1 - 2]) > 150
    outside = np.ones(pixels.shape[:2], bool)
    outside[max(y0 - 3, 0) : y1 + 3, max(x0 - 3, 0) : x1 + 3] = False
    assert redness(pixels[outside]) < 10


def stored_box(orientation: int):
    """OBJECT in the stored frame of a photo of `orientation`."""
    width, height = DISPLAYED
    x0, y0, x1, y1 = OBJECT
    if orientation == 3:
        return (width - x1, height - y1, width - x0, height - y0)
    if orientation == 6:  # stored = displayed turned 90 degrees anticlockwise
        return (y0, width - x1, y1, width - x0)
    return (height - y1, x0, height - y0, x1)  # 8


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_a_phone_photo_is_read_as_displayed(tmp_path, orientation):
    path = phone_photo(tmp_path / "photo.jpg", orientation)
    with ImageFile(path) as header:
        assert header.orientation == orientation and header.displayed_size == DISPLAYED
        assert header.stored_size == (DISPLAYED if orientation == 3 else DISPLAYED[::-1])
    image = read_image(path)
    assert image.size == DISPLAYED and displayed_size(path) == DISPLAYED
    assert_box_over_the_object(image, OBJECT)
    assert_box_over_the_object(read_image(path, "stored"), stored_box(orientation))


def yolo_set(root, orientation: int):
    """A YOLO set of one rotated photo (train and val), its label drawn in the displayed frame."""
    for split in ("train", "val"):
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
        phone_photo(root / "images" / split / "photo.jpg", orientation)
        width, height = DISPLAYED
        x0, y0, x1, y1 = OBJECT
        label = f"0 {(x0 + x1) / 2 / width} {(y0 + y1) / 2 / height} {(x1 - x0) / width} {(y1 - y0) / height}\n"
        (root / "labels" / split / "photo.txt").write_text(label)
    (root / "data.yaml").write_text("train: images/train\nval: images/val\nnames: [object]\n")
    return root


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_yolo_labels_are_in_the_displayed_frame(tmp_path, orientation):
    cfg = load_config(TINY, ["data.dataset=yolo", f"data.path={yolo_set(tmp_path, orientation)}"])
    dataset = build_dataset("train", cfg.data)
    image, target = dataset.load(0)
    assert image.size == DISPLAYED and dataset.image_sizes() == [DISPLAYED]
    np.testing.assert_allclose(target["boxes"], [OBJECT], atol=1e-4)
    assert_box_over_the_object(image, target["boxes"][0])


def coco_set(root, orientation: int, recorded: str):
    """A COCO set of one rotated photo whose annotation file records the `recorded` ("displayed" or
    "stored") frame's size, with the object's box in that frame."""
    for split in ("train", "val"):
        (root / f"{split}2017").mkdir(parents=True)
        path = phone_photo(root / f"{split}2017" / "photo.jpg", orientation)
        with ImageFile(path) as header:
            width, height = header.size_in(recorded)
        x0, y0, x1, y1 = OBJECT if recorded == "displayed" else stored_box(orientation)
        data = {
            "images": [{"id": 1, "file_name": "photo.jpg", "width": width, "height": height}],
            "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [x0, y0, x1 - x0, y1 - y0]}],
            "categories": [{"id": 1, "name": "object"}],
        }
        (root / "annotations").mkdir(exist_ok=True)
        (root / "annotations" / f"instances_{split}2017.json").write_text(json.dumps(data))
    return root


@pytest.mark.parametrize("orientation", [3, 6, 8])
@pytest.mark.parametrize("recorded", ["displayed", "stored"])
def test_coco_reads_the_frame_whose_size_the_file_records(tmp_path, orientation, recorded):
    cfg = load_config(TINY, ["data.dataset=coco", f"data.path={coco_set(tmp_path, orientation, recorded)}"])
    image, target = build_dataset("train", cfg.data).load(0)
    # 180 degrees: both frames are 160 x 96, nothing tells them apart: the stored frame, as the authors read COCO
    taken = "stored" if orientation == 3 else recorded
    assert image.size == (DISPLAYED if taken == "displayed" or orientation == 3 else DISPLAYED[::-1])
    if taken == recorded:
        assert_box_over_the_object(image, target["boxes"][0])
    if orientation == 3 and recorded == "displayed":  # data.exif_orientation says which frame
        cfg = load_config(TINY, ["data.dataset=coco", f"data.path={tmp_path}", "data.exif_orientation=displayed"])
        image, target = build_dataset("train", cfg.data).load(0)
        assert_box_over_the_object(image, target["boxes"][0])


@pytest.mark.parametrize("orientation", [6, 8])
def test_predictions_come_in_the_displayed_frame(tmp_path, orientation):
    mx.random.seed(0)
    cfg = load_config(TINY, ["model.num_classes=2"])
    detector = Detector(build_model(cfg), cfg, {1: "object"})
    path = phone_photo(tmp_path / "photo.jpg", orientation)
    turn_back = {6: Image.Transpose.ROTATE_270, 8: Image.Transpose.ROTATE_90}[orientation]
    shown = read_image(path, "stored").transpose(turn_back)  # the decoded pixels, turned by hand
    [from_file] = detector.predict(path, threshold=0.0)
    [from_pixels] = detector.predict(np.asarray(shown), threshold=0.0)
    assert from_file.image_size == DISPLAYED
    np.testing.assert_array_equal(from_file.boxes, from_pixels.boxes)
    np.testing.assert_array_equal(from_file.scores, from_pixels.scores)
    [from_pil] = detector.predict(Image.open(path), threshold=0.0)  # still carrying its tag: turned too
    np.testing.assert_array_equal(from_pil.boxes, from_pixels.boxes)


def png_16bit_rgb(values: np.ndarray) -> bytes:
    """A 16-bit-per-sample RGB PNG of `values` (H, W, 3) uint16, written by hand: Pillow writes none."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    height, width, _ = values.shape
    rows = b"".join(b"\0" + row.astype(">u2").tobytes() for row in values)
    header = struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def test_a_16_bit_png_keeps_its_object_visible(tmp_path):
    depth = np.full((48, 64), 10_000, np.uint16)  # a depth or medical image: values far above 255
    depth[10:30, 20:50] = 60_000
    Image.fromarray(depth).save(tmp_path / "gray16.png")
    assert Image.open(tmp_path / "gray16.png").mode == "I;16"
    pixels = np.asarray(read_image(tmp_path / "gray16.png"))
    np.testing.assert_array_equal(pixels[..., 0], np.round(depth / 257).astype(np.uint8))  # 39 and 233
    assert np.asarray(Image.open(tmp_path / "gray16.png").convert("RGB")).min() == 255  # what was read before
    colour = np.zeros((8, 8, 3), np.uint16)
    colour[..., 0], colour[2:6, 2:6, 1] = 65_535, 30_000
    (tmp_path / "rgb16.png").write_bytes(png_16bit_rgb(colour))
    pixels = np.asarray(read_image(tmp_path / "rgb16.png")).astype(int)
    assert np.abs(pixels - np.round(colour / 257)).max() <= 1  # Pillow keeps the high byte: within 1


def test_32_bit_integer_and_float_images_by_their_rule():
    small = np.array([[0, 1000], [40_000, 65_535]], np.int32)  # 16-bit values Pillow opens as I
    np.testing.assert_array_equal(np.asarray(to_rgb(Image.fromarray(small)))[..., 0], np.round(small / 257))
    wide = np.array([[-100, 0], [100, 300]], np.int32)  # beyond 16 bits: stretched min..max
    np.testing.assert_array_equal(np.asarray(to_rgb(Image.fromarray(wide)))[..., 0], [[0, 64], [128, 255]])
    unit = np.array([[0.0, 0.5], [1.0, np.nan]], np.float32)
    np.testing.assert_array_equal(np.asarray(to_rgb(Image.fromarray(unit)))[..., 0], [[0, 128], [255, 0]])
    metres = np.array([[2.0, 4.0], [6.0, 10.0]], np.float32)
    np.testing.assert_array_equal(np.asarray(to_rgb(Image.fromarray(metres)))[..., 0], [[0, 64], [128, 255]])


def test_transparency_over_white_and_opaque_colours_unchanged():
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[0, 0] = (200, 10, 10, 255)  # opaque: as it is
    rgba[0, 1] = (0, 0, 0, 0)  # transparent black (what a drop of alpha shows): white
    rgba[1, 0] = (0, 0, 200, 128)  # half over white
    pixels = np.asarray(to_rgb(Image.fromarray(rgba))).astype(int)
    np.testing.assert_array_equal(pixels[0, 0], (200, 10, 10))
    np.testing.assert_array_equal(pixels[0, 1], (255, 255, 255))
    assert abs(pixels[1, 0] - (127, 127, 227)).max() <= 1
    la = Image.fromarray(np.array([[[50, 255], [50, 0]]], np.uint8), "LA")
    np.testing.assert_array_equal(np.asarray(to_rgb(la))[0], [(50, 50, 50), (255, 255, 255)])
    palette = Image.new("P", (2, 1))
    palette.putpalette([0, 0, 0, 10, 200, 10] + [0] * 762)
    palette.putpixel((1, 0), 1)
    palette.info["transparency"] = 0
    np.testing.assert_array_equal(np.asarray(to_rgb(palette))[0], [(255, 255, 255), (10, 200, 10)])


def test_cmyk_through_its_icc_profile_or_pillows_conversion(tmp_path):
    cmyk = Image.new("CMYK", (4, 4), (0, 255, 255, 0))  # red ink
    np.testing.assert_array_equal(np.asarray(to_rgb(cmyk))[0, 0], (255, 0, 0))
    lab = ImageCms.profileToProfile(Image.new("RGB", (2, 2), (30, 120, 220)), *_srgb_to_lab(), outputMode="LAB")
    assert abs(np.asarray(to_rgb(lab)).astype(int)[0, 0] - (30, 120, 220)).max() <= 3


def _srgb_to_lab():
    return ImageCms.createProfile("sRGB"), ImageCms.createProfile("LAB")


@pytest.mark.parametrize("kind", ["WEBP", "TIFF", "BMP", "GIF", "AVIF"])
def test_the_formats_pillow_reads(tmp_path, kind):
    if kind == "AVIF" and not features.check("avif"):
        pytest.skip("this Pillow has no AVIF codec")
    first = scene()
    path = tmp_path / f"scene.{kind.lower()}"
    options = {"lossless": True} if kind == "WEBP" else {}
    if kind == "GIF":  # an animation: the first frame is read
        first.save(path, save_all=True, append_images=[Image.new("RGB", DISPLAYED, (0, 0, 255))], duration=100)
    else:
        first.save(path, **options)
    if kind == "AVIF":  # lossy, its colours subsampled at the object's edges
        assert_box_over_the_object(read_image(path), OBJECT)
    else:
        np.testing.assert_array_equal(np.asarray(read_image(path)), np.asarray(first))


def test_a_truncated_jpeg_is_named_when_decoded(tmp_path):
    scene().save(tmp_path / "whole.jpg", quality=95)
    data = (tmp_path / "whole.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(data[: len(data) // 2])
    with ImageFile(tmp_path / "cut.jpg") as header:  # the header reads
        assert header.stored_size == DISPLAYED
    with pytest.raises(UnreadableImageError, match=r"cut\.jpg: cannot read image: image file is truncated"):
        read_image(tmp_path / "cut.jpg")
    with pytest.raises(FileNotFoundError, match=r"absent\.jpg: no such image file"):
        read_image(tmp_path / "absent.jpg")


def test_heic_is_read_with_the_heif_extra(tmp_path):
    pillow_heif = pytest.importorskip("pillow_heif", reason="the heif extra (pillow-heif) is not installed")
    assert reader.HEIF_READABLE
    pillow_heif.from_pillow(scene()).save(tmp_path / "photo.heic", quality=95)
    image = read_image(tmp_path / "photo.heic")
    assert image.size == DISPLAYED
    assert_box_over_the_object(image, OBJECT)


def test_heic_without_the_extra_says_which_extra_reads_it(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "HEIF_READABLE", False)
    (tmp_path / "photo.heic").write_bytes(b"\0\0\0\x18ftypheic\0\0\0\0mif1heic" + bytes(64))
    monkeypatch.setattr(Image, "open", _unidentified)  # as where no plugin is registered
    with pytest.raises(UnreadableImageError, match=r'photo\.heic: a HEIC/HEIF image: .*pip install -e "\.\[heif\]"'):
        read_image(tmp_path / "photo.heic")


def _unidentified(path, *args, **kwargs):
    from PIL import UnidentifiedImageError

    raise UnidentifiedImageError(f"cannot identify image file {str(path)!r}")


def test_a_png_with_exif_in_memory(tmp_path):
    buffer = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6
    scene().transpose(Image.Transpose.ROTATE_90).save(buffer, format="PNG", exif=exif)
    (tmp_path / "photo.png").write_bytes(buffer.getvalue())
    assert read_image(tmp_path / "photo.png").size == DISPLAYED
