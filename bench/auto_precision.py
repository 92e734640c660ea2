"""Where bfloat16 inference starts to pay: a model's forward at float32 and at bfloat16 (oneDNN's products,
models/precision.py) by the forward's input size and batch, on this CPU, warm (each shape's plans made).

    python bench/auto_precision.py [--checkpoint output/shapes/checkpoint.safetensors] [--r50]
                                   [--sizes 120x160,240x320,480x640,800x1066] [--batches 1,2,4,8]
                                   [--repeats 5] [--output bench/results/auto_precision_cpu.txt]

For each model (the quick start's checkpoint; with --r50, configs/r50.yaml's model, random weights: its time
does not depend on them), each (height, width) the model is given (as after the resize) and each batch: the
median of `--repeats` forwards (the model and its postprocess, `Detector.detect`'s work without the image
reading) at float32, at bfloat16 and at `auto` (bfloat16 for the products its rule, measured at start, says
pay: kernels.precision.bfloat16_rule), in one process, alternating, and float32's time over each. `auto`
should never be the slower: where bfloat16 does not pay (small products), it is float32's. Pairs over --max-
pixels (default 4 M) are left out (memory). Where bfloat16 products are not fast here
(kernels.bfloat16_products) there is nothing to compare."""

import datetime
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
from deformable_detr import Detector  # noqa: E402
from deformable_detr.config import load_config  # noqa: E402
from deformable_detr.errors import ArgumentParser, entry_point  # noqa: E402
from deformable_detr.models.deformable_detr import build_model, post_process  # noqa: E402
from deformable_detr.models.precision import resolve_precision  # noqa: E402

import mlx.core as mx  # noqa: E402
from common import cpu_model, image_sizes, instruction_caps, load_average, report  # noqa: E402

PRECISIONS = ("float32", "bfloat16", "auto")


def forward_seconds(detectors: dict, height: int, width: int, batch: int, repeats: int) -> dict:
    """{precision: the median seconds of a forward of `batch` images of (height, width)}, the precisions'
    forwards alternating (the machine's drift falls on each), each precision its own Detector over the one model:
    its own store of weight copies, as a process serving one precision has (one store for all would replace
    each weight's copy whenever the precision changed, a reorder of every weight a forward)."""
    pixels = mx.random.uniform(shape=(batch, height, width, 3))
    mask = mx.zeros((batch, height, width), mx.bool_)

    def run(precision: str) -> float:
        detector = detectors[precision]
        start = time.perf_counter()
        with detector.products():
            outputs = detector.model(pixels, mask)
            mx.eval(post_process(outputs, [[height, width]] * batch))
        return time.perf_counter() - start

    times = {p: [] for p in PRECISIONS}
    for p in PRECISIONS:  # warm-up: plans made, kept weights copied
        run(p)
    for _ in range(repeats):
        for p in PRECISIONS:
            times[p].append(run(p))
    return {p: statistics.median(t) for p, t in times.items()}


def table(name: str, model, cfg, sizes, batches, repeats: int, max_pixels: int) -> list[str]:
    detectors = {p: Detector(model, cfg, {}, precision=resolve_precision(p)) for p in PRECISIONS}
    lines = [
        f"## {name}",
        "",
        "| height x width | batch | pixels (M) | float32 ms | bfloat16 ms | auto ms | float32 / bfloat16 | "
        "float32 / auto |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for height, width in sizes:
        for batch in batches:
            pixels = height * width * batch
            if pixels > max_pixels:
                continue
            seconds = forward_seconds(detectors, height, width, batch, repeats)
            ms = " | ".join(f"{seconds[p] * 1e3:.0f}" for p in PRECISIONS)
            ratios = " | ".join(f"{seconds['float32'] / seconds[p]:.2f}" for p in PRECISIONS[1:])
            lines.append(f"| {height} x {width} | {batch} | {pixels / 1e6:.2f} | {ms} | {ratios} |")
            print(lines[-1], flush=True)
    return [*lines, ""]


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "output" / "shapes" / "checkpoint.safetensors")
    parser.add_argument("--r50", action="store_true", help="also configs/r50.yaml's model (random weights)")
    parser.add_argument("--sizes", type=image_sizes, default=image_sizes("120x160,240x320,480x640,800x1066"))
    parser.add_argument("--batches", default="1,2,4,8", help="batch sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-pixels", type=float, default=4e6, help="leave out larger forwards (memory)")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "auto_precision_cpu.txt")
    args = parser.parse_args(argv)
    import kernels

    fast, why = kernels.bfloat16_products()
    if not fast:
        print(f"bfloat16 products are not fast here ({why}): nothing to compare")
        return
    batches = [int(b) for b in args.batches.split(",")]
    lines = [
        f"Forward time at float32 and bfloat16 by size and batch; {datetime.datetime.now():%Y-%m-%d %H:%M}, "
        f"{cpu_model(count=True)}{instruction_caps()}, bfloat16 products: {why}; mlx {mx.__version__}, "
        f"{kernels.onednn.describe()}; load average at start: {load_average()}",
        f"auto's rule: {kernels.bfloat16_rule()}; {kernels.bfloat16_rule().measured}",
        f"command: python bench/auto_precision.py {' '.join(argv if argv is not None else sys.argv[1:])}",
        "",
    ]
    quick_start = Detector.load(args.checkpoint, precision="float32")
    models = [("the quick start's model", quick_start.model, quick_start.cfg)]
    if args.r50:
        cfg = load_config(ROOT / "configs" / "r50.yaml")
        models.append(("R50 (configs/r50.yaml, random weights)", build_model(cfg), cfg))
    for name, model, cfg in models:
        lines += table(name, model, cfg, args.sizes, batches, args.repeats, args.max_pixels)
    lines.append(f"load average at the end: {load_average()}")
    print(report(lines, args.output))


if __name__ == "__main__":
    main()
