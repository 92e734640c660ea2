"""The README's Python example against the predict command on the same R50 image, in one run.

    python bench/python_api.py [--repeats 3] [--size 800x1066] [--output FILE]

Both load the same weights (configs/r50.yaml's model, random weights, saved as converted weights
are) and detect on one image of `--size`; each runs as a fresh process, alternately, `--repeats`
times. Measured: the whole process (Python's start, the imports, loading the weights, the detection,
and for the command its pictures and JSON), and the detection alone (the example's
`detector.predict(image)`; the command's own "N image(s) in X s", which includes drawing and writing
its files). Before 2026-12-02 the example ran on MLX's bundled BLAS (nothing set it up in a plain
Python process) while the command re-executed itself with OpenBLAS or MKL."""

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import kernels
from deformable_detr.errors import ArgumentParser, entry_point

from common import image_sizes, report

ROOT = Path(__file__).resolve().parents[1]

EXAMPLE = """
import time
from deformable_detr import Detector
from PIL import Image

detector = Detector.load({weights!r})
image = Image.open({image!r})
start = time.perf_counter()
results = detector.predict(image, threshold=0.5)
print("detection", time.perf_counter() - start)
print([(name, round(float(score), 2)) for name, score in zip(results[0].names[:5], results[0].scores[:5])])
"""


def make_inputs(folder: Path, size: tuple[int, int]) -> tuple[Path, Path]:
    """R50 weights that say which model they are, and an image of `size` (H, W)."""
    from deformable_detr import build_model, load_config
    from deformable_detr.weights.files import CONFIG_FILE_KEY, MODEL_OPTIONS_KEY, save_weights

    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from PIL import Image

    mx.random.seed(0)
    model = build_model(load_config(ROOT / "configs" / "r50.yaml"))
    weights = folder / "r50.safetensors"
    metadata = {MODEL_OPTIONS_KEY: json.dumps({}), CONFIG_FILE_KEY: "r50.yaml"}
    save_weights(weights, dict(tree_flatten(model.parameters())), {1: "person"}, metadata)
    image = folder / "image.jpg"
    pixels = np.random.default_rng(0).integers(0, 255, (*size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(image)
    return weights, image


def timed(command: list) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"error: {' '.join(command[:3])} failed:\n{done.stderr[-3000:]}")
    return seconds, done.stdout


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size", type=image_sizes, default="800x1066", help="HxW of the image")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "python_api_cpu.txt")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        weights, image = make_inputs(Path(folder), args.size[0])
        example = [sys.executable, "-c", EXAMPLE.format(weights=str(weights), image=str(image))]
        command = [sys.executable, "-m", "deformable_detr.predict", "--checkpoint", str(weights)]
        command += ["--output-dir", str(Path(folder) / "out"), str(image)]
        sides = {"the README's Python example": ([], []), "python -m deformable_detr.predict": ([], [])}
        for _ in range(args.repeats):
            for name, run in zip(sides, (example, command), strict=True):
                seconds, said = timed(run)
                detection = [line for line in said.splitlines() if line.startswith(("detection", "1 image(s)"))][0]
                sides[name][0].append(seconds)
                sides[name][1].append(
                    float(detection.split()[1] if detection.startswith("detection") else detection.split()[3])
                )
                print(name, f"{seconds:.2f} s", detection, flush=True)
    size = args.size[0]
    lines = [
        f"R50 (configs/r50.yaml, random weights), one {size[0]} x {size[1]} image; each side a fresh process, "
        f"alternately, median of {args.repeats}; BLAS {kernels.blas.description()}",
        "",
        "| | whole process (s) | detection (s) |",
        "| --- | ---: | ---: |",
    ]
    medians = {name: (statistics.median(a), statistics.median(b)) for name, (a, b) in sides.items()}
    lines += [f"| {name} | {whole:.2f} | {detection:.2f} |" for name, (whole, detection) in medians.items()]
    (example_whole, example_detection), (command_whole, command_detection) = medians.values()
    lines += [
        "",
        f"example / command: whole process {example_whole / command_whole:.3f}, "
        f"detection {example_detection / command_detection:.3f}",
    ]
    report(lines, args.output)


if __name__ == "__main__":
    main()
