"""Detect objects in images and videos and draw them; show where the model looks.

    deformable-detr predict --checkpoint W [--config C] [--raw-weights] [--precision P] [--threshold 0.5]
        [--output-dir D] [--batch-size N] [--attention [--attention-layer N]] [--encoder-pixel X,Y]
        [--skip-unreadable] [--slice W,H [--overlap 0.2]] [--track [--tracker T]] INPUT... [section.key=value ...]

(also `python -m deformable_detr.predict`). An INPUT is an image, a folder (its images), a glob
('photos/*.jpg') or a video (the `video` extra); a config override `section.key=value` may stand
before, among or after them (a path that exists is an INPUT).
For each image writes D/<stem>.png (boxes, class names, scores) and D/<stem>.json (each detection at or
above the threshold: label, name, score, box x0, y0, x1, y1 in pixels, the decoder query:
`Detections.to_json()`); with --attention, D/<stem>.attention.png and each detection's sampling points
and weights in the JSON; with --encoder-pixel, D/<stem>.encoder.png and .encoder.json. For a video,
D/<stem>.mp4 (annotated) and D/<stem>.json (detections per frame). Built on `Detector`.

--track (videos): an id per object through the frames (`Detector.track`; --tracker bytetrack, sort or
ocsort, Roboflow's trackers: the `track` extra), drawn with a trail and in each detection's JSON as
track_id (-1: none; docs/tracking.md).

--batch-size N: a forward takes at most N images of one resized size, none padded, so every result is
that of the image alone (`Detector`'s batching rule); images are written as their batches complete.

--slice W,H: each image's detections from W x H slices overlapping by --overlap (a fraction of a slice),
N slices a forward, merged in the image's pixels, for objects too small at the model's input size
(inference/slicing.py, docs/slicing.md; the `slice` extra)."""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from ..errors import UsageError, entry_point
from ..inference.detector import Detections, Detector
from ..inference.inputs import VIDEO_SUFFIXES, Unreadable, displayed_size, find_inputs
from ..inference.slicing import OVERLAP, parse_slice
from ..inference.tracking import TRACKERS
from ..inference.visualize import draw_sampling_points, grid
from ..models.combinations import check_model
from .cli import add_model_arguments, command_parser, load_detector, model_config, note_old_spelling, split_overrides
from .predict_video import check_video_arguments, predict_video

ATTENTION_PANELS = 6  # the top detections drawn in <stem>.attention.png


def unique_stems(paths: list[Path]) -> list[Path]:
    """`paths`, each once; two of one stem would write the same outputs: an error."""
    stems = {}
    for path in dict.fromkeys(paths):
        if path.stem in stems:
            raise UsageError(f"{stems[path.stem]} and {path} would write the same outputs; predict them apart")
        stems[path.stem] = path
    return list(stems.values())


def readable_images(paths: list[Path], skip: bool, encoder_pixel) -> list[Path]:
    """The images whose header reads (an unreadable one: an error, or named and left out with `skip`: the
    skip-unreadable rule, inputs.Unreadable), each checked to hold the encoder pixel, before any work."""
    unreadable, kept = Unreadable(skip, "--skip-unreadable", print), []
    for path in paths:
        size = unreadable.read(path, displayed_size)
        if size is None:
            continue
        if encoder_pixel and not (0 <= encoder_pixel[0] < size[0] and 0 <= encoder_pixel[1] < size[1]):
            x, y = encoder_pixel
            raise UsageError(f"--encoder-pixel {x:g},{y:g} is outside {path} ({size[0]} x {size[1]} pixels)")
        kept.append(path)
    return kept


def attention_picture(image: Image.Image, result: Detections, layer: int) -> Image.Image | None:
    """The top detections' sampling points side by side (None when no detection is at the threshold)."""
    seen, panels = result.attention, []
    for j in range(min(len(result), ATTENTION_PANELS)):
        title = f"{result.names[j]} {result.scores[j]:.2f}: query {result.queries[j]}, decoder layer {layer}"
        panels.append(
            draw_sampling_points(
                image, seen["points"][j], seen["weights"][j], seen["reference"][j], result.boxes[j], title
            )
        )
    return grid(panels, columns=min(len(panels), 3), scale=1) if panels else None


def encoder_view(image: Image.Image, result: Detections, pixel: tuple, layer: int) -> tuple[Image.Image, dict]:
    """The encoder queries at `pixel`, one per level: a panel each, and their JSON."""
    seen, panels, queries = result.encoder, [], []
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


def write_outputs(path: Path, image: Image.Image, result: Detections, args, layers: tuple) -> str:
    """An image's pictures and JSON files in args.output_dir -> the line that reports them."""
    stem = args.output_dir / path.stem
    result.draw(image).save(f"{stem}.png")
    Path(f"{stem}.json").write_text(json.dumps(result.to_json(), indent=1))
    line = f"{path}: {len(result)} detection(s) at score >= {args.threshold} -> {stem}.png"
    if result.attention is not None:
        picture = attention_picture(image, result, layers[0])
        if picture is not None:
            picture.save(f"{stem}.attention.png", compress_level=1)  # big pictures: fast zlib
            line += f", {stem}.attention.png"
    if result.encoder is not None:
        picture, view = encoder_view(image, result, args.encoder_pixel, layers[1])
        picture.save(f"{stem}.encoder.png", compress_level=1)
        Path(f"{stem}.encoder.json").write_text(json.dumps(view, indent=1))
        line += f", {stem}.encoder.png"
    return line


