"""Detect objects in images and videos and draw them; show where the model looks.

    python -m deformable_detr.predict --config C --checkpoint W [--threshold 0.5] [--output-dir D]
        [--batch-size N] [--attention [--attention-layer N]] [--encoder-pixel X,Y] [--skip-unreadable]
        [--set section.key=value ...] INPUT...

An INPUT is an image, a folder (its images), a glob ('photos/*.jpg') or a video (the `video` extra).
For each image writes D/<stem>.png (boxes, class names, scores) and D/<stem>.json (every top-100
detection: label, name, score, box x0, y0, x1, y1 in pixels, the decoder query); with --attention,
D/<stem>.attention.png and, for each detection at or above the threshold, its sampling points and
weights in the JSON; with --encoder-pixel, D/<stem>.encoder.png and .encoder.json. For a video,
D/<stem>.mp4 (annotated) and D/<stem>.json (detections per frame)."""

import argparse
import contextlib
import glob
import json
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from .attention_points import encoder_queries, in_pixels, recording
from .cli import ArgumentParser, UsageError, entry_point
from .config import load_config
from .data import build_dataset
from .data.loader import collate
from .data.transforms import normalize, resize
from .model import post_process
from .visualize import draw_detections, draw_sampling_points, grid
from .weights import config_from_weights, load_trained_model

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
VIDEO_SUFFIXES = {".mp4", ".mov", ".avi", ".mkv", ".webm", ".m4v"}
ATTENTION_PANELS = 6  # the top detections drawn in <stem>.attention.png


@dataclass
class Looking:
    """What to record: the decoder layer whose sampling points go with each detection at or above
    `threshold`, and the pixel (x, y) whose encoder queries (last encoder layer) are shown."""

    decoder_layer: int | None = None
    encoder_pixel: tuple | None = None
    threshold: float = 0.5


def detect_batch(model, images: list, size: int, max_size: int, looking: Looking | None = None) -> list[dict]:
    """PIL images -> post-processed detections per image, boxes in the image's own pixels; with
    `looking`, "attention" (for the detections it asks for) and "encoder" (in_pixels' dicts)."""
    empty = {"boxes": np.zeros((0, 4), np.float32), "labels": np.zeros(0, np.int64)}
    samples = [normalize(*resize(image.convert("RGB"), empty, size, max_size)) for image in images]
    pixels, mask, _ = collate(samples)
    asked = looking is not None
    decoder_layer = looking.decoder_layer if asked else None
    encoder_layer = -1 if asked and looking.encoder_pixel else None
    with recording(model, decoder_layer, encoder_layer) if asked else contextlib.nullcontext({}) as recorders:
        outputs = model(mx.array(pixels), mx.array(mask))
    results = post_process(outputs, [[image.height, image.width] for image in images])
    calls = {part: recorder.calls[0] for part, recorder in recorders.items()}
    mx.eval(results, [(c.locations, c.weights, c.reference_points) for c in calls.values()])
    results = [{k: np.array(v) for k, v in result.items()} for result in results]
    for i, (image, result) in enumerate(zip(images, results, strict=True)):
        if "decoder" in calls:
            shown = result["queries"][result["scores"] >= looking.threshold]
            result["attention"] = in_pixels(calls["decoder"], i, image.width, image.height, shown)
        if "encoder" in calls:
            queries = encoder_queries(calls["encoder"], i, *looking.encoder_pixel, image.width, image.height)
            result["encoder"] = in_pixels(calls["encoder"], i, image.width, image.height, queries)
    return results


def detect(model, image: Image.Image, size: int, max_size: int) -> dict:
    """One PIL image -> post-processed detections with boxes in the image's own pixels."""
    return detect_batch(model, [image], size, max_size)[0]


def class_names(recorded: dict, data_cfg) -> dict:
    """{category id: name} of the model's outputs: those its weights record (converted COCO weights,
    this project's checkpoints); else the config's dataset's, when its files are there; else {}."""
    if recorded:
        return recorded
    try:
        return build_dataset("val", data_cfg, prepare=False).class_names()
    except FileNotFoundError:
        return {}


