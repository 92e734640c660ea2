"""Identities through a video: Roboflow's `trackers` (ByteTrack, SORT, OC-SORT) on each frame's
`Detections`, through supervision's `sv.Detections`, then `Identities`, which gives an object back its
id when it returns; the ids and their trails drawn with trackers' and supervision's annotators. Needs
the `track` extra (`Detector.track` and `predict --track` are built on it). bench/tracking.py measures
it (MOTA, IDF1, ID switches with motmetrics; bench/README.md#tracking).

The road: the detector finds each frame's objects (`Detector.predict`), `Tracking.update` takes that
frame's `Detections` and its image and gives them back with `track_ids`; nothing here calls the detector.

What each tracker is given is what it was designed for:

- ByteTrack associates the confident detections first, then matches the tracks left over to the
  low-score ones (down to 0.1, its paper's floor), so an object whose score dips for a few frames
  (half hidden, blurred) keeps its id, and, as its paper does, those matched low-score boxes are in
  the output with their ids. The user's threshold is its high-score bar and where a new track starts
  (its authors start one at the bar + 0.1, a gap for detectors sure of what they find: on the quick
  start's model, whose scores are low, that gap left the objects scoring 0.3-0.4 without a track).
- SORT associates every detection it is given, and OC-SORT drops those under its `high_conf_det_threshold`:
  both get the detections at the threshold (OC-SORT's bar set to it).

Trackers are class-agnostic (an object whose predicted class flickers keeps its id) and take one box
per object, as a detector with non-maximum suppression gives them. Deformable DETR has none: one query's
box can come under two classes, and a model trained briefly puts two queries on one object; each would
start a track of its own. So the tracker is given the boxes left by supervision's NMS at IoU 0.3 within
a class and 0.7 across classes (`DUPLICATES_IOU`): two real objects of different classes that overlap
both stay (at 0.5 across classes, the bench's circle passing a square lost its box, then its id), while a
query's box under a second class (IoU 1) goes. A box left out has no identity, -1.

A tracker without appearance features gives an object a new id whenever it comes back after its
lost-track buffer (a second: out of the frame, hidden behind another), and can carry an id from one
object to another where two cross. `Identities` looks at each identified box's colours (a histogram of
its middle, `appearance`): a new track that looks like an identity lost in the last `memory_s` seconds,
of the same class, takes that identity; a track whose box stops looking like its identity (it has
jumped to another object) takes the lost identity it looks like, if any; where the tracker goes on
following an object under an old track whose identity a new one took, the two boxes meet and the
lower-scored has none. On the bench's videos this takes ByteTrack's IDF1 from 0.70 to 0.83. Colour
histograms are a weak cue on real scenes with many alike objects (there a re-identification network is
the tool; not here: no such model runs without PyTorch); `reidentify=False` turns it off.

The output: the frame's detections at the threshold (as `predict` gives them, in order) and, with
ByteTrack, the lower-scored ones it matched, each with `track_ids` (n,) int: -1 where there is no
identity (a track confirmed only at its second matched frame: trackers' ByteTrack gives an id then
whether `minimum_consecutive_frames` is 1 or 2, so 1 changes nothing; a duplicate; a query's second
class).

The options (`Tracking(..., **options)`, `Detector.track(..., **options)`) go to the tracker as they
are, over the ones set here: e.g. lost_track_buffer=60 (frames at 30 frames/s), minimum_iou_threshold,
track_activation_threshold; tests/test_tracking.py checks that they reach it."""

import dataclasses

import numpy as np
from PIL import Image

from ..errors import UsageError, optional

TRACKERS = ("bytetrack", "sort", "ocsort")
LOW_SCORE = 0.1  # ByteTrack's second association takes detections down to this score (its paper's)
# NMS before the tracker: (the IoU within a class, the IoU across classes) above which a box is a duplicate
DUPLICATES_IOU = (0.3, 0.7)


