"""A synthetic set of small objects on large canvases, for sliced inference (docs/slicing.md).

The shapes set's drawing and backgrounds (data/shapes.py), at another scale: the five shape classes
(ids 1..5, as the quick start's) 10 to 30 pixels a side on 3000 x 2000 canvases. A model at its usual
input size sees such a canvas shrunk to a few hundred pixels, the objects to a pixel or two; a model
run on slices of the canvas at their own resolution sees them at the size they have.

- val2017: whole canvases (default 8) with 40 to 60 objects each, in COCO format: what
  bench/slicing.py evaluates, with and without slicing;
- train2017: tiles (default 256 x 256, the slice size of configs/small_shapes.yaml) cut on a grid from
  other canvases (default 12), drawn denser (150 to 250 objects a canvas, about 2.5 a tile) so fewer
  tiles are empty background. An object cut by a tile's edge keeps its box clipped to the tile where at
  least half of its box is inside (`MIN_VISIBLE`), and has none otherwise, as SAHI's COCO slicing does
  with its `min_area_ratio`: the model learns to box a mostly-visible shape, and the slices' overlap
  (larger than any object) puts every object whole in some slice.

The canvases' background gradient is scaled down (`gradient`), so that across 3000 pixels it changes as
much as across one of the shapes set's images; the stripes and noise are the same per pixel.
Deterministic from its seed: `python -m deformable_detr.data.small_shapes ROOT [--train-canvases N]
[--val N] [--tile W,H] [--seed N]` writes ROOT/{train2017,val2017}/*.png and
ROOT/annotations/instances_{train,val}2017.json (about 15 MB a canvas: PNG keeps the pixels exact)."""

import json
from pathlib import Path

import numpy as np

from ..errors import ArgumentParser, entry_point
from .shapes import CATEGORIES, make_image

CANVAS = (3000, 2000)  # width, height
TILE = (256, 256)
OBJECT_SIZES = (10, 30)  # pixels a side (the box is one more: shapes.py draws both end pixels)
VAL_OBJECTS = (40, 60)
TRAIN_OBJECTS = (150, 250)
MIN_VISIBLE = 0.5  # a tile keeps a cut object's clipped box where this much of its box is inside
GRADIENT = 128 / 3000  # the gradient's change across the canvas: that of a 128-pixel shapes image


def make_canvas(rng, objects: tuple, size: tuple = CANVAS, object_sizes: tuple = OBJECT_SIZES):
    """A canvas of `size` (width, height) with between objects[0] and objects[1] shapes -> (PIL image,
    [{"category_id", "bbox": [x, y, w, h]}])."""
    width, height = size
    return make_image(
        rng, height, width, objects[1], *object_sizes, CATEGORIES, min_objects=objects[0], gradient=GRADIENT
    )


def cut_tiles(image, annotations: list, tile: tuple, origin: tuple = (0, 0)):
    """The `tile`-sized (width, height) pieces of `image` on a grid starting at `origin` (whole tiles only)
    -> [(PIL image, [{"category_id", "bbox"}])], each object's box clipped to its tile where at least
    MIN_VISIBLE of the box is inside."""
    tile_w, tile_h = tile
    boxes = np.array([a["bbox"] for a in annotations], np.float64).reshape(-1, 4)
    x0, y0 = boxes[:, 0], boxes[:, 1]
    x1, y1 = x0 + boxes[:, 2], y0 + boxes[:, 3]
    pieces = []
    for top in range(origin[1], image.height - tile_h + 1, tile_h):
        for left in range(origin[0], image.width - tile_w + 1, tile_w):
            cx0, cy0 = np.clip(x0 - left, 0, tile_w), np.clip(y0 - top, 0, tile_h)
            cx1, cy1 = np.clip(x1 - left, 0, tile_w), np.clip(y1 - top, 0, tile_h)
            visible = (cx1 - cx0) * (cy1 - cy0) / (boxes[:, 2] * boxes[:, 3])
            kept = [
                {
                    "category_id": a["category_id"],
                    "bbox": [float(v) for v in (cx0[i], cy0[i], cx1[i] - cx0[i], cy1[i] - cy0[i])],
                }
                for i, a in enumerate(annotations)
                if visible[i] >= MIN_VISIBLE
            ]
            pieces.append((image.crop((left, top, left + tile_w, top + tile_h)), kept))
    return pieces