def find_inputs(arguments: list[str]) -> list[Path]:
    """Each argument: a file as given, a folder's images (sorted), or a glob's matches (sorted)."""
    found = []
    for argument in arguments:
        path = Path(argument)
        if path.is_dir():
            images = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
            if not images:
                raise UsageError(f"{path}: a folder with no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
            found += images
        elif not path.exists() and glob.has_magic(argument):
            matches = sorted(Path(p) for p in glob.glob(argument) if Path(p).is_file())
            if not matches:
                raise UsageError(f"{argument}: no file matches")
            found += matches
        elif not path.is_file():
            raise FileNotFoundError(f"{path}: no such image file")
        else:
            found.append(path)
    stems = {}
    for path in dict.fromkeys(found):
        if path.stem in stems:
            raise UsageError(f"{stems[path.stem]} and {path} would write the same outputs; predict them apart")
        stems[path.stem] = path
    return list(stems.values())


def open_image(path: Path, header_only: bool = False) -> Image.Image:
    try:
        with Image.open(path) as image:
            return image if header_only else image.convert("RGB")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such image file") from None
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"{path}: cannot read it as an image ({error})") from None


def readable_images(paths: list[Path], skip: bool, encoder_pixel) -> list[Path]:
    """The images whose header reads (an unreadable one: an error, or named and left out with `skip`),
    each checked to hold the encoder pixel, before any work."""
    kept = []
    for path in paths:
        try:
            size = open_image(path, header_only=True).size
        except ValueError as error:
            if not skip:
                raise ValueError(f"{error}; --skip-unreadable leaves such images out") from None
            print(f"skipped: {error}")
            continue
        if encoder_pixel and not (0 <= encoder_pixel[0] < size[0] and 0 <= encoder_pixel[1] < size[1]):
            x, y = encoder_pixel
            raise UsageError(f"--encoder-pixel {x:g},{y:g} is outside {path} ({size[0]} x {size[1]} pixels)")
        kept.append(path)
    return kept


def records(result: dict, names: dict) -> list[dict]:
    """The JSON of one image's detections (best first); those at or above the threshold of `looking`
    carry their sampling points and weights (in_pixels'), rounded."""
    seen = result.get("attention", {})
    out = []
    for j, (score, label, box, query) in enumerate(
        zip(result["scores"], result["labels"], result["boxes"], result["queries"], strict=True)
    ):
        record = {"label": int(label), "name": names.get(int(label), str(int(label))), "score": float(score)}
        record |= {"box": [float(v) for v in box], "query": int(query)}
        if j < len(seen.get("weights", ())):  # detections come best first, so these are the shown ones
            record["reference_point"] = np.round(seen["reference"][j], 3).tolist()
            if "box" in seen:
                record["reference_box"] = np.round(seen["box"][j], 3).tolist()
            record["sampling_points"] = np.round(seen["points"][j], 3).tolist()
            record["sampling_weights"] = np.round(seen["weights"][j], 6).tolist()
        out.append(record)
    return out


def attention_picture(image: Image.Image, result: dict, names: dict, layer: int) -> Image.Image | None:
    """The top detections' sampling points side by side (None when no detection is at the threshold)."""
    seen, panels = result["attention"], []
    for j in range(min(len(seen["weights"]), ATTENTION_PANELS)):
        label, query = int(result["labels"][j]), int(result["queries"][j])
        title = f"{names.get(label, label)} {result['scores'][j]:.2f}: query {query}, decoder layer {layer}"
        box = result["boxes"][j]
        panels.append(
            draw_sampling_points(image, seen["points"][j], seen["weights"][j], seen["reference"][j], box, title)
        )
    return grid(panels, columns=min(len(panels), 3), scale=1) if panels else None


def encoder_view(image: Image.Image, result: dict, pixel: tuple, layer: int) -> tuple[Image.Image, dict]:
    """The encoder queries at `pixel`, one per level: a panel each, and their JSON."""
    seen, panels, queries = result["encoder"], [], []
    views = zip(seen["points"], seen["weights"], seen["reference"], strict=True)
    for level, (points, weights, reference) in enumerate(views):
        title = f"encoder layer {layer}: the level {level} query at ({pixel[0]:g}, {pixel[1]:g})"
        panels.append(draw_sampling_points(image, points, weights, reference, None, title))
        queries.append(
            {
                "level": level,
                "reference_point": np.round(reference, 3).tolist(),
                "sampling_points": np.round(points, 3).tolist(),
                "sampling_weights": np.round(weights, 6).tolist(),
            }
        )
    view = {"pixel": list(pixel), "layer": layer, "queries": queries}
    return grid(panels, columns=min(len(panels), 4), scale=1), view


