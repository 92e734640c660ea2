"""A synthetic detection set written in COCO format: coloured shapes on textured backgrounds.

Five classes by default (square, circle, triangle, diamond, cross), each in its own jittered colour
family; muted, striped, noisy backgrounds; sizes from 12 to 64 pixels in 96-160 pixel images; up to
four objects per image, free to overlap. Other sets choose among the SHAPES (category ids 1, 2, ...
in the order given), e.g. a second set for fine-tuning with classes partly the same.

Deterministic from its seed. `python -m deformable_detr.data.shapes ROOT [--classes circle square
hexagon star] [--seed N]` writes ROOT/{train2017,val2017}/*.png and
ROOT/annotations/instances_{train,val}2017.json."""

import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from ..errors import ArgumentParser, entry_point

# Each shape has its own colour family (jittered), on backgrounds of muted colours.
SHAPES = {
    "square": (220, 40, 40),
    "circle": (40, 200, 60),
    "triangle": (40, 80, 230),
    "diamond": (235, 215, 30),
    "cross": (200, 40, 210),
    "hexagon": (30, 210, 220),
    "star": (240, 140, 30),
}
CATEGORIES = ["square", "circle", "triangle", "diamond", "cross"]  # the built-in set's


def _draw_shape(draw, kind, x0, y0, size, color):
    x1, y1 = x0 + size, y0 + size
    if kind == "square":
        draw.rectangle([x0, y0, x1, y1], fill=color)
    elif kind == "circle":
        draw.ellipse([x0, y0, x1, y1], fill=color)
    elif kind == "triangle":
        draw.polygon([(x0 + size / 2, y0), (x1, y1), (x0, y1)], fill=color)
    elif kind == "diamond":
        draw.polygon([(x0 + size / 2, y0), (x1, y0 + size / 2), (x0 + size / 2, y1), (x0, y0 + size / 2)], fill=color)
    elif kind == "hexagon":
        draw.polygon(_fit(np.arange(6) * np.pi / 3, np.ones(6), x0, y0, size), fill=color)
    elif kind == "star":
        draw.polygon(_fit(np.arange(10) * np.pi / 5 - np.pi / 2, [1, 0.45] * 5, x0, y0, size), fill=color)
    else:  # cross
        third = size / 3
        draw.rectangle([x0 + third, y0, x1 - third, y1], fill=color)
        draw.rectangle([x0, y0 + third, x1, y1 - third], fill=color)


def _fit(angles, radii, x0, y0, size):
    """A polygon given in polar form, stretched to fill the box exactly (its annotation)."""
    points = np.stack([np.cos(angles), np.sin(angles)], -1) * np.asarray(radii, np.float64)[:, None]
    low, high = points.min(0), points.max(0)
    points = np.array([x0, y0]) + (points - low) / (high - low) * size
    return [(float(x), float(y)) for x, y in points]


def _background(rng, height, width, gradient=1.0):
    """Smooth colour gradient plus noise and stripes: texture that is not any class. `gradient` scales
    the gradient's slope: a 3000-pixel canvas at 1 would run into black or white (data/small_shapes.py)."""
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    base = rng.uniform(60, 180) + rng.uniform(-15, 15, 3)  # a grey with a slight tint
    slope = rng.uniform(-0.4, 0.4, (2, 3)) * gradient
    image = base + ys[..., None] * slope[0] / 4 + xs[..., None] * slope[1] / 4
    period = rng.uniform(6, 20)
    image += 12 * np.sin(2 * np.pi * (xs + ys * rng.uniform(-1, 1)) / period)[..., None]
    image += rng.normal(0, 8, image.shape)
    return Image.fromarray(image.clip(0, 255).astype(np.uint8))


def make_image(rng, height, width, max_objects, min_size, max_size, categories=CATEGORIES, min_objects=1, gradient=1.0):
    image = _background(rng, height, width, gradient)
    draw = ImageDraw.Draw(image)
    annotations = []
    for _ in range(int(rng.integers(min_objects, max_objects + 1))):
        category = int(rng.integers(len(categories)))
        size = int(rng.integers(min_size, min(max_size, height, width) + 1))
        x0, y0 = int(rng.integers(0, width - size + 1)), int(rng.integers(0, height - size + 1))
        kind = categories[category]
        color = tuple(int(c) for c in np.clip(np.array(SHAPES[kind]) + rng.integers(-30, 31, 3), 0, 255))
        _draw_shape(draw, kind, x0, y0, size, color)
        annotations.append({"category_id": category + 1, "bbox": [x0, y0, size + 1, size + 1]})
    return image, annotations


def write_split(
    root: Path,
    split: str,
    count: int,
    seed: int,
    height=(96, 160),
    width=(96, 160),
    max_objects=4,
    min_size=12,
    max_size=64,
    categories=CATEGORIES,
):
    image_dir = root / f"{split}2017"
    image_dir.mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for image_id in range(1, count + 1):
        rng = np.random.default_rng([seed, image_id])
        h, w = int(rng.integers(height[0], height[1] + 1)), int(rng.integers(width[0], width[1] + 1))
        image, objects = make_image(rng, h, w, max_objects, min_size, max_size, categories)
        name = f"{image_id:012d}.png"
        image.save(image_dir / name)
        images.append({"id": image_id, "file_name": name, "height": h, "width": w})
        for obj in objects:
            x, y, bw, bh = obj["bbox"]
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": obj["category_id"],
                    "bbox": [x, y, bw, bh],
                    "area": bw * bh,
                    "iscrowd": 0,
                }
            )
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    listed = [{"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(categories)]
    with open(root / "annotations" / f"instances_{split}2017.json", "w") as f:
        json.dump({"images": images, "annotations": annotations, "categories": listed}, f)


def generate(root, num_train=400, num_val=100, seed=0, categories=CATEGORIES, **sizes):
    """Write the set under `root` (train from seed, val from seed + 1)."""
    unknown = [c for c in categories if c not in SHAPES]
    if unknown or not categories:
        raise ValueError(f"shape classes {unknown or '(none)'}: expected some of {', '.join(SHAPES)}")
    root = Path(root)
    write_split(root, "train", num_train, seed, categories=categories, **sizes)
    write_split(root, "val", num_val, seed + 1, categories=categories, **sizes)
    return root


@entry_point
def main(argv=None):
    parser = ArgumentParser(prog="python -m deformable_detr.data.shapes", description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--val", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--classes",
        nargs="+",
        default=CATEGORIES,
        choices=list(SHAPES),
        metavar="SHAPE",
        help=f"category ids 1, 2, ... in this order; of {', '.join(SHAPES)}",
    )
    args = parser.parse_args(argv)
    generate(args.root, args.train, args.val, args.seed, args.classes)
    print(f"wrote {args.train} train and {args.val} val images of {', '.join(args.classes)} under {args.root}")


if __name__ == "__main__":
    main()