def predict_images(detector: Detector, paths: list[Path], args, layers: tuple):
    done, start = 0, time.perf_counter()
    looking = (layers[0] if args.attention else None, args.encoder_pixel)
    with tqdm(total=len(paths), unit="image", desc="predict") as bar:

        def skipped(message: str) -> None:  # an image that does not load (--skip-unreadable): named, counted
            bar.write(message)
            bar.update()

        unreadable = Unreadable(args.skip_unreadable, "--skip-unreadable", skipped)
        # Detector.predict's batches (one resized size a forward): the results of --batch-size 1
        for batch in detector.predict_batches(paths, unreadable, args.threshold, args.batch_size, looking, args.sliced):
            for _, image, result in batch:
                bar.write(write_outputs(result.path, image, result, args, layers))
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


def build_parser():
    """predict's parser (docs/commands.md is generated from it)."""
    parser = command_parser("predict", __doc__)
    add_model_arguments(parser, precision="auto", overrides=False)  # the overrides: among the INPUTs
    parser.add_argument("--threshold", type=float, default=0.5, help="keep detections scoring at least this")
    parser.add_argument("--output-dir", type=Path, default=Path("predictions"))
    parser.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="images (or frames; slices with --slice) a forward, of one resized size: the same results",
    )
    parser.add_argument("--attention", action="store_true", help="the detections' sampling points and weights")
    parser.add_argument("--attention-layer", type=int, default=-1, help="the decoder layer shown (default the last)")
    parser.add_argument("--encoder-pixel", type=pixel, help="X,Y: where the last encoder layer's queries there look")
    parser.add_argument("--skip-unreadable", action="store_true", help="name unreadable images and go on")
    parser.add_argument("--slice", metavar="W,H", help="detect on W x H slices of each image (pixels)")
    parser.add_argument("--overlap", metavar="F", help=f"of a slice, with --slice (default {OVERLAP})")
    # the old spelling of an override (cli.OLD_SPELLINGS), one release more: not in --help
    parser.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--track", action="store_true", help="videos: an id per object through the frames")
    parser.add_argument("--tracker", choices=TRACKERS, help=f"with --track (default {TRACKERS[0]}; the track extra)")
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="an image, folder, glob or video; or section.key=value, a config override (as in every command)",
    )
    return parser


def parse_args(argv=None):
    args = build_parser().parse_intermixed_args(argv)  # overrides and inputs in any order
    overrides, args.inputs = split_overrides(args.inputs, others=True)
    if args.set:
        note_old_spelling("predict --set KEY=VALUE")
    args.overrides = [*split_overrides(args.set)[0], *overrides]
    if not args.inputs:
        raise UsageError("no INPUT: an image, folder, glob or video to predict (the rest are config overrides)")
    if args.tracker and not args.track:
        raise UsageError(f"--tracker {args.tracker}: the tracker of --track; add --track")
    named = [text for text in args.inputs if args.track and text in TRACKERS and not Path(text).exists()]
    if named:  # the spelling before --tracker
        raise UsageError(f"--track {named[0]}: name the tracker with --tracker {named[0]}")
    args.tracker = args.tracker or TRACKERS[0]
    if args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size}: must be at least 1")
    args.sliced = parse_slice(args.slice, args.overlap, ("--slice", "--overlap"))  # ((W, H), overlap) or None
    if args.sliced and (args.attention or args.encoder_pixel is not None):
        raise UsageError("--attention and --encoder-pixel show one forward of a whole image; not with --slice")
    return args


@entry_point
def main(argv=None):
    args = parse_args(argv)
    cfg = model_config(args)  # bad input is named before any work
    check_model(cfg.model)  # before the inputs are read (Detector.load checks it again)
    decoders = cfg.model.dec_layers
    if not -decoders <= args.attention_layer < decoders:
        raise UsageError(
            f"--attention-layer {args.attention_layer}: the model has {decoders} decoder layers (0 to {decoders - 1})"
        )
    layers = (args.attention_layer % decoders, cfg.model.enc_layers - 1)
    paths = unique_stems(find_inputs(args.inputs))
    videos = [path for path in paths if path.suffix.lower() in VIDEO_SUFFIXES]
    images = [path for path in paths if path.suffix.lower() not in VIDEO_SUFFIXES]
    if args.track and images:
        raise UsageError(f"--track follows objects from frame to frame of a video; {images[0]} is an image")
    if videos:
        if args.sliced:
            raise UsageError(f"--slice is for images, not videos ({videos[0]})")
        check_video_arguments(videos, args)
    images = readable_images(images, args.skip_unreadable, args.encoder_pixel)
    detector = load_detector(args, cfg)
    if (args.attention or args.encoder_pixel is not None) and detector.precision.asked == "auto":
        print("the attention view: float32 (auto: where the model looks as float32 computes it)", file=sys.stderr)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    if images:
        predict_images(detector, images, args, layers)
    for path in videos:
        predict_video(path, detector, args)


if __name__ == "__main__":
    main()
