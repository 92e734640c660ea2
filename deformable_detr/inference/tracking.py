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
its middle, `appearance`), and is made not to make the tracker's ids worse:

- an identity whose track is in this frame is never given to another track;
- any other identity (of the box's class, seen in the last `memory_s` seconds) is taken only where
  colour tells it apart: no other object's identity (one seen in a frame with it, or with the box's
  object) looks as much like the box, within `margin`. It is taken by a new track (the object is
  back), by a track whose box stops looking like its identity (the track jumped onto another object),
  or by a second track on an object that the first track's identity belongs to. Where the tracker still
  keeps that identity's track in its lost-track buffer, appearance has re-found it: the lost track is
  closed in the tracker (no identity ever has two tracks); with `refind` False, the identity waits
  until the tracker drops its track.

Alike objects (one class, one colour) cannot be told apart by colour: they keep the tracker's ids, as
motion alone has them. Measured (bench/results/tracking_cpu.txt, tracking_alike_cpu.txt; the quick start's
model): on the bench's three videos ByteTrack's IDF1 is 0.848 with re-identification, 0.704 without (SORT
0.800 / 0.607, OC-SORT 0.751 / 0.605); on four alike circles crossing, one hidden 1.5 s, 0.784 either way,
where the rule before issue 73 (a new track could take an identity another circle's track held) gave 0.722. A
re-identification network is the tool for real scenes of alike objects (people, cars); none runs here
without PyTorch. `reidentify=False` turns it off; a dict of `Identities`' options (memory_s, new, keep,
margin, blend, refind) tunes it.

The output: the frame's detections at the threshold (as `predict` gives them, in order) and, with
ByteTrack, the lower-scored ones it matched, each with `track_ids` (n,) int: -1 where there is no
identity (a track confirmed only at its second matched frame: trackers' ByteTrack gives an id then
whether `minimum_consecutive_frames` is 1 or 2, so 1 changes nothing; a duplicate; a query's second
class).

