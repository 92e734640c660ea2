"""Videos through `predict`, frame by frame (`Detector.predict`, or `Detector.track` with --track): an
annotated video and the detections of every frame. Needs PyAV (the `video` extra); --track, Roboflow's
`trackers` (the `track` extra)."""

import json
import time
from collections import deque
from pathlib import Path

from tqdm import tqdm

from ..errors import UsageError, optional
from ..inference.tracking import TrackDrawing, check_tracker


def _av():
    return optional("av", "video", "reading a video")  # PyAV


def check_video_arguments(videos: list[Path], args):
    """Before any work: PyAV is there (and trackers, to --track), every video opens, and nothing asked
    is for images only."""
    av = _av()
    if args.attention or args.encoder_pixel is not None:
        raise UsageError(f"--attention and --encoder-pixel are for images, not videos ({videos[0]})")
    if args.track:
        check_tracker(args.tracker)
    for path in videos:
        with _opened(av, path):
            pass


def _opened(av, path: Path):
    try:
        container = av.open(str(path))
    except (av.error.FFmpegError, OSError) as error:
        raise ValueError(f"{path}: cannot read it as a video ({error})") from None
    if not container.streams.video:
        container.close()
        raise ValueError(f"{path}: has no video stream")
    return container


def predict_video(path: Path, detector, args):
    """Writes args.output_dir/<stem>.mp4 (H.264, the input's frame rate; even width and height) and
    <stem>.json: {"video", "fps", "frames": [{"frame", "time", "detections": [Detections.to_json()]}]};
    with args.track, "tracker" (args.tracker's name) too, each detection's "track_id" (-1: none), and
    the ids and their trails drawn (`TrackDrawing`)."""
    av = _av()
    out_path, frames, start = args.output_dir / f"{path.stem}.mp4", [], time.perf_counter()
    tracker = args.tracker if args.track else None
    with _opened(av, path) as source, av.open(str(out_path), "w") as sink:
        stream = source.streams.video[0]
        fps = stream.average_rate or 25
        encoder = sink.add_stream("libx264", rate=fps)
        size = encoder.width, encoder.height = stream.width // 2 * 2, stream.height // 2 * 2
        encoder.pix_fmt = "yuv420p"
        decoded = deque()  # (time, image) of the frames decoded and not yet written

        def images():
            for frame in source.decode(stream):
                decoded.append((float(frame.time or 0.0), frame.to_image()))
                yield decoded[-1][1]

        if tracker:
            results = detector.track(images(), tracker, args.threshold, args.batch_size, frame_rate=float(fps))
            draw = TrackDrawing(trail=max(round(float(fps)), 2)).draw  # a second's trail
        else:
            batches = _batches(images(), args.batch_size)
            results = (r for batch in batches for r in detector.predict(batch, args.threshold, batch_size=len(batch)))
            draw = lambda image, result: result.draw(image)  # noqa: E731
        with tqdm(total=stream.frames or None, unit="frame", desc=path.name) as bar:
            try:
                for result in results:
                    time_s, image = decoded.popleft()
                    drawn = draw(image, result)
                    sink.mux(encoder.encode(av.VideoFrame.from_image(drawn.crop((0, 0, *size)))))
                    frames.append({"frame": len(frames), "time": time_s, "detections": result.to_json()})
                    bar.update()
            except av.error.FFmpegError as error:
                raise ValueError(f"{path}: cannot decode frame {len(frames) + len(decoded)} ({error})") from None
        sink.mux(encoder.encode())
    record = {"video": str(path), "fps": float(fps)} | ({"tracker": tracker} if tracker else {}) | {"frames": frames}
    (args.output_dir / f"{path.stem}.json").write_text(json.dumps(record, indent=1))
    seconds = time.perf_counter() - start
    print(f"{path}: {len(frames)} frames in {seconds:.1f} s ({len(frames) / seconds:.2f} frames/s) -> {out_path}")


def _batches(frames, size: int):
    batch = []
    for frame in frames:
        batch.append(frame)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
