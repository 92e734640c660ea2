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


def pr_curves(curves: dict, path, columns: int = 5, size=(240, 200)):
    """A panel per category: precision against recall at IoU 0.5 (pycocotools' 101 recall points;
    where precision is undefined, -1, nothing is drawn), its AP50 in the title."""
    names = list(curves)
    rows = max((len(names) + columns - 1) // columns, 1)
    width, height = size
    canvas = Image.new("RGB", (columns * width, rows * height), "white")
    pen = ImageDraw.Draw(canvas)
    recall = np.linspace(0, 1, 101)
    for i, name in enumerate(names):
        precision = np.asarray(curves[name], float)
        x0, y0 = (i % columns) * width, (i // columns) * height
        left, top, right, bottom = x0 + 30, y0 + 22, x0 + width - 10, y0 + height - 22
        pen.rectangle([left, top, right, bottom], outline="black")
        defined = precision > -1
        ap50 = f"{precision[defined].mean():.3f}" if defined.any() else "no boxes"
        pen.text((left, y0 + 6), f"{name}: AP50 {ap50}", fill="black")
        points = [
            (left + r * (right - left), bottom - p * (bottom - top))
            for r, p in zip(recall[defined], precision[defined], strict=True)
        ]
        if len(points) > 1:
            pen.line(points, fill=PALETTE[i % len(PALETTE)], width=2)
        pen.text((x0 + 4, top - 4), "1", fill="black")
        pen.text((x0 + 4, bottom - 8), "0", fill="black")
        pen.text((left, bottom + 4), "recall 0", fill="black")
        pen.text((right - 12, bottom + 4), "1", fill="black")
    canvas.save(path)
