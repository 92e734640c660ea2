"""Identities through the synthetic shapes video: MOTA, IDF1 and ID switches (motmetrics, an independent
implementation of the CLEAR MOT and identity metrics) of ByteTrack, SORT and OC-SORT (Roboflow's
`trackers`, deformable_detr/inference/tracking.py) on the quick start's model, and frames per second.

    python bench/tracking.py [--checkpoint output/shapes/checkpoint.safetensors] [--frames 200] [--seeds 0 1 2]
                             [--alike-seeds 100 101 102] [--threshold 0.3] [--batch-size 4]
                             [--output bench/results/tracking_cpu.txt]
                             [--alike-output bench/results/tracking_alike_cpu.txt]
                             [--before OLD_TRACKING.py] [--picture docs/tracking.png [--picture-frames 20 60 100 140]]

1. A video per seed (deformable_detr/data/shapes_video.py: `--frames` frames, 160 x 120, six shapes,
   25 frames/s), written as H.264 and decoded again, as `predict` reads it; the metrics are over them all.
   And a video of alike objects per `--alike-seeds` seed: four circles of one colour that cross, none
   leaving the frame, the first not drawn for 1.5 s from frame 60 (ALIKE), in their own report
   (`--alike-output`): colour cannot tell them apart, and re-identification must leave motion's ids.
2. The model's detections of every frame, once (`Detector.predict` at the lowest score a tracker is
   given, ByteTrack's 0.1, batches of `--batch-size`): the detector's frames/s.
3. Each tracker on those detections at `--threshold` (`Tracking.update`, as `Detector.track`): its own
   frames/s, and against the ground truth: MOTA, IDF1, ID switches, false positives, misses, MOTP
   (1 - IoU) and the objects mostly tracked / lost, an object counting where at least MIN_VISIBILITY
   of it is seen (a hypothesis on a less visible one is left out, MOTChallenge's distractor rule as
   motmetrics.preprocess applies it); a hypothesis is a detection with a track id (not -1). Each
   tracker with re-identification (the default) and without (motion alone), and with `--before`
   (another tracking.py, e.g. `git show c8c62ba~1:deformable_detr/inference/tracking.py > /tmp/before.py`,
   the one before issue 73) that one's default too, on the same detections. Then each of tracking.py's
   choices undone alone: re-identification waiting for the tracker to drop a lost track, no low-score
   stage, new tracks at the threshold + 0.1 (ByteTrack's authors'), duplicates across classes removed at
   IoU 0.5, duplicates removed at IoU 0.5 whatever their class (as before), duplicates kept.
4. The same trackers fed the ground truth with a detector's kind of noise (`noisy_detections`):
   the trackers alone, with good detections, with and without re-identification (and --before's).
5. `predict --track` (ByteTrack) on each video end to end (decoding, the model, the tracker, drawing the
   boxes, ids and trails, encoding): its own frames/s line; with --picture, the first video's annotated
   frames --picture-frames side by side, twice their size (docs/tracking.png).

The quick start's model scores low (its best detection on a val image is 0.4-0.6), so the threshold is
0.3, as bench/predict.py's."""

import contextlib
import io
import re
import sys
import tempfile
import time
from pathlib import Path

import kernels  # noqa: F401  (the BLAS set up before MLX loads)
from deformable_detr.errors import ArgumentParser, entry_point

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, load_average, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MIN_VISIBILITY = 0.5  # an object counts where at least half of it is seen
# the alike videos: four circles of shapes.py's one green, none leaving the frame, the first unseen 1.5 s
ALIKE = dict(objects=4, leave=0.0, alike="circle")
HIDDEN_FROM, HIDDEN_S = 60, 1.5
TRACKER_NAMES = ("bytetrack", "sort", "ocsort")
METRICS = ["mota", "idf1", "num_switches", "num_false_positives", "num_misses", "motp"]
METRICS += ["mostly_tracked", "mostly_lost", "num_unique_objects"]