The options (`Tracking(..., **options)`, `Detector.track(..., **options)`): `Tracking`'s own (duplicates,
low_score, reidentify) and the tracker's, which go to it as they are, over the ones set here: e.g.
lost_track_buffer=60 (frames at 30 frames/s), minimum_iou_threshold, track_activation_threshold; a name
that neither takes is refused (a UsageError naming what is taken), not passed on. tests/test_tracking.py
checks that they reach it."""

import dataclasses
import inspect

import numpy as np
from PIL import Image

from ..errors import UsageError, optional

TRACKERS = ("bytetrack", "sort", "ocsort")
LOW_SCORE = 0.1  # ByteTrack's second association takes detections down to this score (its paper's)
# NMS before the tracker: (the IoU within a class, the IoU across classes) above which a box is a duplicate
DUPLICATES_IOU = (0.3, 0.7)


def _trackers():
    return optional("trackers", "track", "tracking")  # Roboflow's


def supervision():
    """supervision (the trackers' own dependency: the `track` extra brings it), or MissingExtra naming that extra."""
    return optional("supervision", "track", "tracking")


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
    over the tracker's ids (True), with its options (a dict: `Identities.OPTIONS`), or none
    (False); `options`: the tracker's own arguments, over the ones set here (a name it does not take is
    a UsageError, as is a reidentify option `Identities` does not take)."""

    def __init__(
        self,
        tracker: str = "bytetrack",
        threshold: float = 0.5,
        frame_rate: float = 30.0,
        duplicates: tuple | None = DUPLICATES_IOU,
        low_score: float | None = LOW_SCORE,
        reidentify: bool | dict = True,
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
        check_options(tracker, kind, options)
        self.tracker = kind(frame_rate=frame_rate, **(settings | options))
        self.identities = identities(reidentify, frame_rate)

    def update(self, detections, image=None):
        """A frame's `Detections` (at `floor` or below; best first, as `Detector.predict` gives them) and
        its image (PIL or (H, W, 3) uint8; needed to reidentify) -> those at the threshold and those below
        it that the tracker matched, in their order, with `track_ids`."""
        sv = supervision()
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
            held = [track.tracker_id for track in self.tracker.tracks if track.tracker_id >= 0]  # its lost ones too
            track_ids, closed = self.identities.update(np.asarray(image), given, track_ids, held, self.threshold)
            if closed:  # lost tracks re-found under a new track: closed, as the tracker closes those it gives up
                self.tracker.tracks = [track for track in self.tracker.tracks if track.tracker_id not in closed]
        shown = (given.scores >= self.threshold) | (track_ids >= 0)
        return dataclasses.replace(given, track_ids=track_ids).where(shown)


def check_options(tracker: str, kind, options: dict) -> None:
    """`options` are arguments of the tracker class `kind` (its constructor's names, frame_rate aside:
    Tracking's own), or a UsageError naming the one that is not and what is taken."""
    taken = [name for name in inspect.signature(kind).parameters if name not in ("self", "frame_rate")]
    for name in options:
        if name not in taken:
            raise UsageError(
                f"tracking option {name!r}: not one of Tracking's (duplicates, low_score, reidentify) nor "
                f"{tracker}'s ({', '.join(taken)})"
            )


def identities(reidentify, frame_rate: float):
    """`Tracking`'s `reidentify` -> its `Identities` (True: the defaults; a dict: those options over them) or
    None (False); else a UsageError."""
    if reidentify is True or reidentify is False:
        return Identities(frame_rate) if reidentify else None
    if not isinstance(reidentify, dict):
        options = ", ".join(Identities.OPTIONS)
        raise UsageError(f"reidentify {reidentify!r}: expected True, False or a dict of {options}")
    for name in reidentify:
        if name not in Identities.OPTIONS:
            raise UsageError(f"reidentify option {name!r}: expected one of {', '.join(Identities.OPTIONS)}")
    return Identities(frame_rate, **reidentify)


def appearance(image: np.ndarray, box, bins: int = 16, middle: float = 0.6) -> np.ndarray:
    """The colours of `box` (x0, y0, x1, y1) in `image` (H, W, 3) uint8: a histogram of `bins` levels a
    channel (bins^3, summing to 1) over the box's middle `middle` of each side (less of the background).
    16 levels: at 8, colours up to 31 levels apart in a channel share a bin (two triangles of the bench's,
    (13, 76, 221) and (14, 67, 203), looked one colour and their identities were not told apart)."""
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
    that overlap no other identified box, `blend` the old look's share), its class (the most seen), the
    frames it was first and last seen in, and the identities seen with it in one frame (other objects).

    An identity whose raw id is in this frame is never given to another raw id. One not in this frame, of
    the box's class and seen within `memory_s` seconds, is taken where appearance tells it apart: the box
    looks at least `new` like it, and every other identity that it looks as much like (within `margin`) was
    never seen with it nor with the box's object (perhaps the same object under another track: then the
    first seen of them is taken, or none if that one is in this frame). Taken so: by a raw id not seen
    before (an object back); by one whose box looks less than `keep` like its identity (its track went onto
    another object); by one whose identity began after the other was last seen (a second track on one
    object: its own identity goes). Where the tracker still keeps the identity's raw id in its lost-track
    buffer, that lost track is re-found: `update` returns its raw id among those the tracker should close,
    so no identity ever has two tracks (`refind` False: such an identity waits until the tracker drops it).
    Else the tracker's id stands (a new identity, numbered from 0): alike objects keep the tracker's ids, as
    motion alone has them. The tables hold the raw ids the tracker keeps and the identities held or seen
    within `memory_s`: bounded over a stream of any length."""

    OPTIONS = ("memory_s", "new", "keep", "margin", "blend", "refind")  # `Tracking(reidentify={...})` takes these

    def __init__(
        self,
        frame_rate: float,
        memory_s: float = 10.0,
        new: float = 0.5,
        keep: float = 0.8,
        margin: float = 0.1,
        blend: float = 0.8,
        refind: bool = True,
    ):
        for name, value, low, high in [
            ("memory_s", memory_s, 0.0, float("inf")),
            ("new", new, 0.0, 1.0),
            ("keep", keep, 0.0, 1.0),
            ("margin", margin, 0.0, 1.0),
            ("blend", blend, 0.0, 1.0),
        ]:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise UsageError(f"reidentify {name}={value!r}: expected a number from {low:g} to {high:g}")
        if not isinstance(refind, bool):
            raise UsageError(f"reidentify refind={refind!r}: expected True or False")
        self.memory = memory_s * frame_rate  # in frames
        self.new, self.keep, self.margin, self.blend, self.refind = new, keep, margin, blend, refind
        self.frame, self.count = -1, 0
        self.identity = {}  # raw id the tracker keeps -> identity
        self.look, self.classes, self.met = {}, {}, {}  # identity -> histogram, {label: count}, {identity seen with}
        self.first, self.last = {}, {}  # identity -> the frame first seen, last seen

    def update(self, image: np.ndarray, detections, raw_ids: np.ndarray, held, threshold: float) -> tuple:
        """This frame's `detections` (best first) with the tracker's `raw_ids` (-1: none) and `held`, the raw
        ids the tracker keeps after this frame (those it saw and those in its lost-track buffer) -> (their
        identities, -1 where the raw id is -1; the raw ids of lost tracks re-found, for the tracker to close)."""
        sv = supervision()
        self.frame += 1
        rows = [j for j in range(len(raw_ids)) if raw_ids[j] >= 0]
        present = {int(raw_ids[j]) for j in rows}
        kept = {int(raw) for raw in held} | present
        self.identity = {raw: identity for raw, identity in self.identity.items() if raw in kept}
        self._forget()
        ids, closed = np.full(len(raw_ids), -1, np.int64), set()
        looks = {j: appearance(image, detections.boxes[j]) for j in rows}
        boxes = np.asarray(detections.boxes, np.float32).reshape(-1, 4)
        overlaps = sv.box_iou_batch(boxes, boxes)  # IoU of every two boxes (0 where no union), once a frame
        np.fill_diagonal(overlaps, 0)
        here = {j: self.identity.get(int(raw_ids[j])) for j in rows}  # this frame's: other objects than each box's
        holding = {identity for identity in here.values() if identity is not None}  # never given to another
        if not self.refind:  # those the tracker keeps lost wait until it drops them
            holding |= set(self.identity.values())
        for j in rows:  # best scored first
            raw, label = int(raw_ids[j]), int(detections.labels[j])
            others = {identity for row, identity in here.items() if row != j and identity is not None}
            identity = here[j]
            if identity is None:  # a new track: an object back?
                identity = self._told_apart(looks[j], label, holding, others)
            elif identity in self.look:
                if likeness(self.look[identity], looks[j]) < self.keep:  # its track went onto another object?
                    found = self._told_apart(looks[j], label, holding, others, identity)
                else:  # a second track on one object?
                    began, others = self.first[identity], others | self.met[identity]
                    found = self._told_apart(looks[j], label, holding, others, identity, began)
                    if found is not None:
                        self._drop(identity)  # the second track's own identity: the first's from here
                if found is not None:
                    holding.discard(identity)
                    identity = found
            if identity is None:
                identity, self.count = self.count, self.count + 1  # a new one: ids from 0 in order of appearance
            for other in [other for other, taken in self.identity.items() if taken == identity and other != raw]:
                del self.identity[other]  # a lost track re-found: the tracker closes it
                closed.add(other)
            self.identity[raw], ids[j], here[j] = identity, identity, identity
            holding.add(identity)
        seen = {int(identity) for identity in ids[rows]}
        for j in rows:
            identity, label = int(ids[j]), int(detections.labels[j])
            self.first.setdefault(identity, self.frame)
            self.last[identity] = self.frame
            self.met.setdefault(identity, set()).update(seen - {identity})
            counts = self.classes.setdefault(identity, {})
            if detections.scores[j] >= threshold or not counts:
                counts[label] = counts.get(label, 0) + 1
            alone = (overlaps[j, rows] < 0.05).all()  # no other identified box meets it (its own IoU: 0)
            if detections.scores[j] >= threshold and alone:
                before = self.look.get(identity)
                self.look[identity] = looks[j] if before is None else self.blend * before + (1 - self.blend) * looks[j]
        return ids, closed

    def _told_apart(
        self, look: np.ndarray, label: int, holding: set, others: set, itself=None, began=None
    ) -> int | None:
        """The identity (of class `label`, not in `holding`, last seen before `began`, default this frame)
        that `look`, a box's, is most like, at `new` or more, where no identity in `others` (other objects
        than the box's) nor any seen with it looks as much like the box (within `margin`); of those that do,
        never seen with it, the first seen (if it may be taken), else None. `itself`: the box's own identity."""
        began = self.frame if began is None else began
        alike = {
            identity: likeness(known, look)
            for identity, known in self.look.items()
            if identity != itself and self._label(identity) == label
        }
        free = [
            identity
            for identity, score in alike.items()
            if identity not in holding and score >= self.new and self.last[identity] < began
        ]
        if not free:
            return None
        best = max(free, key=alike.get)
        close = [identity for identity in alike if identity != best and alike[identity] > alike[best] - self.margin]
        if any(identity in others or identity in self.met[best] for identity in close):
            return None  # another object looks as much like it: nothing tells them apart
        first = min([best, *close], key=self.first.get)  # one object under several tracks: its first identity
        return first if first in free else None

    def _label(self, identity: int) -> int:
        counts = self.classes[identity]
        return max(counts, key=counts.get)

    def _forget(self) -> None:
        """Identities not held and unseen for over `memory` frames dropped: a long video (a server's stream)
        keeps what it can still match, not every identity it has seen."""
        held = set(self.identity.values())
        for identity, last in list(self.last.items()):
            if self.frame - last > self.memory and identity not in held:
                self._drop(identity)

    def _drop(self, identity: int) -> None:
        for table in (self.look, self.classes, self.first, self.last):
            table.pop(identity, None)
        for other in self.met.pop(identity, ()):
            self.met[other].discard(identity)


def as_supervision(detections):
    """`Detections` with `track_ids` -> supervision's `sv.Detections` (xyxy, confidence, class_id, tracker_id)."""
    sv = supervision()
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
        trackers, sv = _trackers(), supervision()
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
