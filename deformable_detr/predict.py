"""Detect objects in image files and draw them.

    python -m deformable_detr.predict --config C --checkpoint W [--threshold 0.5] [--output-dir D]
                                      [--set section.key=value ...] IMAGE...

For each IMAGE writes D/<name>.png (boxes, class names, scores) and D/<name>.json (every top-100
detection: label, name, score, box x0, y0, x1, y1 in pixels)."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from PIL import Image, UnidentifiedImageError

from .cli import ArgumentParser, entry_point
from .config import load_config
from .data import build_dataset
from .data.transforms import normalize, resize
from .model import post_process
from .visualize import draw_detections
from .weights import load_trained_model


def detect(model, image: Image.Image, size: int, max_size: int) -> dict:
    """One PIL image -> post-processed detections with boxes in the image's own pixels."""
    empty = {"boxes": np.zeros((0, 4), np.float32), "labels": np.zeros(0, np.int64)}
    resized, _ = resize(image.convert("RGB"), empty, size, max_size)
    pixels, _ = normalize(resized, empty)
    outputs = model(mx.array(pixels[None]), mx.zeros((1, *pixels.shape[:2]), dtype=mx.bool_))
    result = post_process(outputs, [[image.height, image.width]])[0]
    return {k: np.array(v) for k, v in result.items()}


def class_names(recorded: dict, data_cfg) -> dict:
    """{category id: name} of the model's outputs: those its weights record (converted COCO weights,
    this project's checkpoints); else the config's dataset's, when its files are there; else {}."""
    if recorded:
        return recorded
    try:
        return build_dataset("val", data_cfg, prepare=False).class_names()
    except FileNotFoundError:
        return {}


def open_image(path: Path) -> Image.Image:
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such image file") from None
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"{path}: cannot read it as an image ({error})") from None


@entry_point
def main(argv=None):
    parser = ArgumentParser(prog="python -m deformable_detr.predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--threshold", type=float, default=0.5, help="draw detections scoring at least this")
    parser.add_argument("--output-dir", type=Path, default=Path("predictions"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument(
        "--raw-weights", action="store_true", help="the trained weights, not their EMA (where the file has one)"
    )
    parser.add_argument("images", nargs="+", type=Path)
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.set)
    images = [open_image(path) for path in args.images]  # every path checked before any work
    model, recorded_names = load_trained_model(args.checkpoint, cfg, raw=args.raw_weights)
    names = class_names(recorded_names, cfg.data)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for path, image in zip(args.images, images, strict=True):
        detections = detect(model, image, cfg.data.val_size, cfg.data.max_size)
        draw_detections(image, detections, names, args.threshold).save(args.output_dir / f"{path.stem}.png")
        records = [
            {"label": int(c), "name": names.get(int(c), str(int(c))), "score": float(s), "box": [float(v) for v in b]}
            for s, c, b in zip(detections["scores"], detections["labels"], detections["boxes"], strict=True)
        ]
        (args.output_dir / f"{path.stem}.json").write_text(json.dumps(records, indent=1))
        kept = sum(r["score"] >= args.threshold for r in records)
        print(f"{path}: {kept} detection(s) at score >= {args.threshold} -> {args.output_dir / path.stem}.png")


if __name__ == "__main__":
    main()
