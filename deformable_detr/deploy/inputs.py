"""The inference preprocessing (`model_pixels`: `Detector`, so `predict` and the server, and the exporters' inputs), and
an exported file's inputs (ONNX or .mlxfn) from images: resized and normalised as `predict` does, placed at the top
left of the canvas (as `collate` pads), with transformers' `pixel_mask`.

    inputs = canvas_inputs([Image.open("photo.jpg")], canvas=(800, 1333))
    logits, pred_boxes = session.run(None, inputs)  # onnxruntime.InferenceSession("model.onnx")
    logits, pred_boxes = mx.import_function("model.mlxfn")(**inputs)  # numpy arrays taken as they are
"""

import numpy as np
from PIL import Image

from ..data.transforms import normalize, resized_shape


def model_pixels(image: Image.Image, shape: tuple) -> np.ndarray:
    """What the model takes of `image` (PIL), in one place: in RGB, resized to `shape` (height, width) bilinearly
    as the val transforms' `transforms.resize`, ImageNet-normalised as `transforms.normalize` -> (height, width,
    3) float32. `Detector` resizes to its `batch_key`, `canvas_inputs` to `fitting_shape`."""
    height, width = shape
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    return normalize(rgb.resize((width, height), Image.BILINEAR), {"boxes": np.zeros((0, 4), np.float32)})[0]


def pad_to_canvas(images: list, canvas: tuple) -> dict:
    """Normalised (h, w, 3) arrays -> {"pixel_values": (N, 3, H, W) float32, "pixel_mask": (N, H, W)
    int64, 1 on the image}. An image larger than the canvas is an error naming it."""
    height, width = canvas
    pixel_values = np.zeros((len(images), 3, height, width), np.float32)
    pixel_mask = np.zeros((len(images), height, width), np.int64)
    for i, image in enumerate(images):
        h, w = image.shape[:2]
        if h > height or w > width:
            raise ValueError(
                f"image {i}: {h} x {w} does not fit the {height} x {width} canvas the file was exported for; "
                "resize it or export with a larger --size"
            )
        pixel_values[i, :, :h, :w] = np.transpose(image, (2, 0, 1))
        pixel_mask[i, :h, :w] = 1
    return {"pixel_values": pixel_values, "pixel_mask": pixel_mask}


def fitting_shape(width: int, height: int, canvas: tuple, size: int, max_size: int) -> tuple:
    """(height, width) as evaluation resizes (shorter side `size`, longer at most `max_size`), shrunk
    further where that would not fit the canvas (a portrait image on a landscape canvas)."""
    h, w = resized_shape(width, height, size, max_size)
    if h <= canvas[0] and w <= canvas[1]:
        return h, w
    scale = min(canvas[0] / h, canvas[1] / w)
    return max(1, min(canvas[0], int(h * scale))), max(1, min(canvas[1], int(w * scale)))


def canvas_inputs(images: list, canvas: tuple, size: int | None = None, max_size: int | None = None) -> dict:
    """PIL images -> pad_to_canvas's inputs. `size`, `max_size`: the resize (default: the canvas's
    shorter and longer side, the config's val_size and max_size for the default canvas)."""
    size = size or min(canvas)
    max_size = max_size or max(canvas)
    pixels = [model_pixels(image, fitting_shape(*image.size, canvas, size, max_size)) for image in images]
    return pad_to_canvas(pixels, canvas)