def _trackers():
    return optional("trackers", "track", "tracking")  # Roboflow's


def check_tracker(name: str):
    """Before any work: `name` is one of TRACKERS and trackers is installed."""
    if name not in TRACKERS:
        raise UsageError(f"tracker {name!r}: expected one of {', '.join(TRACKERS)}")
    _trackers()


class Tracking:
    """One video's tracker: `update` each frame's detections, with its image, in order. `tracker`:
    bytetrack, sort or ocsort; `threshold`: the detections kept (and the trackers' bars: the module's
    docstring); `frame_rate`: the video's (the trackers' lost-track buffer, 30 frames at 30 frames/s,
    scales with it); `duplicates`: (IoU within a class, IoU across classes) over which a box is a
    duplicate of a better one and not given to the tracker (None: every box is); `low_score`: the lowest
    score ByteTrack is given (None: the threshold, no second association); `reidentify`: `Identities`
    over the tracker's ids; `options`: the tracker's own arguments, over the ones set here."""

    def __init__(
        self,
        tracker: str = "bytetrack",
        threshold: float = 0.5,
        frame_rate: float = 30.0,
        duplicates: tuple | None = DUPLICATES_IOU,
        low_score: float | None = LOW_SCORE,
        reidentify: bool = True,
        **options,
    ):
        check_tracker(tracker)
        trackers = _trackers()
        self.name, self.threshold, self.duplicates = tracker, threshold, duplicates
        if tracker == "bytetrack":
            self.floor = threshold if low_score is None else min(low_score, threshold)  # the detections it is given
            settings = dict(high_conf_det_threshold=threshold, track_activation_threshold=threshold)
            kind = trackers.ByteTrackTracker
        elif tracker == "sort":
            self.floor, settings, kind = threshold, dict(track_activation_threshold=threshold), trackers.SORTTracker
        else:
            self.floor, settings, kind = threshold, dict(high_conf_det_threshold=threshold), trackers.OCSORTTracker
        self.tracker = kind(frame_rate=frame_rate, **(settings | options))
        self.identities = Identities(frame_rate) if reidentify else None

    def update(self, detections, image=None):
        """A frame's `Detections` (at `floor` or below; best first, as `Detector.predict` gives them) and
        its image (PIL or (H, W, 3) uint8; needed to reidentify) -> those at the threshold and those below
        it that the tracker matched, in their order, with `track_ids`."""
        import supervision as sv

        given = detections.at_threshold(self.floor)
        frame = sv.Detections(
            xyxy=np.asarray(given.boxes, np.float32).reshape(-1, 4),
            confidence=np.asarray(given.scores, np.float32),
            class_id=np.asarray(given.labels, int),
            data={"row": np.arange(len(given))},
        )
        if self.duplicates is not None and len(frame):
            within, across = self.duplicates
            frame = frame.with_nms(within, class_agnostic=False)
            frame = frame.with_nms(across, class_agnostic=True) if len(frame) else frame
        tracked = self.tracker.update(frame)  # reordered; -1 where no identity
        track_ids = np.full(len(given), -1, np.int64)
        if len(tracked):
            track_ids[tracked.data["row"]] = tracked.tracker_id
        if self.identities is not None:
            if image is None:
                raise ValueError("Tracking.update(detections, image): reidentify=True looks at the frame's image")
            track_ids = self.identities.update(np.asarray(image), given, track_ids, self.threshold)
        shown = (given.scores >= self.threshold) | (track_ids >= 0)
        return dataclasses.replace(given, track_ids=track_ids).where(shown)