def xywh(boxes) -> np.ndarray:
    boxes = np.asarray(boxes, np.float64).reshape(-1, 4)
    return np.concatenate([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], 1)


def iou_distances(objects, hypotheses) -> np.ndarray:
    """motmetrics' `distances.iou_matrix(objects, hypotheses, max_iou=0.5)` (x, y, w, h boxes): 1 - IoU,
    NaN (not a match) under IoU 0.5. Its own call fails on NumPy 2 in motmetrics 1.4.0, the newest
    release (np.asfarray; cheind/py-motmetrics#199, fixed on its main branch by #200): the same from its
    `boxiou`."""
    import motmetrics as mm

    objects, hypotheses = xywh(objects), xywh(hypotheses)
    distances = 1 - mm.distances.boxiou(objects[:, None], hypotheses[None, :])
    return np.where(distances > 0.5, np.nan, distances).reshape(len(objects), len(hypotheses))


def hypotheses(frame) -> tuple[list, np.ndarray]:
    """A tracked frame's `Detections` -> (track ids, x0, y0, x1, y1 boxes) of those with an id, each id
    once (a query's box under a second class carries the same id)."""
    ids, boxes = [], []
    for track_id, box in zip(frame.track_ids, frame.boxes, strict=True):
        if track_id >= 0 and int(track_id) not in ids:
            ids.append(int(track_id))
            boxes.append(box)
    return ids, np.asarray(boxes, np.float64).reshape(-1, 4)


def accumulate(truth: list, tracked: list, min_visibility: float = MIN_VISIBILITY):
    """A motmetrics accumulator of `tracked` (per frame, (ids, boxes) or `Detections` with `track_ids`)
    against `truth` (shapes_video's per-frame objects), matched at IoU >= 0.5."""
    import motmetrics as mm
    from motmetrics.lap import linear_sum_assignment

    accumulator = mm.MOTAccumulator(auto_id=True)
    for objects, frame in zip(truth, tracked, strict=True):
        ids, boxes = frame if isinstance(frame, tuple) else hypotheses(frame)
        if objects and ids:  # MOTChallenge's distractor rule: a hypothesis on a hardly seen object is dropped
            everything = iou_distances([o["box"] for o in objects], boxes)
            rows, columns = linear_sum_assignment(everything)
            dropped = {
                c
                for r, c in zip(rows, columns, strict=True)
                if np.isfinite(everything[r, c]) and objects[r]["visibility"] < min_visibility
            }
            ids = [i for c, i in enumerate(ids) if c not in dropped]
            boxes = np.delete(boxes, sorted(dropped), axis=0)
        counted = [o for o in objects if o["visibility"] >= min_visibility]
        accumulator.update([o["id"] for o in counted], ids, iou_distances([o["box"] for o in counted], boxes))
    return accumulator


def mot_metrics(accumulators: list) -> dict:
    """motmetrics' METRICS over the videos of `accumulators` together."""
    import motmetrics as mm

    names = [str(i) for i in range(len(accumulators))]
    summary = mm.metrics.create().compute_many(accumulators, metrics=METRICS, names=names, generate_overall=True)
    return {name: float(summary[name].loc["OVERALL"]) for name in METRICS}


