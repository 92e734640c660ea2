"""`Identities` (inference/tracking.py) on its own: synthetic frames, with the raw ids a tracker would give and
the ones it would keep in its lost-track buffer, no detector and no tracker. Re-identification never gives an
identity the tracker still follows to another track, takes a lost one back only where colour tells it apart
from every other identity of its class, and keeps tables no larger than what the tracker keeps and what was seen
within its memory. Then its options through `Tracking`: reached, and a name or value it does not take refused."""

import pytest

pytest.importorskip("supervision", reason="tracking needs supervision (the track extra, in dev)")

from deformable_detr.errors import UsageError
from deformable_detr.inference.detector import Detections
from deformable_detr.inference.tracking import Identities, Tracking

import numpy as np

FPS = 25
BUFFER = 25  # frames a tracker keeps a lost track (trackers' lost_track_buffer=30 at 30 frames/s, at 25)
GREEN, RED, BLUE = (40, 200, 60), (220, 40, 40), (40, 80, 230)


def frame(objects: dict, t: int, size=(160, 120)) -> tuple:
    """A frame: a noisy grey background with squares {name: (x0, y0, side, colour, label, score, raw id)} drawn,
    the whole image with sensor noise -> (the image, their `Detections` best first, the raw ids in that order,
    the names in that order)."""
    rng = np.random.default_rng(t)
    image = rng.normal(120, 12, (size[1], size[0], 3))
    for x0, y0, side, colour, *_ in objects.values():
        image[y0 : y0 + side, x0 : x0 + side] = colour
    image = np.clip(image + rng.normal(0, 4, image.shape), 0, 255).astype(np.uint8)
    names = sorted(objects, key=lambda name: -objects[name][5])
    boxes = [[x0, y0, x0 + side, y0 + side] for x0, y0, side, *_ in (objects[name] for name in names)]
    detections = Detections(
        boxes=np.float32(boxes).reshape(-1, 4),
        scores=np.float32([objects[name][5] for name in names]),
        labels=np.int64([objects[name][4] for name in names]),
        names=names,
        queries=np.arange(len(names)),
        image_size=size,
    )
    return image, detections, np.int64([objects[name][6] for name in names]), names


class Tracker:
    """What a tracker keeps: every raw id seen in the last BUFFER frames (its tracks and its lost ones), but
    those it is told to close."""

    def __init__(self):
        self.seen, self.closed = {}, {}  # raw id -> the frame last seen; the frame it was closed

    def held(self, raw_ids, t: int) -> set:
        self.seen |= {int(raw): t for raw in raw_ids if raw >= 0}
        self.seen = {raw: last for raw, last in self.seen.items() if t - last <= BUFFER}
        return set(self.seen)

    def close(self, raw_ids, t: int) -> None:
        for raw in raw_ids:
            del self.seen[raw]
            self.closed[raw] = t


def run(frames, identities: Identities | None = None) -> tuple[list[dict], Identities, Tracker]:
    """`frames` (per frame, frame()'s objects) through an `Identities` -> (per frame, {name: identity}, it,
    the tracker)."""
    identities = identities or Identities(FPS)
    tracker, seen = Tracker(), []
    for t, objects in enumerate(frames):
        image, detections, raw_ids, names = frame(objects, t)
        ids, closed = identities.update(image, detections, raw_ids, tracker.held(raw_ids, t), 0.5)
        tracker.close(closed, t)
        seen.append(dict(zip(names, ids.tolist(), strict=True)))
    return seen, identities, tracker


def crossing(t: int) -> dict:
    """Three green squares of one class. B from the right and A from the left cross at frame ~25; the tracker
    follows B throughout (raw 2), and restarts A after the crossing (raw 3 from frame 30; raw 1, lost, stays in its
    buffer until frame 54). A's box scores higher than B's: its new track comes first. C stays, apart (raw 4)."""
    objects = {"B": (130 - 4 * t, 52, 20, GREEN, 1, 0.8, 2)}
    if t >= 3:  # A comes later: B's identity is the first (0), the one a new track looked at first before
        objects["A"] = (4 * t - 60, 48, 20, GREEN, 1, 0.9, 1 if t < 30 else 3)
    objects["C"] = (70, 5, 22, GREEN, 1, 0.7, 4)
    return objects


