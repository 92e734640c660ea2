"""Identities through videos: the tracker glue (inference/tracking.py) on the synthetic video's ground
truth with a detector's kind of noise, measured with motmetrics (an independent implementation of
IDF1); `predict --track` against `Detector.track`; without the `track` extra, one line naming it."""

import dataclasses
import json
from pathlib import Path

from deformable_detr import build_model, load_config
from deformable_detr.data.shapes_video import make_video, write_video
from deformable_detr.errors import CommandError
from deformable_detr.inference.detector import Detector
from deformable_detr.inference.tracking import Tracking
from deformable_detr.predict import main as predict_main

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from bench.tracking import accumulate, mot_metrics, noisy_detections

TINY = Path(__file__).parent / "fixtures" / "tiny.yaml"

# IDF1 measured on make_video(seed 0)'s 200 frames with noisy_detections(seed 0), threshold 0.5:
# bytetrack 0.791, sort 0.790, ocsort 0.688 (OC-SORT withholds an id for minimum_consecutive_frames
# after every miss, as its authors' code does: more misses). The ids renumbered every 10 frames give
# 0.07, shuffled within each frame 0.14-0.16.
IDF1_FLOORS = {"bytetrack": 0.75, "sort": 0.75, "ocsort": 0.65}


@pytest.fixture(scope="module")
def shapes_video():
    video = make_video(seed=0)
    return video, noisy_detections(video.truth, video.size, seed=0)


