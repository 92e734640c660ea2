"""A synthetic video for tracking: the shapes set's classes moving on a textured background, with the
ground-truth identity of every object in every frame.

The quick start's five classes (shapes.py's drawing and colour families), 16-40 pixels, in 160 x 120
frames (the sizes the quick-start model was trained on: 12-64 pixel shapes in 96-160 pixel images).
Each object keeps its class, size, colour and depth; it moves at 0.8-2.5 pixels a frame with a little
random acceleration, so paths cross and bend, and nearer objects hide farther ones. Objects bounce
off the frame's edges, but now and then (`leave`, the chance at each bounce) one goes through, out of
the frame, turns back at a wall up to `margin` pixels beyond it, and comes back in: out for a few
frames to a few seconds (a tracker without appearance features must recognise it again).
Alike objects (`alike`: every object of one class, in that class's one colour) leave nothing but
motion to tell them apart; `hidden` leaves one of them undrawn for a while (behind something the
video does not show), moving on its path, as a re-identification test wants.
The background is shapes.py's texture, still (the camera does not move), with fresh sensor noise in
every frame. Deterministic from its seed.

Ground truth per frame: every object whose box meets the frame, {"id", "category_id", "name", "box"
[x0, y0, x1, y1] in pixels (the whole shape, as shapes.py annotates it, clipped to the frame),
"visibility"}, the fraction of the shape's pixels that are in the frame and not hidden by a nearer
shape (MOTChallenge's visibility).

    python -m deformable_detr.data.shapes_video OUT.mp4 [--frames 200] [--objects 6] [--seed 0] [--fps 25]
                                                [--alike circle [--hide FIRST FRAMES]]

writes OUT.mp4 (H.264; the `video` extra), OUT.gt.json ({"fps", "width", "height", "seed", "frames":
[{"frame", "objects": [...]}]}) and OUT.gt.txt (MOTChallenge's gt.txt: frame, id, x, y, w, h, 1,
category id, visibility, frames from 1), which motmetrics and Roboflow's trackers evaluate against."""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from ..errors import ArgumentParser, entry_point, optional
from .shapes import CATEGORIES, SHAPES, _background, _draw_shape


@dataclass
class ShapesVideo:
    """`frames`: PIL images (RGB); `truth`: per frame, the objects seen (the module's docstring)."""

    frames: list
    truth: list
    fps: float
    seed: int

    @property
    def size(self) -> tuple[int, int]:
        return self.frames[0].size if self.frames else (0, 0)


def make_video(
    seed: int = 0,
    frames: int = 200,
    size: tuple[int, int] = (160, 120),
    objects: int = 6,
    sizes: tuple[int, int] = (16, 32),
    speed: tuple[float, float] = (0.8, 2.5),
    leave: float = 0.3,
    margin: int = 40,
    fps: float = 25.0,
    categories=CATEGORIES,
    alike: str | None = None,
    hidden: tuple[int, int, int] | None = None,
) -> ShapesVideo:
    """The video of the module's docstring: `size` (width, height), `objects` shapes of `sizes` pixels
    (smallest, largest) at `speed` pixels a frame; at a bounce on the frame's edge a shape leaves the
    frame instead with chance `leave`, turning back 4 to `margin` pixels beyond where it is wholly out.
    `alike`: a class of `categories`, every object's, in its one colour (shapes.py's SHAPES, unvaried);
    `hidden` (object, first frame, frames): that object (0: the first, the farthest) not drawn for those
    frames, in the ground truth with visibility 0. Without them, the same video as before for a seed."""
    rng = np.random.default_rng(seed)
    width, height = size
    frame = np.array([width, height])
    background = np.asarray(_background(rng, height, width), np.float32)
    kinds = rng.integers(len(categories), size=objects)
    sides = rng.integers(sizes[0], sizes[1] + 1, size=objects)
    extent = sides[:, None] + 1  # a shape covers side + 1 pixels (PIL draws both edges), as its box
    colours = [
        tuple(int(c) for c in np.clip(np.array(SHAPES[categories[k]]) + rng.integers(-30, 31, 3), 0, 255))
        for k in kinds
    ]
    if alike is not None:  # drawn as above all the same (the random stream as it was), then made one
        kinds = np.full(objects, categories.index(alike))
        colours = [SHAPES[alike]] * objects
    position = rng.uniform(0, 1, (objects, 2)) * (frame - extent)  # all in the first frame
    angle = rng.uniform(0, 2 * np.pi, objects)
    velocity = rng.uniform(*speed, objects)[:, None] * np.stack([np.cos(angle), np.sin(angle)], 1)
    # the walls each shape bounces off: the frame's edges, or beyond them while it is away
    low, high = np.zeros((objects, 2)), (frame - extent).astype(np.float64)
    away = np.zeros(objects, bool)
    areas = [_shape_area(categories[k], int(s)) for k, s in zip(kinds, sides, strict=True)]
    shapes = [  # (category id, name, side, colour, area) of each object
        (int(k) + 1, categories[k], int(side), colour, area)
        for k, side, colour, area in zip(kinds, sides, colours, areas, strict=True)
    ]
    walls = (low, high, away)
    video, truth = [], []
    for t in range(frames):
        gone = () if hidden is None or not hidden[1] <= t < hidden[1] + hidden[2] else (hidden[0],)
        image, seen = _frame(rng, background, np.round(position).astype(int), shapes, gone)
        video.append(image)
        truth.append(seen)
        _move(rng, position, velocity, walls, frame, extent, speed, leave, margin)
    return ShapesVideo(video, truth, fps, seed)