def test_alike_objects_crossing_keep_the_trackers_ids():
    """The tracker restarts one of two alike squares crossing: identities follow the tracker's ids (motion), one
    identity per raw id, none handed from one object to another. (Before, A's new track took B's identity, the
    first alike one not yet seen in that frame, and B then took A's: a swap.) A's lost track is not re-found:
    nothing tells A from B."""
    seen, identities, tracker = run([crossing(t) for t in range(90)])
    b, c = seen[0]["B"], seen[0]["C"]
    assert all(frame_ids["B"] == b and frame_ids["C"] == c for frame_ids in seen)
    a_ids = [frame_ids["A"] for frame_ids in seen[3:]]
    assert set(a_ids[:27]) == {a_ids[0]} and set(a_ids[27:]) == {a_ids[27]}  # raw 1, then raw 3: the tracker's ids
    assert len({a_ids[0], a_ids[27], b, c}) == 4
    assert sorted(identities.identity) == [2, 3, 4]  # raw 1 is out of the table once the tracker dropped it
    assert tracker.closed == {}


def hidden(t: int, back: int, colour=RED, other=BLUE) -> dict:
    """A square of `colour` (raw 1) not seen from frame 20 until `back`, then on the right under a new raw id (3);
    a square of `other` colour, the same class (raw 2), throughout. The tracker drops raw 1 at frame 45."""
    objects = {"other": (100 - t // 4, 70, 20, other, 1, 0.9, 2)}
    if t < 20 or t >= back:
        objects["back"] = (10 + t // 2, 20, 18, colour, 1, 0.8, 1 if t < 20 else 3)
    return objects


def test_a_hidden_object_of_its_own_colour_gets_its_identity_back():
    """Back after the tracker dropped its track, under a new raw id: its identity again, at once."""
    seen, _, _ = run([hidden(t, back=60) for t in range(100)])
    back = seen[0]["back"]
    assert [frame_ids["back"] for frame_ids in seen[60:]] == [back] * 40
    assert {frame_ids["other"] for frame_ids in seen} == {seen[0]["other"]} and seen[0]["other"] != back


def test_a_lost_track_the_tracker_keeps_is_refound():
    """Back at frame 30 where the tracker does not find it: a new track (raw 3) while raw 1 is still kept (until
    frame 44). Colour tells it apart from the blue one: raw 1's lost track is re-found, closed at once, and raw 3
    has its identity. With refind=False that identity waits: raw 3 has a new one until the tracker drops raw 1,
    then that object's first identity, its own forgotten."""
    seen, identities, tracker = run([hidden(t, back=30) for t in range(80)])
    back, ids = seen[0]["back"], [frame_ids.get("back") for frame_ids in seen]
    assert ids[:20] == [back] * 20 and ids[30:] == [back] * 50 and tracker.closed == {1: 30}
    seen, identities, tracker = run([hidden(t, back=30) for t in range(80)], Identities(FPS, refind=False))
    back, ids = seen[0]["back"], [frame_ids.get("back") for frame_ids in seen]
    assert ids[:20] == [back] * 20 and back not in ids[30:45] and len(set(ids[30:45])) == 1
    assert ids[45:] == [back] * 35 and tracker.closed == {}
    assert len(identities.look) == 2


def test_a_hidden_object_among_alike_ones_keeps_the_trackers_id():
    """The same, both squares green: nothing tells the one back from the one seen throughout, so it keeps the
    tracker's id (a new identity), as motion alone has it, after the tracker dropped its track too; the other
    keeps its own."""
    for back in (30, 60):
        seen, _, tracker = run([hidden(t, back, colour=GREEN, other=GREEN) for t in range(100)])
        ids = [frame_ids.get("back") for frame_ids in seen]
        assert set(ids[:20]) == {ids[0]} and set(ids[back:]) == {ids[back]} and ids[back] != ids[0]
        assert {frame_ids["other"] for frame_ids in seen} == {seen[0]["other"]} != {ids[0]} and tracker.closed == {}


def restarts(t: int, colours, period: int) -> dict:
    """Squares of `colours` (one class) moving slowly; the tracker restarts each every `period` frames (a new
    raw id, the old one kept BUFFER frames)."""
    return {
        f"{i}": (10 + 45 * i + (t // 9) % 5, 40 + 20 * (i % 2), 18, colour, 1, 0.9 - 0.1 * i, 10_000 * i + t // period)
        for i, colour in enumerate(colours)
    }


@pytest.mark.parametrize(
    "colours, period", [((RED, GREEN, BLUE), 40), ((RED, GREEN, BLUE), 7), ((GREEN,) * 3, 7)], ids=str
)
def test_a_long_streams_tables_stay_bounded(colours, period):
    """1,500 frames (a minute), each object's track restarted every `period` frames (up to 645 raw ids): the
    raw-id table holds the raw ids the tracker keeps, no more; the identities, those held or seen within
    memory_s (4 s here); no identity is ever shown on two objects. Distinct colours: each new track re-finds
    its object's lost one (closed), one identity an object throughout; alike ones: a new identity per track,
    as motion alone has it, no track closed."""
    frames, memory = 1500, 100  # frames
    identities, tracker, most, seen = Identities(FPS, memory_s=memory / FPS), Tracker(), 0, []
    for t in range(frames):
        image, detections, raw_ids, names = frame(restarts(t, colours, period), t)
        held = tracker.held(raw_ids, t)
        ids, closed = identities.update(image, detections, raw_ids, held, 0.5)
        tracker.close(closed, t)
        assert set(identities.identity) <= held - closed
        most = max(most, *(len(table) for table in (identities.look, identities.met, identities.first)))
        seen.append(dict(zip(names, ids.tolist(), strict=True)))
    shown_on = {}
    for frame_ids in seen:
        for name, identity in frame_ids.items():
            shown_on.setdefault(identity, set()).add(name)
    assert all(len(objects) == 1 for objects in shown_on.values())
    if colours[0] != colours[1]:
        assert all(frame_ids == seen[0] for frame_ids in seen) and most == 3
        assert len(tracker.closed) == 3 * ((frames - 1) // period)  # every track but the last, re-found
    else:
        assert identities.count == 3 * ((frames - 1) // period + 1) and tracker.closed == {}
        assert most <= 3 * ((memory + BUFFER) // period + 2)


def test_the_options_reach_it_and_others_are_refused():
    pytest.importorskip("trackers", reason="tracking needs Roboflow's trackers (the track extra, in dev)")
    options = {"memory_s": 2.0, "margin": 0.3, "new": 0.6, "refind": False}
    identities = Tracking("bytetrack", 0.5, FPS, reidentify=options).identities
    assert (identities.memory, identities.margin, identities.new, identities.refind) == (50.0, 0.3, 0.6, False)
    assert Tracking("sort", 0.5, FPS, reidentify=False).identities is None
    assert Tracking("sort", 0.5, FPS).identities.margin == 0.1  # the default
    refused = [
        ({"reidentify": {"memory": 2}}, "reidentify option 'memory': expected one of memory_s, new, keep, margin"),
        ({"reidentify": {"margin": 1.5}}, "reidentify margin=1.5: expected a number from 0 to 1"),
        ({"reidentify": {"memory_s": -1}}, "reidentify memory_s=-1: expected a number from 0 to inf"),
        ({"reidentify": {"refind": 1}}, "reidentify refind=1: expected True or False"),
        ({"reidentify": "yes"}, "reidentify 'yes': expected True, False or a dict of memory_s"),
        ({"lost_buffer": 60}, "tracking option 'lost_buffer': not one of Tracking's"),
    ]
    for options, message in refused:
        with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
            Tracking("bytetrack", 0.5, FPS, **options)
    with pytest.raises(UsageError, match=r"'track_activation_threshold'.* ocsort's \(lost_track_buffer, "):
        Tracking("ocsort", 0.5, FPS, track_activation_threshold=0.4)  # ByteTrack's and SORT's, not OC-SORT's
