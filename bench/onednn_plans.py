"""oneDNN's plan cache (kernels/onednn.py: a shape's primitives, least recently used out first): what a
training step makes again at each capacity (KERNELS_ONEDNN_PLANS), and what a plan costs to make and
to keep.

    python bench/onednn_plans.py [--capacities 32,1024] [--steps 3] [--size 512x683]
                                 [--output bench/results/onednn_plans_cpu.txt]

The step: configs/r50.yaml at batch 2 (bench/model.py's), in float32 and, where its products are fast here,
in bfloat16 (`train.precision`), each capacity and precision in its own process. After a first step (every
plan made), --steps steps: each step's plans made again (cache misses) and found (hits), convolutions +
products; the primitives oneDNN made (JIT-compiled) in them and the milliseconds that took (its own count,
ONEDNN_VERBOSE=profile_create: its primitive cache has the same capacity, counting every primitive, reorders
too); the step's median seconds (on a shared machine they move more than that); resident MiB after the first
step and the last.
A plan: new shapes of R50's kinds (a 3 x 3 convolution of 256 channels with its backward passes, a 1 x 1 of
1024 -> 256 forward, a product (m, 256) x (256, 1024)), 40 of each in one process a precision: milliseconds
to make one, and the process's resident KiB per plan kept.
"""

import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels  # noqa: E402, I001  (before mlx: the BLAS)
from deformable_detr.errors import ArgumentParser, entry_point  # noqa: E402

from common import RESULTS, cpu_model, image_sizes, instruction_caps, load_average, measured, report  # noqa: E402

SHAPES = 40  # new shapes of each kind for a plan's costs


def resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def lookups() -> tuple[int, int, int, int]:
    """(convolution misses, product misses, convolution hits, product hits) so far."""
    caches = kernels.onednn.caches()
    return tuple(caches[f"{kind}_{what}"] for what in ("misses", "hits") for kind in ("convolution", "product"))


class Creations:
    """oneDNN's ONEDNN_VERBOSE=profile_create lines (on this process's stdout, which it takes into a file):
    the primitives it made, not found in its primitive cache, since the last `read`, and their milliseconds."""

    def __init__(self):
        self.libc = ctypes.CDLL(None)
        descriptor, self.path = tempfile.mkstemp()
        self.stdout = os.dup(1)
        os.dup2(descriptor, 1)
        os.close(descriptor)
        self.reader = open(self.path)  # an offset of its own, not the writer's

    def read(self) -> tuple[int, float]:
        self.libc.fflush(None)  # oneDNN's printf
        lines = self.reader.read().splitlines()
        made = [line.split(",") for line in lines if line.startswith("onednn_verbose,create:cache_miss")]
        return len(made), sum(float(fields[-1]) for fields in made)

    def close(self):
        self.libc.fflush(None)
        os.dup2(self.stdout, 1)
        self.reader.close()
        os.unlink(self.path)


def measure_step(size: tuple, steps: int, precision: str) -> dict:
    """In this process (its capacity from the environment): the first step, then `steps` more."""
    from model import ours_setup

    creations = Creations()
    try:
        _, _, trainer, images, mask, targets = ours_setup("train", size, precision=precision)
        batch = [(images, mask, targets)]
        trainer.step(batch)
        first = resident_mib()
        creations.read()
        rows = []
        for _ in range(steps):
            before = lookups()
            start = time.perf_counter()
            trainer.step(batch)
            seconds = time.perf_counter() - start
            counts = [now - then for now, then in zip(lookups(), before, strict=True)]
            rows.append([seconds, *counts, *creations.read()])
    finally:
        creations.close()
    median = [statistics.median(column) for column in zip(*rows, strict=True)]
    caches = kernels.onednn.caches()
    return {
        "seconds": median[0],
        "made": median[1:3],
        "found": median[3:5],
        "primitives": median[5],
        "primitives_ms": median[6],
        "kept": [caches["convolutions"], caches["products"]],
        "rss_first": first,
        "rss_last": resident_mib(),
    }