def _frame(rng, background, corners, shapes: list, hidden=()) -> tuple:
    """One frame: the shapes (category id, name, side, colour, area) drawn at `corners` over `background` with fresh
    noise, object 1 farthest, those of index in `hidden` not drawn -> (the image, the ground truth of the objects
    at least partly in it)."""
    height, width = background.shape[:2]
    image = Image.fromarray((background + rng.normal(0, 3, background.shape)).clip(0, 255).astype(np.uint8))
    pen, ids = ImageDraw.Draw(image), Image.new("L", (width, height), 0)
    id_pen = ImageDraw.Draw(ids)
    for i, (_, name, side, colour, _) in enumerate(shapes):  # the later hide the earlier
        if i in hidden:
            continue
        x, y = (int(v) for v in corners[i])
        _draw_shape(pen, name, x, y, side, colour)
        _draw_shape(id_pen, name, x, y, side, i + 1)
    seen = np.bincount(np.asarray(ids).ravel(), minlength=len(shapes) + 1)
    objects_seen = []
    for i, (category_id, name, side, _, area) in enumerate(shapes):
        x, y = (int(v) for v in corners[i])
        box = [max(x, 0), max(y, 0), min(x + side + 1, width), min(y + side + 1, height)]
        if box[0] >= box[2] or box[1] >= box[3]:
            continue  # wholly outside the frame
        visibility = round(float(seen[i + 1] / area), 3)
        objects_seen.append(
            {"id": i + 1, "category_id": category_id, "name": name, "box": box, "visibility": visibility}
        )
    return image, objects_seen


def _move(rng, position, velocity, walls, frame, extent, speed, leave, margin):
    """One frame's motion, in place: a little random acceleration (the speed kept in range), a bounce
    off each wall met, or with chance `leave` through the frame's edge (the wall moved out beyond it),
    and the edges as walls again once a shape that left is wholly back in."""
    low, high, away = walls
    velocity += rng.normal(0, 0.06, velocity.shape)
    norm = np.linalg.norm(velocity, axis=1, keepdims=True)
    velocity *= np.clip(norm, *speed) / np.maximum(norm, 1e-9)
    position += velocity
    for i, axis in zip(*np.nonzero((position < low) | (position > high)), strict=True):
        if not away[i] and rng.uniform() < leave:
            away[i] = True
            beyond = extent[i, 0] + rng.uniform(4, margin)
            low[i], high[i] = -beyond, frame - extent[i] + beyond
            continue
        velocity[i, axis] = -velocity[i, axis]
        position[i, axis] = np.clip(position[i, axis], low[i, axis], high[i, axis])
    back = away & np.all((position >= 0) & (position <= frame - extent), axis=1)
    low[back], high[back], away[back] = 0, (frame - extent)[back], False


def _shape_area(kind: str, side: int) -> int:
    """The pixels a shape of `side` covers, drawn alone (visibility's denominator)."""
    canvas = Image.new("L", (side + 2, side + 2), 0)
    _draw_shape(ImageDraw.Draw(canvas), kind, 0, 0, side, 1)
    return int(np.count_nonzero(np.asarray(canvas)))


def write_video(path, video: ShapesVideo) -> Path:
    """`video` as `path` (H.264 at `video.fps`, nearly lossless: crf 12) beside its ground truth,
    <stem>.gt.json and <stem>.gt.txt (the module's docstring). Needs PyAV (the `video` extra)."""
    av = optional("av", "video", "writing a video")  # PyAV
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    width, height = video.size
    with av.open(str(path), "w") as sink:
        stream = sink.add_stream("libx264", rate=round(video.fps), options={"crf": "12"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for image in video.frames:
            sink.mux(stream.encode(av.VideoFrame.from_image(image)))
        sink.mux(stream.encode())
    frames = [{"frame": t, "objects": objects} for t, objects in enumerate(video.truth)]
    record = {"fps": video.fps, "width": width, "height": height, "seed": video.seed, "frames": frames}
    path.with_suffix(".gt.json").write_text(json.dumps(record, indent=1))
    lines = [
        f"{t + 1},{o['id']},{x0},{y0},{x1 - x0},{y1 - y0},1,{o['category_id']},{o['visibility']}"
        for t, objects in enumerate(video.truth)
        for o in objects
        for x0, y0, x1, y1 in [o["box"]]
    ]
    path.with_suffix(".gt.txt").write_text("\n".join(lines) + "\n")
    return path


@entry_point
def main(argv=None):
    parser = ArgumentParser(prog="python -m deformable_detr.data.shapes_video", description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="the video to write, e.g. data/shapes_video/clip.mp4")
    parser.add_argument("--frames", type=int, default=200)
    parser.add_argument("--objects", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fps", type=float, default=25.0)
    parser.add_argument("--alike", choices=CATEGORIES, help="every object of this class, in its one colour")
    parser.add_argument(
        "--hide", type=int, nargs=2, metavar=("FIRST", "FRAMES"), help="the first object not drawn for FRAMES frames"
    )
    args = parser.parse_args(argv)
    if args.hide is not None and (args.hide[0] < 0 or args.hide[1] < 1):
        parser.error(f"--hide {args.hide[0]} {args.hide[1]}: expected a first frame of at least 0 and 1 frame or more")
    hidden = None if args.hide is None else (0, *args.hide)
    video = make_video(args.seed, args.frames, objects=args.objects, fps=args.fps, alike=args.alike, hidden=hidden)
    path = write_video(args.output, video)
    print(
        f"wrote {args.frames} frames ({video.size[0]} x {video.size[1]}) of {args.objects} shapes to {path}, "
        f"ground truth in {path.with_suffix('.gt.json')} and {path.with_suffix('.gt.txt')}"
    )


if __name__ == "__main__":
    main()
