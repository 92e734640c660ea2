"""Pictures: detections drawn on images, and training curves (pillow only)."""

import numpy as np
from PIL import Image, ImageDraw

PALETTE = [
    (230, 25, 75),
    (60, 180, 75),
    (0, 130, 200),
    (245, 130, 48),
    (145, 30, 180),
    (70, 240, 240),
    (240, 50, 230),
    (210, 245, 60),
    (250, 190, 190),
    (0, 128, 128),
]


def draw_detections(image: Image.Image, detections: dict, names: dict, threshold: float = 0.5) -> Image.Image:
    """Boxes (x0, y0, x1, y1 pixels), class names and scores above `threshold`, drawn on a copy."""
    image = image.convert("RGB").copy()
    pen = ImageDraw.Draw(image)
    for score, label, box in zip(
        np.asarray(detections["scores"]), np.asarray(detections["labels"]), np.asarray(detections["boxes"]), strict=True
    ):
        if score < threshold:
            continue
        color = PALETTE[int(label) % len(PALETTE)]
        x0, y0, x1, y1 = (float(v) for v in box)
        pen.rectangle([x0, y0, x1, y1], outline=color, width=2)
        text = f"{names.get(int(label), int(label))} {score:.2f}"
        left, top, right, bottom = pen.textbbox((x0, y0), text)
        pen.rectangle([x0, y0 - (bottom - top) - 2, x0 + (right - left) + 4, y0], fill=color)
        pen.text((x0 + 2, y0 - (bottom - top) - 2), text, fill="white")
    return image


def grid(images: list, columns: int = 3, scale: int = 2) -> Image.Image:
    """Images side by side, each enlarged `scale` times (nearest), in rows of `columns`."""
    images = [im.resize((im.width * scale, im.height * scale), Image.NEAREST) for im in images]
    width, height = max(im.width for im in images), max(im.height for im in images)
    rows = (len(images) + columns - 1) // columns
    canvas = Image.new("RGB", (columns * width, rows * height), "white")
    for i, im in enumerate(images):
        canvas.paste(im, ((i % columns) * width, (i // columns) * height))
    return canvas


def plot_curves(series: dict, path, title: str = "", size=(720, 300)):
    """One panel per named series of (x, y) points, side by side, with the axis ranges written."""
    panels = [(name, points) for name, points in series.items() if points]
    width, height = size
    canvas = Image.new("RGB", (width * max(len(panels), 1), height), "white")
    pen = ImageDraw.Draw(canvas)
    for i, (name, points) in enumerate(panels):
        left, top, right, bottom = i * width + 60, 30, (i + 1) * width - 20, height - 40
        xs, ys = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
        x_lo, x_hi = xs.min(), max(xs.max(), xs.min() + 1e-9)
        y_lo, y_hi = min(ys.min(), 0.0), max(ys.max(), 1e-9)
        pen.rectangle([left, top, right, bottom], outline="black")
        coords = [
            (left + (x - x_lo) / (x_hi - x_lo) * (right - left), bottom - (y - y_lo) / (y_hi - y_lo) * (bottom - top))
            for x, y in zip(xs, ys, strict=True)
        ]
        if len(coords) > 1:
            pen.line(coords, fill=(0, 90, 200), width=2)
        for x, y in coords:
            pen.ellipse([x - 2, y - 2, x + 2, y + 2], fill=(0, 90, 200))
        pen.text((left, 8), f"{title} {name}".strip(), fill="black")
        pen.text((i * width + 4, top), f"{y_hi:.3g}", fill="black")
        pen.text((i * width + 4, bottom - 10), f"{y_lo:.3g}", fill="black")
        pen.text((left, bottom + 6), f"{x_lo:g}", fill="black")
        pen.text((right - 30, bottom + 6), f"{x_hi:g}", fill="black")
    canvas.save(path)