def measure_plans(precision: str) -> list:
    """[(kind, ms to make a plan, resident KiB a plan kept)] for SHAPES new shapes of each kind."""
    import mlx.core as mx

    extension, bfloat16 = kernels.onednn.module(), precision == "bfloat16"
    extension.set_capacity(10 * SHAPES)
    kinds = [
        (
            "3 x 3 convolution, 256 channels, with its backward passes",
            lambda s: extension.conv2d_implementation(
                mx.zeros((2, s, s + 3, 256)), mx.zeros((256, 3, 3, 256)), 1, 1, 1, bfloat16, True
            ),
        ),
        (
            "1 x 1 convolution, 1024 -> 256, forward",
            lambda s: extension.conv2d_implementation(
                mx.zeros((2, s, s + 3, 1024)), mx.zeros((256, 1, 1, 1024)), 1, 0, 1, bfloat16, False
            ),
        ),
        (
            "product (m, 256) x (256, 1024)",
            lambda s: extension.product_implementation(
                mx.zeros((100 * s, 256)), mx.zeros((1024, 256)), None, False, True, bfloat16
            ),
        ),
    ]
    rows = []
    for kind, make in kinds:
        make(SHAPES - 1)  # oneDNN's own first-use costs
        start, resident = time.perf_counter(), resident_mib()
        for s in range(SHAPES, 2 * SHAPES):
            make(s)
        rows.append([kind, (time.perf_counter() - start) / SHAPES * 1e3, (resident_mib() - resident) * 1024 / SHAPES])
    return rows


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacities", default="32,1024", help="plan capacities, comma-separated")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--size", type=image_sizes, default="512x683", help="HxW of the training images")
    parser.add_argument("--output", type=Path, default=RESULTS / "onednn_plans_cpu.txt")
    parser.add_argument("--measure", choices=["float32", "bfloat16"], help="(internal) one process's step")
    parser.add_argument("--plans", choices=["float32", "bfloat16"], help="(internal) one process's plans")
    args = parser.parse_args(argv)
    size = args.size[0]
    if args.measure or args.plans:
        print(json.dumps(measure_step(size, args.steps, args.measure) if args.measure else measure_plans(args.plans)))
        return
    if kernels.onednn.module() is None:
        sys.exit(f"error: oneDNN is not used here: {kernels.onednn.missing()}")
    capacities = [int(text) for text in args.capacities.split(",")]
    precisions = ["float32"] + (["bfloat16"] if kernels.bfloat16_products()[0] else [])
    lines = [
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU: {cpu_model(count=True)}"
        f"{instruction_caps()}; load average at start: {load_average()}; {kernels.onednn.describe()}",
        f"R50 training step, batch 2 at {size[0]} x {size[1]}, one process a row: the median of {args.steps} steps "
        "after the first; plans made again and found a step, kept at the end (convolutions + products); the "
        "primitives oneDNN made a step and their ms; resident MiB after the first step and the last",
        "",
        "| precision | plans (capacity) | made again | found | kept | oneDNN made | ms | step s | RSS first | last |",
        "| --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for precision in precisions:
        for capacity in capacities:
            command = [sys.executable, __file__, "--measure", precision, "--steps", str(args.steps)]
            command += ["--size", f"{size[0]}x{size[1]}"]
            env = {**os.environ, "KERNELS_ONEDNN_PLANS": str(capacity), "ONEDNN_VERBOSE": "profile_create"}
            run = measured(command, env, f"the {precision} step at {capacity} plans")
            lines.append(
                f"| {precision} | {capacity} | {run['made'][0]:.0f} + {run['made'][1]:.0f} | "
                f"{run['found'][0]:.0f} + {run['found'][1]:.0f} | {run['kept'][0]} + {run['kept'][1]} | "
                f"{run['primitives']:.0f} | {run['primitives_ms']:.1f} | {run['seconds']:.2f} | "
                f"{run['rss_first']:.0f} | {run['rss_last']:.0f} |"
            )
    lines += [
        "",
        f"A plan: {SHAPES} new shapes of each kind, one process a precision; ms to make one, resident KiB a plan kept",
        "",
        "| precision | plan | ms to make | KiB kept |",
        "| --- | --- | ---: | ---: |",
    ]
    for precision in precisions:
        command = [sys.executable, __file__, "--plans", precision]
        for kind, ms, kib in measured(command, dict(os.environ), f"the {precision} plans"):
            lines.append(f"| {precision} | {kind} | {ms:.2f} | {kib:.0f} |")
    report(lines, args.output)


if __name__ == "__main__":
    main()