def write_outputs(path: Path, image: Image.Image, result: dict, names: dict, args, layers: tuple) -> str:
    """An image's pictures and JSON files in args.output_dir -> the line that reports them."""
    stem = args.output_dir / path.stem
    draw_detections(image, result, names, args.threshold).save(f"{stem}.png")
    detections = records(result, names)
    Path(f"{stem}.json").write_text(json.dumps(detections, indent=1))
    kept = sum(r["score"] >= args.threshold for r in detections)
    line = f"{path}: {kept} detection(s) at score >= {args.threshold} -> {stem}.png"
    if "attention" in result:
        picture = attention_picture(image, result, names, layers[0])
        if picture is not None:
            picture.save(f"{stem}.attention.png", compress_level=1)  # big pictures: fast zlib
            line += f", {stem}.attention.png"
    if "encoder" in result:
        picture, view = encoder_view(image, result, args.encoder_pixel, layers[1])
        picture.save(f"{stem}.encoder.png", compress_level=1)
        Path(f"{stem}.encoder.json").write_text(json.dumps(view, indent=1))
        line += f", {stem}.encoder.png"
    return line


def loaded_batches(paths: list[Path], batch_size: int, skip: bool, bar):
    """Batches of (path, image); an image that does not load stops the run, or with `skip` is named
    and left out."""
    batch = []
    for path in paths:
        try:
            batch.append((path, open_image(path)))
        except ValueError as error:
            if not skip:
                raise ValueError(f"{error}; --skip-unreadable leaves such images out") from None
            bar.write(f"skipped: {error}")
            bar.update()
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def predict_images(model, paths: list[Path], names: dict, cfg, args, looking: Looking | None, layers: tuple):
    done, start = 0, time.perf_counter()
    with tqdm(total=len(paths), unit="image", desc="predict") as bar:
        for batch in loaded_batches(paths, args.batch_size, args.skip_unreadable, bar):
            images = [image for _, image in batch]
            results = detect_batch(model, images, cfg.data.val_size, cfg.data.max_size, looking)
            for (path, image), result in zip(batch, results, strict=True):
                bar.write(write_outputs(path, image, result, names, args, layers))
            bar.update(len(batch))
            done += len(batch)
    seconds = time.perf_counter() - start
    print(f"{done} image(s) in {seconds:.1f} s: {done / seconds:.2f} images/s (batches of {args.batch_size})")


def pixel(text: str) -> tuple[float, float]:
    try:
        x, y = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected X,Y in the image's pixels, e.g. 120,80") from None
    return x, y


@entry_point
def main(argv=None):
    parser = ArgumentParser(prog="python -m deformable_detr.predict", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", help="default: the config the weights record (a checkpoint's, or converted weights')"
    )
    parser.add_argument("--checkpoint", required=True, help="a weights file, or hf://ORG/NAME[@REVISION] on the Hub")
    parser.add_argument("--threshold", type=float, default=0.5, help="draw detections scoring at least this")
    parser.add_argument("--output-dir", type=Path, default=Path("predictions"))
    parser.add_argument("--batch-size", type=int, default=1, help="images (or frames) a forward")
    parser.add_argument("--attention", action="store_true", help="the detections' sampling points and weights")
    parser.add_argument("--attention-layer", type=int, default=-1, help="the decoder layer shown (default the last)")
    parser.add_argument("--encoder-pixel", type=pixel, help="X,Y: where the last encoder layer's queries there look")
    parser.add_argument("--skip-unreadable", action="store_true", help="name unreadable images and go on")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument(
        "--raw-weights", action="store_true", help="the trained weights, not their EMA (where the file has one)"
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size}: must be at least 1")
    cfg = load_config(args.config, args.set) if args.config else config_from_weights(args.checkpoint, args.set)
    if not -cfg.model.dec_layers <= args.attention_layer < cfg.model.dec_layers:
        n = cfg.model.dec_layers
        raise UsageError(f"--attention-layer {args.attention_layer}: the model has {n} decoder layers (0 to {n - 1})")
    layers = (args.attention_layer % cfg.model.dec_layers, cfg.model.enc_layers - 1)
    paths = find_inputs(args.inputs)
    videos = [path for path in paths if path.suffix.lower() in VIDEO_SUFFIXES]
    images = [path for path in paths if path.suffix.lower() not in VIDEO_SUFFIXES]
    if videos:
        from .video import check_video_arguments

        check_video_arguments(videos, args)
    images = readable_images(images, args.skip_unreadable, args.encoder_pixel)
    model, recorded_names = load_trained_model(args.checkpoint, cfg, raw=args.raw_weights)
    names = class_names(recorded_names, cfg.data)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    looking = Looking(layers[0] if args.attention else None, args.encoder_pixel, args.threshold)
    asked = args.attention or args.encoder_pixel is not None
    if images:
        predict_images(model, images, names, cfg, args, looking if asked else None, layers)
    for path in videos:
        from .video import predict_video

        predict_video(path, model, names, cfg, args)


if __name__ == "__main__":
    main()
