"""Identities through a video: Roboflow's `trackers` (ByteTrack, SORT, OC-SORT) on each frame's
`Detections`, through supervision's `sv.Detections`; the ids and their trails drawn with trackers' and
supervision's annotators. Needs the `track` extra (`Detector.track` and `predict --track` are built on it).

What each tracker is given is what it was designed for:

- ByteTrack associates the confident detections first, then matches the tracks left over to the
  low-score ones (down to 0.1, its paper's floor), so an object whose score dips for a few frames
  (half hidden, blurred) keeps its id. It gets every detection scoring at least 0.1; the user's
  threshold is its high-score bar, and a new track starts at the threshold + 0.1 (its authors'
  `det_thresh`, and trackers' defaults 0.6 / 0.7 are the same gap). Its paper also outputs the low
  boxes it matched; here the output stays at the threshold, so they only carry a track through the dip
  (on the bench's videos, IDF1 0.574 with them and 0.598 without; 0.640 / 0.644 on another training
  of the model: the stage is kept as ByteTrack is, and matters on a detector whose scores dip more).
- SORT associates every detection it is given, and OC-SORT drops those under its `high_conf_det_threshold`:
  both get the detections at the threshold (OC-SORT's bar set to it).

The output stays at the threshold: the frame's `predict` result (the same detections, order and
scores) with `track_ids` (n,) int, -1 where the tracker has no identity for the detection (a track
confirmed only after `minimum_consecutive_frames` matches, trackers' convention and MOTChallenge's).
Trackers are class-agnostic (an object whose predicted class flickers keeps its id) and take one box
per object, as a detector with non-maximum suppression gives them. Deformable DETR has none: one query's
box can come under two classes, and a model trained briefly puts two queries on one object. Each would
start a track of its own, and the two ids flicker. So the tracker is given the boxes left by
class-agnostic NMS (supervision's `with_nms` at IoU `duplicates`, 0.5: its default); a box it leaves out
(and a query's second class) has no identity, -1. On the quick start's model and three synthetic
videos, duplicates removed took ByteTrack's IDF1 from 0.36 to 0.57 and its ID switches from 189 to 26
(bench/README.md#tracking)."""

import dataclasses
import itertools

import numpy as np
from PIL import Image

from ..errors import UsageError, optional

TRACKERS = ("bytetrack", "sort", "ocsort")
LOW_SCORE = 0.1  # ByteTrack's second association takes detections down to this score (its paper's)
NEW_TRACK_MARGIN = 0.1  # ByteTrack starts a track at the high-score bar + this (its authors' det_thresh)
DUPLICATES_IOU = 0.5  # a box overlapping a better one more than this is not given to the tracker (supervision's NMS)


def _trackers():
    return optional("trackers", "track", "tracking")  # Roboflow's


def check_tracker(name: str):
    """Before any work: `name` is one of TRACKERS and trackers is installed."""
    if name not in TRACKERS:
        raise UsageError(f"tracker {name!r}: expected one of {', '.join(TRACKERS)}")
    _trackers()


class Tracking:
    """One video's tracker: `update` each frame's detections in order. `tracker`: bytetrack, sort or
    ocsort; `threshold`: the detections kept (and the trackers' confidence bars: the module's
    docstring); `frame_rate`: the video's (the trackers' lost-track buffer, 30 frames at 30 frames/s,
    scales with it); `duplicates`: the IoU over which a box is a duplicate of a better one and not given
    to the tracker (None: every box is); `low_score`: the lowest score ByteTrack is given (None: the
    threshold, no second association); `options`: the tracker's own arguments, over the ones set here
    (e.g. lost_track_buffer=60, minimum_consecutive_frames=1)."""

    def __init__(
        self,
        tracker: str = "bytetrack",
        threshold: float = 0.5,
        frame_rate: float = 30.0,
        duplicates: float | None = DUPLICATES_IOU,
        low_score: float | None = LOW_SCORE,
        **options,
    ):
        check_tracker(tracker)
        trackers = _trackers()
        self.name, self.threshold, self.duplicates = tracker, threshold, duplicates
        if tracker == "bytetrack":
            self.floor = threshold if low_score is None else min(low_score, threshold)  # the detections it is given
            new_track = min(threshold + NEW_TRACK_MARGIN, 1.0)
            settings = dict(high_conf_det_threshold=threshold, track_activation_threshold=new_track)
            kind = trackers.ByteTrackTracker
        elif tracker == "sort":
            self.floor, settings, kind = threshold, dict(track_activation_threshold=threshold), trackers.SORTTracker
        else:
            self.floor, settings, kind = threshold, dict(high_conf_det_threshold=threshold), trackers.OCSORTTracker
        self.tracker = kind(frame_rate=frame_rate, **(settings | options))

    def update(self, detections):
        """A frame's `Detections` (at `floor` or below; best first, as `Detector.predict` gives them) ->
        those at the threshold, with `track_ids`."""
        import supervision as sv

        given = detections.at_threshold(self.floor)
        frame = sv.Detections(
            xyxy=np.asarray(given.boxes, np.float32).reshape(-1, 4),
            confidence=np.asarray(given.scores, np.float32),
            class_id=np.asarray(given.labels, int),
            data={"query": np.asarray(given.queries, int)},
        )
        if self.duplicates is not None and len(frame):
            frame = frame.with_nms(self.duplicates, class_agnostic=True)  # also a query's second class
        tracked = self.tracker.update(frame)  # reordered; -1 where no identity
        ids = dict(zip(tracked.data["query"], tracked.tracker_id, strict=True)) if len(tracked) else {}
        shown = detections.at_threshold(self.threshold)
        track_ids = np.array([ids.get(int(q), -1) for q in shown.queries], np.int64)
        return dataclasses.replace(shown, track_ids=track_ids)


def tracked(detector, frames, tracking: Tracking, batch_size: int = 1):
    """`Detector.track`: `detector.predict` on `frames` in batches of `batch_size`, each frame's result
    through `tracking`, yielded as it comes."""
    frames = iter(frames)
    while batch := list(itertools.islice(frames, batch_size)):
        for detections in detector.predict(batch, tracking.floor, batch_size=batch_size):
            yield tracking.update(detections)


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
    """Each identity's id (supervision's LabelAnnotator, under the box) and its trail, the centre's last
    `trail` frames (trackers' MotionAwareTraceAnnotator; the camera still: no motion compensation), in
    a colour per id, over frames given in order. The annotators draw in OpenCV's BGR order on arrays."""

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
        """`detections`' ids and trails drawn on a copy of `image` (e.g. `Detections.draw`'s picture)."""
        scene = np.ascontiguousarray(np.asarray(image.convert("RGB"))[..., ::-1])
        found = as_supervision(detections)
        scene = self.trace.annotate(scene, found)
        identified = found[found.tracker_id >= 0]
        if len(identified):
            scene = self.labels.annotate(scene, identified, labels=[f"#{i}" for i in identified.tracker_id])
        return Image.fromarray(np.ascontiguousarray(scene[..., ::-1]))
