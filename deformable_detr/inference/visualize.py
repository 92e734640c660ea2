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


def pr_curves(curves: dict, path=None, columns: int = 5, size=(240, 200)) -> Image.Image:
    """A panel per category: precision against recall at IoU 0.5 (pycocotools' 101 recall points;
    where precision is undefined, -1, nothing is drawn), its AP50 in the title; saved to `path`
    where given, returned."""
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
    if path is not None:
        canvas.save(path)
    return canvas


LEVEL_COLOURS = [(255, 48, 48), (255, 196, 0), (0, 200, 255), (190, 80, 255), (80, 220, 80), (255, 120, 200)]


def draw_sampling_points(image, points, weights, reference, box=None, title: str = "", longer_side: int = 640):
    """One query's sampling points (heads, levels, points, 2) x, y in the image's pixels on a faded copy
    of `image` (scaled so its longer side is `longer_side`): coloured by feature level, each dot's
    area proportional to its attention weight, the reference point a white cross, `box` its box."""
    scale = longer_side / max(image.size)
    faded = Image.blend(image.convert("L").convert("RGB"), Image.new("RGB", image.size, "white"), 0.35)
    canvas = faded.resize((round(image.width * scale), round(image.height * scale)), Image.BILINEAR).convert("RGBA")
    overlay = Image.new("RGBA", canvas.size, (0, 0, 0, 0))
    pen = ImageDraw.Draw(overlay)
    if box is not None:
        pen.rectangle([float(v) * scale for v in box], outline=(20, 20, 20, 255), width=2)
    points, weights = np.asarray(points) * scale, np.asarray(weights)
    levels = np.broadcast_to(np.arange(points.shape[1])[None, :, None], weights.shape)
    for i in np.argsort(weights, axis=None):  # the heaviest drawn last, on top
        (x, y), weight, level = points.reshape(-1, 2)[i], weights.reshape(-1)[i], levels.reshape(-1)[i]
        radius = 1.5 + 9 * float(np.sqrt(weight))
        pen.ellipse([x - radius, y - radius, x + radius, y + radius], fill=(*LEVEL_COLOURS[level % 6], 190))
    x, y = (float(v) * scale for v in reference)
    for width, colour in ((5, (0, 0, 0, 255)), (2, (255, 255, 255, 255))):
        pen.line([x - 8, y, x + 8, y], fill=colour, width=width)
        pen.line([x, y - 8, x, y + 8], fill=colour, width=width)
    pen.text((4, 3), title, fill="black", stroke_width=2, stroke_fill="white")
    for level in range(points.shape[1]):  # the legend: a dot of each level's colour
        y = 20 + 14 * level
        pen.ellipse([5, y, 15, y + 10], fill=(*LEVEL_COLOURS[level % 6], 255))
        pen.text((20, y - 1), f"level {level}", fill="black", stroke_width=2, stroke_fill="white")
    return Image.alpha_composite(canvas, overlay).convert("RGB")