def appearance(image: np.ndarray, box, bins: int = 8, middle: float = 0.6) -> np.ndarray:
    """The colours of `box` (x0, y0, x1, y1) in `image` (H, W, 3) uint8: a histogram of `bins` levels a
    channel (bins^3, summing to 1) over the box's middle `middle` of each side (less of the background)."""
    x0, y0, x1, y1 = (float(v) for v in box)
    half_w, half_h = (x1 - x0) * middle / 2, (y1 - y0) * middle / 2
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    height, width = image.shape[:2]
    left, right = int(np.clip(cx - half_w, 0, width - 1)), int(np.clip(np.ceil(cx + half_w), 1, width))
    top, bottom = int(np.clip(cy - half_h, 0, height - 1)), int(np.clip(np.ceil(cy + half_h), 1, height))
    pixels = image[top : max(bottom, top + 1), left : max(right, left + 1), :3].reshape(-1, 3).astype(np.int64)
    levels = pixels * bins // 256
    counts = np.bincount((levels[:, 0] * bins + levels[:, 1]) * bins + levels[:, 2], minlength=bins**3)
    return counts / max(counts.sum(), 1)


def likeness(one: np.ndarray, other: np.ndarray) -> float:
    """Two `appearance` histograms' Bhattacharyya coefficient: 1 the same colours, 0 none shared."""
    return float(np.sqrt(one * other).sum())


class Identities:
    """Ids that last through a tracker's losses (the module's docstring): the tracker's ids (raw) mapped
    to identities. Each identity keeps its look (`appearance`, a running blend of its confident boxes
    that overlap no other identified box), its class (the most seen) and the frame it was last seen in.

    A raw id not seen before takes the identity lost for at most `memory_s` seconds, of its class, that
    it looks most like, at `new` likeness or more; else a new identity (numbered from 0). A raw id
    whose box looks less than `keep` like its identity moves to a lost one of its class that it looks like
    at `new` or more and by `margin` more. Two raw ids on one identity in a frame (the tracker kept an old
    track whose identity a new one took): the better scored keeps it; the other has none where their boxes
    meet (one object followed twice), and is matched again where they are apart (two objects alike)."""

    def __init__(
        self,
        frame_rate: float,
        memory_s: float = 10.0,
        new: float = 0.5,
        keep: float = 0.5,
        margin: float = 0.2,
        blend: float = 0.8,
    ):
        self.memory = memory_s * frame_rate  # in frames
        self.new, self.keep, self.margin, self.blend = new, keep, margin, blend
        self.frame, self.count = -1, 0
        self.identity = {}  # raw id -> identity
        self.look, self.classes, self.last = {}, {}, {}  # identity -> histogram, {label: count}, frame

    def update(self, image: np.ndarray, detections, raw_ids: np.ndarray, threshold: float) -> np.ndarray:
        """This frame's `detections` (best first) with the tracker's `raw_ids` (-1: none) -> their identities."""
        import supervision as sv

        self.frame += 1
        self._forget()
        ids = np.full(len(raw_ids), -1, np.int64)
        rows = [j for j in range(len(raw_ids)) if raw_ids[j] >= 0]
        looks = {j: appearance(image, detections.boxes[j]) for j in rows}
        boxes = np.asarray(detections.boxes, np.float32).reshape(-1, 4)
        overlaps = sv.box_iou_batch(boxes, boxes)  # IoU of every two boxes (0 where no union), once a frame
        np.fill_diagonal(overlaps, 0)
        taken = {}  # identity -> the row holding it this frame
        for j in rows:  # best scored first
            raw, label = int(raw_ids[j]), int(detections.labels[j])
            identity = self.identity.get(raw)
            if identity in taken:  # two tracks on one identity: the better scored (taken first) keeps it
                if overlaps[taken[identity], j] > 0:
                    continue  # their boxes meet: one object the tracker follows twice; this one has no id
                identity = None  # apart: two objects alike; this one is matched again
            if identity is not None and identity in self.look:
                now = likeness(self.look[identity], looks[j])
                if now < self.keep:  # the tracker's track has gone onto another object
                    other, alike = self._lost_like(looks[j], label, taken)
                    identity = other if other is not None and alike >= now + self.margin else identity
            if identity is None:
                identity = self._lost_like(looks[j], label, taken)[0]
            if identity is None:
                identity, self.count = self.count, self.count + 1  # a new one: ids from 0 in order of appearance
            self.identity[raw], ids[j] = identity, identity
            taken[identity] = j
        for j in rows:
            identity, label = int(ids[j]), int(detections.labels[j])
            if identity < 0:
                continue
            self.last[identity] = self.frame
            counts = self.classes.setdefault(identity, {})
            if detections.scores[j] >= threshold or not counts:
                counts[label] = counts.get(label, 0) + 1
            alone = (overlaps[j, rows] < 0.05).all()  # no other identified box meets it (its own IoU: 0)
            if detections.scores[j] >= threshold and alone:
                before = self.look.get(identity)
                self.look[identity] = looks[j] if before is None else self.blend * before + (1 - self.blend) * looks[j]
        return ids

    def _forget(self) -> None:
        """Identities unseen for over `memory` frames, and the raw ids on them, dropped: a long video (a
        server's stream) keeps what it can still match, not every id it has seen."""
        gone = {identity for identity, last in self.last.items() if self.frame - last > self.memory}
        if gone:
            for table in (self.look, self.classes, self.last):
                for identity in gone:
                    table.pop(identity, None)
            self.identity = {raw: identity for raw, identity in self.identity.items() if identity not in gone}

    def _lost_like(self, look: np.ndarray, label: int, taken: dict) -> tuple[int | None, float]:
        """(the identity not in this frame, seen within memory, of class `label`, that `look` is most like
        at `new` or more, its likeness), or (None, 0)."""
        best, alike = None, 0.0
        for identity, known in self.look.items():
            if identity in taken:
                continue
            counts = self.classes[identity]
            if max(counts, key=counts.get) != label:
                continue
            score = likeness(known, look)
            if score >= self.new and score > alike:
                best, alike = identity, score
        return best, alike