def noisy_detections(truth: list, size: tuple, seed: int = 0, classes=None) -> list:
    """A detector's kind of `Detections` made from `truth` (shapes_video's per-frame objects), seeded:
    an object is found with a chance rising with its visibility (0 under 0.1, 0.95 from 0.6), its
    score lower the more it is hidden (0.15 + 0.75 x visibility, +- 0.1: a half-hidden object scores
    about 0.5), each box side moved by N(0, 5% of the box's side), one label in ten wrong; a false
    positive (score 0.3-0.7) in one frame in 20."""
    from deformable_detr.data.shapes import CATEGORIES
    from deformable_detr.inference.detector import Detections

    classes = classes or {i + 1: name for i, name in enumerate(CATEGORIES)}
    rng = np.random.default_rng(seed)
    width, height = size
    frames = []
    for objects in truth:
        boxes, scores, labels = [], [], []
        for o in objects:
            v = o["visibility"]
            if rng.uniform() >= 0.95 * np.clip((v - 0.1) / 0.5, 0, 1):
                continue
            x0, y0, x1, y1 = o["box"]
            side = np.array([x1 - x0, y1 - y0, x1 - x0, y1 - y0], np.float64)
            boxes.append(np.array(o["box"], np.float64) + rng.normal(0, 0.05, 4) * side)
            scores.append(float(np.clip(0.15 + 0.75 * v + rng.uniform(-0.1, 0.1), 0.01, 0.99)))
            wrong = rng.uniform() < 0.1
            labels.append(int(rng.choice(list(classes))) if wrong else o["category_id"])
        if rng.uniform() < 0.05:
            side = rng.uniform(16, 32)
            x, y = rng.uniform(0, width - side), rng.uniform(0, height - side)
            boxes.append(np.array([x, y, x + side, y + side]))
            scores.append(float(rng.uniform(0.3, 0.7)))
            labels.append(int(rng.choice(list(classes))))
        order = np.argsort(scores)[::-1]
        frames.append(
            Detections(
                boxes=np.asarray(boxes, np.float32).reshape(-1, 4)[order],
                scores=np.asarray(scores, np.float32)[order],
                labels=np.asarray(labels, np.int64)[order],
                names=[classes[labels[i]] for i in order],
                queries=np.arange(len(order)),
                image_size=size,
            )
        )
    return frames


def track_all(
    name: str, frames: list, images: list, threshold: float, fps: float, tracking=None, **options
) -> tuple[list, float]:
    """`frames` (every frame's `Detections`) and their `images` through a new `tracking` (a `Tracking` class,
    default tracking.py's) -> (the tracked frames, frames/s)."""
    from deformable_detr.inference.tracking import Tracking

    tracking = (tracking or Tracking)(name, threshold, fps, **options)
    start = time.perf_counter()
    tracked = [tracking.update(frame, image) for frame, image in zip(frames, images, strict=True)]
    return tracked, len(frames) / (time.perf_counter() - start)


def rows(videos: list, images: list, detections: list, threshold: float, runs: list) -> list[str]:
    """A table row per (label, tracker, options[, Tracking class]) of `runs`: its metrics over `videos` (each
    tracked on its `detections` and decoded `images`, a new tracker each) and the tracker's frames/s."""
    lines = []
    for label, name, options, *tracking in runs:
        accumulators, frames, seconds = [], 0, 0.0
        for video, decoded, found in zip(videos, images, detections, strict=True):
            tracked, rate = track_all(name, found, decoded, threshold, video.fps, *tracking, **options)
            accumulators.append(accumulate(video.truth, tracked))
            frames, seconds = frames + len(found), seconds + len(found) / rate
        lines.append(row(label, mot_metrics(accumulators), frames / seconds))
    return lines


def row(label: str, metrics: dict, rate: float) -> str:
    m = metrics
    return (
        f"| {label} | {m['mota']:.3f} | {m['idf1']:.3f} | {m['num_switches']:.0f} | {m['num_false_positives']:.0f} "
        f"| {m['num_misses']:.0f} | {m['motp']:.3f} | {m['mostly_tracked']:.0f} / {m['mostly_lost']:.0f} "
        f"| {rate:,.0f} |"
    )


def tracking_before(path: Path):
    """The `Tracking` class of another tracking.py (`--before`), imported beside this one (its relative imports
    resolve in deformable_detr.inference)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("deformable_detr.inference._tracking_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Tracking


def with_and_without(before=None) -> list:
    """Each tracker with re-identification (the default), without it (motion alone), and `before`'s default;
    then ByteTrack's re-identification waiting for the tracker to drop a lost track (refind off)."""
    runs = []
    for name in TRACKER_NAMES:
        runs += [(name, name, {}), (f"{name}, no re-identification", name, {"reidentify": False})]
        runs += [(f"{name}, before", name, {}, before)] if before is not None else []
    return [*runs, ("bytetrack, re-identification without refind", "bytetrack", {"reidentify": {"refind": False}})]


