"""Videos through `predict`, frame by frame (`Detector.predict`): an annotated video and the detections
of every frame. Needs PyAV (the `video` extra)."""

import json
import time
from pathlib import Path

from tqdm import tqdm

from .errors import CommandError, UsageError, install_hint


def _av():
    try:
        import av
    except ImportError:
        raise CommandError(
            f'videos need PyAV, the "video" extra: {install_hint("video")} (or pip install av)'
        ) from None
    return av


def check_video_arguments(videos: list[Path], args):
    """Before any work: PyAV is there, every video opens, and nothing asked is for images only."""
    av = _av()
    if args.attention or args.encoder_pixel is not None:
        raise UsageError(f"--attention and --encoder-pixel are for images, not videos ({videos[0]})")
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
    <stem>.json: {"video", "fps", "frames": [{"frame", "time", "detections": [Detections.to_json()]}]}."""
    av = _av()
    out_path, frames, start = args.output_dir / f"{path.stem}.mp4", [], time.perf_counter()
    with _opened(av, path) as source, av.open(str(out_path), "w") as sink:
        stream = source.streams.video[0]
        fps = stream.average_rate or 25
        encoder = sink.add_stream("libx264", rate=fps)
        size = encoder.width, encoder.height = stream.width // 2 * 2, stream.height // 2 * 2
        encoder.pix_fmt = "yuv420p"
        with tqdm(total=stream.frames or None, unit="frame", desc=path.name) as bar:
            try:
                for batch in _batches(source.decode(stream), args.batch_size):
                    images = [frame.to_image() for frame in batch]
                    results = detector.predict(images, args.threshold, batch_size=len(images))
                    for frame, image, result in zip(batch, images, results, strict=True):
                        drawn = result.draw(image)
                        sink.mux(encoder.encode(av.VideoFrame.from_image(drawn.crop((0, 0, *size)))))
                        time_s = float(frame.time or 0.0)
                        frames.append({"frame": len(frames), "time": time_s, "detections": result.to_json()})
                    bar.update(len(batch))
            except av.error.FFmpegError as error:
                raise ValueError(f"{path}: cannot decode frame {len(frames)} ({error})") from None
        sink.mux(encoder.encode())
    record = {"video": str(path), "fps": float(fps), "frames": frames}
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
