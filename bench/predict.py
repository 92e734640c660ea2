"""predict's throughput with and without where the model looks (`--attention`, `--encoder-pixel`),
and what recording costs the R50 model's forward.

    python bench/predict.py [--checkpoint output/shapes/checkpoint.safetensors] [--images data/shapes/val2017]
                            [--count 100] [--size 800x1066] [--repeats 3] [--output bench/results/predict_cpu.txt]

1. The quick start's model (train it first: `python train.py --config configs/shapes.yaml`) on the
   first `--count` val images: `predict`'s own images/s (loading, the forward, drawing and writing
   every file) plain, with --attention, and with --attention --encoder-pixel, in batches of 1 and 4;
   and the forward with post-processing alone (`Detector.detect`, median of 3 passes over the images).
2. configs/r50.yaml with random weights on one image of `--size`: the forward and post-processing
   (`Detector.detect`), median of `--repeats` after a warm-up, without recording and recording the last
   decoder layer (and the last encoder layer); and the check that is all an unrecorded attention
   call adds (`self.recorder is not None`), timed alone, times the model's 18 attention calls.
"""

import contextlib
import io
import re
import sys
import tempfile
import timeit
from pathlib import Path

import kernels
from deformable_detr.errors import ArgumentParser, entry_point

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import image_sizes, median_time, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "plain": [],
    "--attention": ["--attention"],
    "--attention --encoder-pixel": ["--attention", "--encoder-pixel", "60,40"],
}


def predict_throughput(checkpoint: Path, images: list[Path], batch: int, flags: list[str]) -> float:
    from deformable_detr.predict import main as predict

    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()) as said:
        argv = ["--config", str(ROOT / "configs" / "shapes.yaml"), "--checkpoint", str(checkpoint)]
        predict(
            [*argv, "--output-dir", out, "--threshold", "0.3", "--batch-size", str(batch), *flags, *map(str, images)]
        )
    return float(re.search(r"([\d.]+) images/s", said.getvalue()).group(1))


def forward_throughput(checkpoint: Path, paths: list[Path]) -> list[float]:
    """Images/s of the forward and post-processing alone (`Detector.detect`, one image a call) per mode."""
    from deformable_detr.inference.detector import Detector

    from PIL import Image

    detector = Detector.load(checkpoint, ROOT / "configs" / "shapes.yaml")
    images = [Image.open(path).convert("RGB") for path in paths]
    rates = []
    for looking in ((None, None), (-1, None), (-1, (60, 40))):

        def run(looking=looking):
            for image in images:
                detector.detect([image], *looking)

        rates.append(len(images) / median_time(run, 3))
    return rates


def r50_forward(size: tuple[int, int], repeats: int) -> dict:
    from deformable_detr import build_model, load_config
    from deformable_detr.inference.detector import Detector
    from deformable_detr.models.ms_deform_attn import MSDeformAttn

    import mlx.core as mx
    import numpy as np
    from PIL import Image

    cfg = load_config(ROOT / "configs" / "r50.yaml", [f"data.val_size={size[0]}", f"data.max_size={size[1]}"])
    mx.random.seed(0)
    detector = Detector(build_model(cfg), cfg, {})
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (*size, 3), dtype=np.uint8))
    seconds = {}
    for name, looking in (
        ("not recording", (None, None)),
        ("recording the last decoder layer", (-1, None)),
        ("recording it and the last encoder layer", (-1, (size[1] / 2, size[0] / 2))),
    ):
        seconds[name] = median_time(lambda looking=looking: detector.detect([image], *looking), repeats)
    attention = MSDeformAttn(32, 1, 1, 1)
    calls = 1_000_000
    check = timeit.timeit(lambda: attention.recorder is not None, number=calls) / calls
    unrecorded = check - timeit.timeit(lambda: None, number=calls) / calls
    return {"seconds": seconds, "check_per_forward_s": 18 * unrecorded, "mlx": mx.__version__}


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "output" / "shapes" / "checkpoint.safetensors")
    parser.add_argument("--images", type=Path, default=ROOT / "data" / "shapes" / "val2017")
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--size", type=image_sizes, default="800x1066", help="HxW of the R50 image")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "predict_cpu.txt")
    args = parser.parse_args(argv)
    if not args.checkpoint.is_file():
        raise FileNotFoundError(f"{args.checkpoint}: no such file; train.py --config configs/shapes.yaml writes it")
    images = sorted(args.images.glob("*.png"))[: args.count]
    shown = args.images.relative_to(ROOT) if args.images.is_relative_to(ROOT) else args.images
    lines = [f"1. predict, the quick start's model, {len(images)} val images ({shown}); its own images/s", ""]
    lines += ["| batch | " + " | ".join(MODES) + " |", "| ---: |" + " ---: |" * len(MODES)]
    for batch in (1, 4):
        rates = [predict_throughput(args.checkpoint, images, batch, flags) for flags in MODES.values()]
        lines.append(f"| {batch} | " + " | ".join(f"{r:.2f}" for r in rates) + " |")
        print(lines[-1], flush=True)
    rates = forward_throughput(args.checkpoint, images)
    lines.append("| 1, the forward and post-processing alone | " + " | ".join(f"{r:.2f}" for r in rates) + " |")
    lines += ["", "(the rest of predict's time: drawing, encoding the PNGs, writing the JSON)"]
    size = args.size[0]
    r50 = r50_forward(size, args.repeats)
    lines += [
        "",
        f"2. R50 (configs/r50.yaml, random weights), one {size[0]} x {size[1]} image: forward + post-processing,",
    ]
    lines += [f"median of {args.repeats} after a warm-up; mlx {r50['mlx']}, CPU with {kernels.blas.choice()}", ""]
    lines += ["| | seconds | vs not recording |", "| --- | ---: | ---: |"]
    base = r50["seconds"]["not recording"]
    lines += [f"| {name} | {s:.3f} | {s / base:.3f} |" for name, s in r50["seconds"].items()]
    lines += [
        "",
        f"an unrecorded forward's 18 checks of `recorder is not None`: {r50['check_per_forward_s'] * 1e6:.2f} us",
    ]
    report(lines, args.output)


if __name__ == "__main__":
    main()