def detect_videos(detector, videos: list, batch_size: int, tmp: Path, kind: str) -> tuple[list, list, float, list]:
    """Each of `videos` written as H.264 and decoded again, as `predict` reads it, and the detector's
    detections of every frame at LOW_SCORE -> (the detections, the decoded frames, the detector's seconds,
    the videos' paths)."""
    from deformable_detr.data.shapes_video import write_video
    from deformable_detr.inference.tracking import LOW_SCORE

    import av

    detections, images, seconds, paths = [], [], 0.0, []
    for video in videos:
        path = write_video(tmp / f"{kind}_{video.seed}.mp4", video)
        with av.open(str(path)) as source:
            frames = [frame.to_image() for frame in source.decode(video=0)]
        images.append(frames)
        detector.predict(frames[:batch_size], LOW_SCORE, batch_size=batch_size)  # warm-up
        start, found = time.perf_counter(), []
        for i in range(0, len(frames), batch_size):
            found += detector.predict(frames[i : i + batch_size], LOW_SCORE, batch_size=batch_size)
        seconds += time.perf_counter() - start
        detections.append(found)
        paths.append(path)
    return detections, images, seconds, paths


def described(videos: list, what: str) -> str:
    boxes = [o for video in videos for objects in video.truth for o in objects]
    counted = sum(o["visibility"] >= MIN_VISIBILITY for o in boxes)
    width, height = videos[0].size
    return (
        f"videos: shapes_video seeds {', '.join(str(video.seed) for video in videos)}, each {len(videos[0].frames)} "
        f"frames of {width} x {height} at {videos[0].fps:g} frames/s, {what}; {counted} boxes at least "
        f"{MIN_VISIBILITY:g} visible (counted), {len(boxes) - counted} less (left out)"
    )


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "output" / "shapes" / "checkpoint.safetensors")
    parser.add_argument("--frames", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="a video each")
    parser.add_argument("--alike-seeds", type=int, nargs="+", default=[100, 101, 102], help="an alike video each")
    parser.add_argument("--threshold", type=float, default=0.3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "tracking_cpu.txt")
    parser.add_argument("--alike-output", type=Path, default=ROOT / "bench" / "results" / "tracking_alike_cpu.txt")
    parser.add_argument("--before", type=Path, help="another tracking.py, measured beside this one (rows 'before')")
    parser.add_argument(
        "--picture", type=Path, help="write the first video's --track frames PICTURE_FRAMES side by side"
    )
    parser.add_argument("--picture-frames", type=int, nargs="+", default=[20, 60, 100, 140])
    args = parser.parse_args(argv)
    if args.before is not None and not args.before.is_file():
        parser.error(f"--before {args.before}: no such file (another version of tracking.py)")

    from deformable_detr.data.shapes_video import make_video
    from deformable_detr.inference.detector import Detector
    from deformable_detr.inference.tracking import DUPLICATES_IOU
    from deformable_detr.predict import main as predict

    import av
    from PIL import Image

    before = tracking_before(args.before) if args.before is not None else None
    started = (
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU: {cpu_model(count=True)}; "
        f"load average at start: {load_average()}"
    )
    videos = [make_video(seed, args.frames) for seed in args.seeds]
    hidden = (0, HIDDEN_FROM, round(HIDDEN_S * videos[0].fps))
    alike = [make_video(seed, args.frames, hidden=hidden, **ALIKE) for seed in args.alike_seeds]
    detector = Detector.load(args.checkpoint, precision="float32")
    with tempfile.TemporaryDirectory() as tmp:
        detections, images, seconds, paths = detect_videos(detector, videos, args.batch_size, Path(tmp), "shapes")
        found = detect_videos(detector, alike, args.batch_size, Path(tmp), "alike")
        alike_detections, alike_images, alike_seconds, _ = found
        end_to_end = []
        for video, path in zip(videos, paths, strict=True):
            with contextlib.redirect_stdout(io.StringIO()) as said, contextlib.redirect_stderr(io.StringIO()):
                argv = ["--checkpoint", str(args.checkpoint), "--precision", "float32"]
                argv += ["--threshold", str(args.threshold), "--batch-size", str(args.batch_size)]
                predict([*argv, "--output-dir", str(Path(tmp) / "out"), "--track", str(path)])
            end_to_end.append(float(re.search(r"([\d.]+) frames/s", said.getvalue()).group(1)))
            if args.picture and video is videos[0]:
                with av.open(str(Path(tmp) / "out" / path.name)) as drawn:
                    shown = [f.to_ndarray(format="rgb24") for f in drawn.decode(video=0)]
                picture = np.concatenate([shown[i] for i in args.picture_frames], axis=1)
                twice = Image.fromarray(picture).resize((picture.shape[1] * 2, picture.shape[0] * 2))
                twice.quantize(256).save(args.picture, optimize=True)  # a docs picture: 256 colours
    frames = sum(len(found) for found in detections + alike_detections)
    model = (
        f"the quick start's model ({args.checkpoint}), float32, batches of {args.batch_size}: the detector "
        f"{frames / (seconds + alike_seconds):.1f} frames/s"
    )
    before_said = [f"before: {args.before}'s Tracking on the same detections"] if before is not None else []
    header = [
        "| tracker | MOTA | IDF1 | ID switches | false positives | misses | MOTP (1 - IoU) | mostly tracked / lost "
        "| tracker frames/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    runs = with_and_without(before)
    ablations = [  # each of tracking.py's other choices undone alone
        ("bytetrack, no low-score stage", "bytetrack", {"low_score": None}),
        ("bytetrack, new tracks at the threshold + 0.1", "bytetrack", {"track_activation_threshold": None}),
        ("bytetrack, duplicates: IoU 0.5 across classes", "bytetrack", {"duplicates": (DUPLICATES_IOU[0], 0.5)}),
        ("bytetrack, duplicates: IoU 0.5, class-agnostic (before)", "bytetrack", {"duplicates": (0.5, 0.5)}),
        ("bytetrack, duplicates kept", "bytetrack", {"duplicates": None}),
    ]
    for _, _, options in ablations:  # its authors' det_thresh: the high-score bar + 0.1
        if "track_activation_threshold" in options:
            options["track_activation_threshold"] = min(args.threshold + 0.1, 1.0)
    lines = [started, described(videos, "6 objects"), *before_said]
    lines.append(
        f"{model}; predict --track (bytetrack) end to end (decode, detect, track, draw, encode) "
        f"{', '.join(f'{rate:.1f}' for rate in end_to_end)} frames/s"
    )
    lines += ["", f"The model's detections, threshold {args.threshold:g}:", "", *header]
    lines += rows(videos, images, detections, args.threshold, runs + ablations)
    noisy = [noisy_detections(video.truth, video.size, video.seed) for video in videos]
    lines += ["", "The ground truth with noise (noisy_detections), threshold 0.5:", "", *header]
    lines += rows(videos, images, noisy, 0.5, runs)
    report(lines, args.output)
    what = f"4 circles of one colour, the first not drawn from frame {hidden[1]} for {hidden[2]} frames"
    lines = [started, described(alike, what), *before_said, model]
    lines += ["", f"The model's detections, threshold {args.threshold:g}:", "", *header]
    lines += rows(alike, alike_images, alike_detections, args.threshold, runs)
    noisy = [noisy_detections(video.truth, video.size, video.seed) for video in alike]
    lines += ["", "The ground truth with noise (noisy_detections), threshold 0.5:", "", *header]
    lines += rows(alike, alike_images, noisy, 0.5, runs)
    report(lines, args.alike_output)


if __name__ == "__main__":
    main()