class _CocoWriter:
    """One split's images (PNG) and its COCO annotation file."""

    def __init__(self, root: Path, split: str):
        self.root, self.split = root, split
        self.image_dir = root / f"{split}2017"
        self.image_dir.mkdir(parents=True, exist_ok=True)
        self.images, self.annotations = [], []

    def add(self, image, objects: list):
        image_id = len(self.images) + 1
        name = f"{image_id:012d}.png"
        image.save(self.image_dir / name, compress_level=1)  # noisy pixels: fast zlib, about the same size
        self.images.append({"id": image_id, "file_name": name, "height": image.height, "width": image.width})
        for obj in objects:
            _, _, w, h = obj["bbox"]
            record = {"id": len(self.annotations) + 1, "image_id": image_id, "category_id": obj["category_id"]}
            self.annotations.append(record | {"bbox": obj["bbox"], "area": w * h, "iscrowd": 0})

    def close(self):
        (self.root / "annotations").mkdir(parents=True, exist_ok=True)
        categories = [{"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(CATEGORIES)]
        content = {"images": self.images, "annotations": self.annotations, "categories": categories}
        (self.root / "annotations" / f"instances_{self.split}2017.json").write_text(json.dumps(content))


def generate(root, train_canvases: int = 12, num_val: int = 8, seed: int = 0, tile: tuple = TILE) -> Path:
    """Write the set under `root`: train tiles from canvases of seed, val canvases of seed + 1."""
    if tile[0] < 1 or tile[1] < 1 or tile[0] > CANVAS[0] or tile[1] > CANVAS[1]:
        raise ValueError(f"tile {tile[0]} x {tile[1]}: expected 1 to {CANVAS[0]} x {CANVAS[1]} pixels")
    root = Path(root)
    train = _CocoWriter(root, "train")
    for index in range(1, train_canvases + 1):
        rng = np.random.default_rng([seed, index])
        image, objects = make_canvas(rng, TRAIN_OBJECTS)
        # each canvas's grid starts elsewhere, so the tiles also cover the canvases' right and bottom strips
        origin = tuple(int(rng.integers(0, (CANVAS[i] % tile[i]) + 1)) for i in (0, 1))
        for piece, kept in cut_tiles(image, objects, tile, origin):
            train.add(piece, kept)
    train.close()
    val = _CocoWriter(root, "val")
    for index in range(1, num_val + 1):
        val.add(*make_canvas(np.random.default_rng([seed + 1, index]), VAL_OBJECTS))
    val.close()
    return root


def tile_size(text: str) -> tuple[int, int]:
    width, _, height = text.partition(",")
    return int(width), int(height or width)


@entry_point
def main(argv=None):
    parser = ArgumentParser(prog="python -m deformable_detr.data.small_shapes", description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--train-canvases", type=int, default=12, help="canvases cut into the train tiles")
    parser.add_argument("--val", type=int, default=8, help="whole canvases in val2017")
    parser.add_argument("--tile", type=tile_size, default=TILE, help="W,H of the train tiles (default 256,256)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    generate(args.root, args.train_canvases, args.val, args.seed, args.tile)
    tiles = json.loads((args.root / "annotations" / "instances_train2017.json").read_text())["images"]
    size = f"{args.tile[0]} x {args.tile[1]}"
    print(f"wrote {len(tiles)} train tiles of {size} and {args.val} val canvases under {args.root}")


if __name__ == "__main__":
    main()
