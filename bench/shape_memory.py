"""The process's memory over many distinct image shapes, with oneDNN (kernels/onednn.py) and without
(KERNELS_ONEDNN=0), each in its own process: does it stay bounded, and what does a new shape cost?

    python bench/shape_memory.py [--inference-shapes 300] [--train-shapes 50]
                                 [--output bench/results/shape_memory_cpu.txt]

Inference: the quick start's model (configs/shapes.yaml, seeded random weights) in evaluation mode, one
forward per distinct (H, W) of 64-256 x 64-256 (as a server meets every aspect ratio), inside
`Detector.products()` as predict runs it. Training: configs/r50.yaml's step at batch 1 (stem and layer1
frozen, AdamW) on distinct padded shapes of 256-416 x 320-416, as its multi-scale recipe pads every batch
to its own size. Each process reports its resident memory (VmRSS) after the first shape and every tenth,
MLX's active memory, oneDNN's plan counts, and the seconds of a new shape's first call against the same
shape's second (JIT compilation of oneDNN's kernels, plan making, MLX's graph). The bar (issue 61): the
growth with oneDNN within 10% of the growth without (or 10 MiB), judged twice: from the first shape,
and from the tenth, once the heap has met the model's sizes. The first is bimodal from run to run of
the same code and shapes (the R50 step as AVX2: +3 to +8 MiB in some runs, +32 to +42 in others,
all of it within the first ten shapes: how glibc's heap happened to be laid out by the first step);
the second is the one that would grow without bound. In inference a Detector also keeps its weights'
copies in the layouts oneDNN's kernels want (kernels.onednn.kept_weights, at most
KERNELS_ONEDNN_WEIGHTS_MIB): a new shape can want a new layout, so that store grows with the
first shapes too (the last column), by design and bounded. Run it as the machine is (an AVX2 CPU's oneDNN
kernels differ: ONEDNN_MAX_CPU_ISA=AVX2 on a newer one); the header says which. It also runs on the code
before issue 61 (PYTHONPATH=<that checkout>, its configs), which gave the "before" figures.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels  # noqa: E402  (first: MLX's BLAS)
from deformable_detr.errors import ArgumentParser, entry_point  # noqa: E402

from common import RESULTS, count_at_least, cpu_model, load_average, measured, report  # noqa: E402

ROOT = Path(kernels.__file__).resolve().parents[1]  # the checkout measured (and its configs)


def caches() -> dict:
    """kernels.onednn's cache counts ({} before issue 61, which kept no count)."""
    return getattr(kernels.onednn, "caches", dict)()


def resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def distinct_shapes(count: int, heights: range, widths: range, seed: int = 0) -> list[tuple[int, int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    pairs = [(h, w) for h in heights for w in widths]
    return [pairs[i] for i in rng.choice(len(pairs), size=count, replace=False)]


def inference_run(count: int):
    """(run(h, w), shapes): the quick start's model's forward at (h, w), as Detector runs it."""
    from deformable_detr import Detector, build_model, load_config

    import mlx.core as mx
    import numpy as np

    cfg = load_config(ROOT / "configs" / "shapes.yaml", ["model.dropout=0.0"])
    mx.random.seed(0)
    detector = Detector(build_model(cfg), cfg, {})
    rng = np.random.default_rng(0)

    def run(h, w):
        with detector.products():
            mx.eval(
                detector.model(
                    mx.array(rng.standard_normal((1, h, w, 3)).astype(np.float32)), mx.zeros((1, h, w), mx.bool_)
                )
            )

    run.kept_weights = detector.kept_weights  # its copies of the weights in oneDNN's layouts (None without)
    return run, distinct_shapes(count, range(64, 257, 4), range(64, 257, 4))


def training_run(count: int):
    """(run(h, w), shapes): configs/r50.yaml's training step at batch 1 on an (h, w) batch."""
    from deformable_detr import build_model, load_config
    from deformable_detr.training.trainer import Trainer

    import mlx.core as mx
    import numpy as np

    overrides = ["schedule.batch_size=1", "schedule.micro_batch_size=1", "train.activation_checkpointing=false"]
    cfg = load_config(ROOT / "configs" / "r50.yaml", overrides)
    mx.random.seed(0)
    model = build_model(cfg)
    shapes = distinct_shapes(count, range(256, 417, 8), range(320, 417, 8))
    trainer = Trainer.from_config(model, cfg, [(w, h) for h, w in shapes])
    rng = np.random.default_rng(0)
    targets = [
        {
            "labels": np.array([1, 17], np.int64),
            "boxes": np.array([[0.3, 0.3, 0.2, 0.2], [0.6, 0.5, 0.3, 0.4]], np.float32),
        }
    ]

    def run(h, w):
        images = rng.standard_normal((1, h, w, 3)).astype(np.float32)
        trainer.step([(images, np.zeros((1, h, w), bool), targets)])

    return run, shapes


def measure(task: str, count: int) -> dict:
    """In this process: every shape once, RSS after the first and every tenth; then the first call's and a
    repeated call's seconds at 3 new shapes."""
    from kernels import onednn

    import mlx.core as mx

    run, shapes = (inference_run if task == "inference" else training_run)(count + 3)
    shapes, fresh = shapes[:count], shapes[count:]
    trace = []
    for i, (h, w) in enumerate(shapes, 1):
        run(h, w)
        if i == 1 or i % 10 == 0 or i == count:
            trace.append((i, round(resident_mib(), 1), round(mx.get_active_memory() / 2**20, 1)))
    first, again = [], []
    for h, w in fresh:
        start = time.perf_counter()
        run(h, w)
        first.append(time.perf_counter() - start)
        start = time.perf_counter()
        run(h, w)
        again.append(time.perf_counter() - start)
    return {
        "trace": trace,
        "first": sorted(first)[1],
        "again": sorted(again)[1],
        "caches": caches(),
        "kept_weights": kept_weights(getattr(run, "kept_weights", None)),
        "onednn": onednn.describe(),
    }


def kept_weights(store) -> str:
    """A Detector's kept weight copies (kernels.onednn.kept_weights): "count, MiB", or "none"."""
    return "none" if store is None else f"{store.count}, {store.bytes / 2**20:.1f} MiB"


def tenth(trace: list) -> float:
    """The RSS after the tenth shape (the first where fewer were measured)."""
    return next((rss for i, rss, _ in trace if i == 10), trace[0][1])


def row_for(task: str, name: str, result: dict) -> str:
    (_, start, _), (count, end, active) = result["trace"][0], result["trace"][-1]
    warm = tenth(result["trace"])
    caches = result["caches"]
    plans = f"{caches['convolutions']} + {caches['products']}" if caches else "not counted"
    return (
        f"| {task}, {count} shapes | {name} | {start:.0f} | {warm:.0f} | {end:.0f} | {end - start:+.0f} "
        f"| {end - warm:+.0f} | {active:.0f} | {result['first']:.2f} | {result['again']:.2f} | {plans} "
        f"| {result.get('kept_weights', 'none')} |"
    )


def verdict(task: str, since: str, growth: dict) -> str:
    """Whether the growth with oneDNN ("1") is within 10% of the growth without ("0"), or 10 MiB."""
    within = growth["1"] <= 1.10 * max(growth["0"], 0) or growth["1"] - growth["0"] <= 10
    return (
        f"{task}, from the {since} shape: growth with oneDNN {growth['1']:+.0f} MiB, without {growth['0']:+.0f} "
        f"MiB: " + ("within" if within else "NOT within") + " the bar (10% of the growth without, or 10 MiB)"
    )


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    shapes = count_at_least(10, "shapes", "judged from the tenth")  # each task is judged from its tenth shape too
    parser.add_argument("--inference-shapes", type=shapes, default=300)
    parser.add_argument("--train-shapes", type=shapes, default=50)
    parser.add_argument("--output", type=Path, default=RESULTS / "shape_memory_cpu.txt")
    parser.add_argument("--task", choices=("inference", "train"), help=argparse_suppress())
    parser.add_argument("--count", type=int, help=argparse_suppress())
    args = parser.parse_args(argv)
    if args.task:  # a measuring process
        print(json.dumps(measure(args.task, args.count)))
        return
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
    header = [
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU: {cpu_model(count=True)}"
        + (f", ONEDNN_MAX_CPU_ISA={isa}" if isa else "")
        + f"; load average at start: {load_average()}",
        f"the code at {ROOT}; oneDNN: {kernels.onednn.describe()}; plan capacity "
        f"{caches().get('capacity', 'unbounded')} (KERNELS_ONEDNN_PLANS)",
        "inference: configs/shapes.yaml's model, one forward per shape (64-256 x 64-256) as Detector runs it; "
        "train: configs/r50.yaml's step at batch 1, one per shape (256-416 x 320-416); RSS in MiB after the "
        "first shape, the tenth and at the end; growth from the first and from the tenth; a new shape's first "
        "call against the same shape again, seconds",
        "",
        "| task | engine | RSS first | RSS 10th | RSS end | growth | from 10th | MLX active end | new shape s "
        "| again s | plans kept | weight copies kept |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    rows, traces, verdicts = [], [], []
    for task, count in (("inference", args.inference_shapes), ("train", args.train_shapes)):
        growth, settled = {}, {}
        for name, off in (("oneDNN", "1"), ("none (KERNELS_ONEDNN=0)", "0")):
            command = [sys.executable, __file__, "--task", task, "--count", str(count)]
            result = measured(command, {**os.environ, "KERNELS_ONEDNN": off}, f"{task} {name}")
            rows.append(row_for(task, name, result))
            traces.append(
                f"{task}, {name}: RSS after shape " + ", ".join(f"{i}: {r:.0f}" for i, r, _ in result["trace"])
            )
            growth[off] = result["trace"][-1][1] - result["trace"][0][1]
            settled[off] = result["trace"][-1][1] - tenth(result["trace"])
        verdicts += [verdict(task, "first", growth), verdict(task, "tenth", settled)]
        print(rows[-2], rows[-1], sep="\n", flush=True)
    lines = [*header, *rows, "", *verdicts, "", *traces, f"load average at the end: {load_average()}"]
    report(lines, args.output)


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