@pytest.mark.parametrize("tracker", IDF1_FLOORS)
def test_identities_on_the_noisy_ground_truth(shapes_video, tracker):
    pytest.importorskip("trackers", reason="tracking needs Roboflow's trackers (the track extra, in dev)")
    pytest.importorskip("motmetrics", reason="the reference metrics (dev extra)")
    video, noisy = shapes_video
    tracking = Tracking(tracker, threshold=0.5, frame_rate=video.fps)
    tracked = [tracking.update(frame) for frame in noisy]
    # the output is the input at the threshold, in its order, with an id each
    for given, out in zip(noisy, tracked, strict=True):
        kept = given.scores >= 0.5
        np.testing.assert_array_equal(out.boxes, given.boxes[kept])
        assert out.track_ids.shape == (int(kept.sum()),)
    idf1 = mot_metrics([accumulate(video.truth, tracked)])["idf1"]
    assert idf1 >= IDF1_FLOORS[tracker]
    # broken identities fail that floor: the same boxes, ids renumbered every 10 frames, or shuffled in each frame
    renumbered = [
        dataclasses.replace(f, track_ids=np.where(f.track_ids >= 0, f.track_ids + 1000 * (t // 10), -1))
        for t, f in enumerate(tracked)
    ]
    rng = np.random.default_rng(0)
    shuffled = [dataclasses.replace(f, track_ids=rng.permutation(f.track_ids)) for f in tracked]
    for broken in (renumbered, shuffled):
        assert mot_metrics([accumulate(video.truth, broken)])["idf1"] < IDF1_FLOORS[tracker] - 0.3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """test_predict's tiny model with its initial weights, and a short synthetic video."""
    pytest.importorskip("av", reason="videos need PyAV (the video extra, in dev)")
    tmp = tmp_path_factory.mktemp("tiny_tracking")
    mx.random.seed(3)
    model = build_model(load_config(TINY))
    mx.save_safetensors(str(tmp / "weights.safetensors"), dict(tree_flatten(model.parameters())))
    write_video(tmp / "clip.mp4", make_video(seed=1, frames=16, size=(96, 72)))
    argv = ["--config", str(TINY), "--checkpoint", str(tmp / "weights.safetensors"), "--precision", "float32"]
    return argv, tmp


def test_predict_track_is_detector_track(tiny, tmp_path):
    pytest.importorskip("trackers", reason="tracking needs Roboflow's trackers (the track extra, in dev)")
    import av

    argv, tmp = tiny
    video = str(tmp / "clip.mp4")
    # the untrained model scores under 0.1: threshold 0 (SORT starts a track at it; ByteTrack at 0.1)
    argv = [*argv, "--threshold", "0", "--batch-size", "3"]
    predict_main([*argv, "--output-dir", str(tmp_path / "plain"), video])
    predict_main([*argv, "--output-dir", str(tmp_path / "sort"), "--track", "sort", video])
    predict_main([*argv, "--output-dir", str(tmp_path / "bytetrack"), "--track", video])  # bare: ByteTrack
    plain, tracked, bare = (
        json.loads((tmp_path / d / "clip.json").read_text()) for d in ("plain", "sort", "bytetrack")
    )
    assert tracked["tracker"] == "sort" and bare["tracker"] == "bytetrack" and "tracker" not in plain
    assert len(tracked["frames"]) == 16
    for one, other, untracked in zip(tracked["frames"], bare["frames"], plain["frames"], strict=True):
        for run in (one, other):  # the same detections as without --track, each with its track_id
            detections = [dict(d) for d in run["detections"]]
            assert all(isinstance(d.pop("track_id"), int) for d in detections)
            assert {**run, "detections": detections} == untracked
    with av.open(str(tmp / "clip.mp4")) as source:
        frames = [frame.to_image() for frame in source.decode(video=0)]
    detector = Detector.load(tmp / "weights.safetensors", TINY, precision="float32")
    results = list(detector.track(frames, "sort", threshold=0.0, batch_size=1, frame_rate=25))
    ids = [[d["track_id"] for d in frame["detections"]] for frame in tracked["frames"]]
    assert ids == [r.track_ids.tolist() for r in results]
    assert [[d["query"] for d in frame["detections"]] for frame in tracked["frames"]] == [
        r.queries.tolist() for r in results
    ]
    found = {i for frame in ids for i in frame if i >= 0}
    assert found and all(sum(i in frame for frame in ids) >= 8 for i in found)  # ids that last
    with av.open(str(tmp_path / "sort" / "clip.mp4")) as annotated, av.open(str(tmp_path / "plain" / "clip.mp4")) as p:
        drawn = [np.asarray(f.to_image(), np.float32) for f in annotated.decode(video=0)]
        boxes_only = [np.asarray(f.to_image(), np.float32) for f in p.decode(video=0)]
    assert len(drawn) == 16
    # ids and trails drawn where there are ids: the pixels they change (frame 0: no id yet, the same picture
    # to the codec's noise, 0.04% of the pixels 40 levels apart; frames with ids, 7.5-8.2%)
    changed = [(np.abs(one - other).max(-1) > 40).mean() for one, other in zip(drawn, boxes_only, strict=True)]
    assert changed[0] < 0.01 and min(changed[2:]) > 0.03


def test_track_needs_the_extra_and_a_video(tiny, tmp_path, monkeypatch, capsys):
    argv, tmp = tiny
    make_video(seed=2, frames=1, size=(64, 64)).frames[0].save(tmp_path / "frame.png")
    with pytest.raises(SystemExit) as stopped:
        predict_main([*argv, "--track", str(tmp_path / "frame.png")])
    assert stopped.value.code == 2  # a usage error
    assert f"--track follows objects from frame to frame of a video; {tmp_path / 'frame.png'} is an image" in (
        capsys.readouterr().err
    )
    monkeypatch.setitem(__import__("sys").modules, "trackers", None)  # as if trackers were not installed
    hint = r'tracking needs trackers, in the "track" extra: pip install -e "\.\[track\]"'
    with pytest.raises(SystemExit, match=hint):
        predict_main([*argv, "--output-dir", str(tmp_path / "out"), "--track", str(tmp / "clip.mp4")])
    assert not (tmp_path / "out").exists()  # before any work
    detector = Detector.load(tmp / "weights.safetensors", TINY, precision="float32")
    with pytest.raises(CommandError, match=hint):
        detector.track([np.zeros((64, 64, 3), np.uint8)])