def as_supervision(detections):
    """`Detections` with `track_ids` -> supervision's `sv.Detections` (xyxy, confidence, class_id, tracker_id)."""
    import supervision as sv

    return sv.Detections(
        xyxy=np.asarray(detections.boxes, np.float32).reshape(-1, 4),
        confidence=np.asarray(detections.scores, np.float32),
        class_id=np.asarray(detections.labels, int),
        tracker_id=np.asarray(detections.track_ids, int),
    )


class TrackDrawing:
    """A tracked video's frames as `predict --track` writes them: the boxes, names and scores
    (`Detections.draw`), each identity's id (supervision's LabelAnnotator, under the box) and its trail,
    the centre's last `trail` frames (trackers' MotionAwareTraceAnnotator; the camera still: no motion
    compensation), in a colour per id, over frames given in order. The annotators draw in OpenCV's BGR
    order on arrays."""

    def __init__(self, trail: int = 20):
        trackers = _trackers()
        import supervision as sv

        self.trace = trackers.MotionAwareTraceAnnotator(trace_length=trail, thickness=1)
        self.labels = sv.LabelAnnotator(
            text_scale=0.35,
            text_thickness=1,
            text_padding=2,
            text_position=sv.Position.BOTTOM_LEFT,
            color_lookup=sv.ColorLookup.TRACK,
        )

    def draw(self, image: Image.Image, detections) -> Image.Image:
        """`detections` (a frame's, with `track_ids`), their ids and trails drawn on a copy of `image`."""
        scene = np.ascontiguousarray(np.asarray(detections.draw(image))[..., ::-1])
        found = as_supervision(detections)
        scene = self.trace.annotate(scene, found)
        identified = found[found.tracker_id >= 0]
        if len(identified):
            scene = self.labels.annotate(scene, identified, labels=[f"#{i}" for i in identified.tracker_id])
        return Image.fromarray(np.ascontiguousarray(scene[..., ::-1]))
