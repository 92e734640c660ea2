"""MLX's own element-wise passes left in an R50 inference and training step: how many the graph holds, of which
kind, and what they cost, against the whole (issue 75: each one over 1% of the total fused or put on every core).

    python bench/elementwise_passes.py [--seconds 12] [--output bench/results/elementwise_passes_cpu.txt]

configs/r50.yaml on seeded random images (bench/model.py's setup): inference at 800 x 1066, batch 1, float32
and bfloat16 products (inside `kernels.onednn.products_in`, as `--precision` runs it); a training step at
512 x 683, batch 2, train.precision float32 and bfloat16. For each, in a process of its own:
- the count: the primitives of the evaluated graph (`mx.export_to_dot` of the outputs, or of the loss and
  the gradients), by kind; MLX's element-wise kinds (Add, Multiply, Select, AsType ...) apart from this
  package's one-pass kernels and oneDNN's products. A count, not a size: most of them are on a few hundred
  queries' boxes.
- the cost: `perf record` (software clock, this process's threads) while it repeats the work for
  `--seconds`; the samples in libmlx.so's operations by kind (the element-wise loops are templates named
  by their operation: binary_op<.., Add>, copy_vector<bf16, float> ...) as milliseconds of one core per
  iteration and as % of an iteration's wall time (MLX's CPU operations run on one thread: their core time
  is their wall time). Where perf is missing, the counts only.
"""

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
from deformable_detr.errors import ArgumentParser, entry_point  # noqa: E402

from common import cpu_features, cpu_model, load_average, report  # noqa: E402

CASES = {  # name: (task, size, precision)
    "inference float32": ("inference", (800, 1066), "float32"),
    "inference bfloat16": ("inference", (800, 1066), "bfloat16"),
    "training float32": ("train", (512, 683), "float32"),
    "training bfloat16": ("train", (512, 683), "bfloat16"),
}
ELEMENTWISE = {
    "Abs", "Add", "AsType", "Ceil", "Cos", "Divide", "Equal", "Exp", "Floor", "Greater", "GreaterEqual", "Less",
    "LessEqual", "Log", "LogicalAnd", "LogicalNot", "LogicalOr", "Maximum", "Minimum", "Multiply", "Negative",
    "NotEqual", "Power", "Rsqrt", "Select", "Sigmoid", "Sin", "Sqrt", "Square", "Subtract", "Tanh", "Copy",
    "Broadcast", "Contiguous",
}  # fmt: skip
# libmlx.so's symbols -> an operation's kind: binary_op<float, float, detail::Add>, copy_vector<bf16, float>,
# ternary_op<bool, bf16, bf16, bf16, detail::Select>, reduction_op<float, float, SumReduce> ...
KINDS = (
    (re.compile(r"detail::(\w+)"), lambda m: m.group(1)),
    (re.compile(r"copy_(\w+?)<([^,>]+), ([^,>]+)>"), lambda m: "copy" if m.group(2) == m.group(3) else "AsType"),
    (re.compile(r"(\w+)Reduce"), lambda m: f"{m.group(1)} (reduction)"),
    (re.compile(r"softmax"), lambda m: "Softmax (MLX's)"),
    (re.compile(r"simd::(\w+)"), lambda m: m.group(1)),
)


def kind_of(symbol: str) -> str:
    for pattern, name in KINDS:
        match = pattern.search(symbol)
        if match:
            return name(match)
    return "other"


def setup(name):
    """The case's work as a function of no arguments, and what to count in its graph."""
    import kernels
    from deformable_detr.models.precision import DTYPES

    import mlx.core as mx
    from model import ours_setup

    task, size, precision = CASES[name]
    _, model, trainer, images, mask, targets = ours_setup(task, size, precision=precision)
    if task == "inference":
        x, m = mx.array(images), mx.array(mask)
        kept = kernels.onednn.kept_weights()

        def forward():
            with kernels.onednn.products_in(DTYPES[precision], kept):
                outputs = model(x, m)
            return [outputs["pred_logits"], outputs["pred_boxes"]]

        return (lambda: mx.eval(forward())), forward
    batch = [(images, mask, targets)]

    def graph():  # a micro-batch's loss and gradients, as Trainer.step's value_and_grad builds them
        from mlx.utils import tree_flatten

        num_boxes = trainer.num_boxes(targets)
        (total, _), grads = trainer.loss_and_grad(mx.array(images), mx.array(mask), targets, num_boxes, (0, 0, 0))
        return [total, *(g for _, g in tree_flatten(grads))]

    return (lambda: trainer.step(batch)), graph


def count(outputs_of) -> collections.Counter:
    import mlx.core as mx

    outputs = outputs_of()
    if not outputs:
        return collections.Counter()
    with tempfile.NamedTemporaryFile(suffix=".dot") as dot:
        mx.export_to_dot(dot.name, *outputs)
        return collections.Counter(re.findall(r'label ="(\w+)"', Path(dot.name).read_text()))


def child(name: str, seconds: float, ready: Path) -> None:
    """The measured process: counts, then repeats the case for `seconds` (perf records it meanwhile)."""
    import json

    run, outputs_of = setup(name)
    counts = count(outputs_of)
    for _ in range(2):
        run()
    ready.write_text(str(os.getpid()))
    start, iterations = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        run()
        iterations += 1
    wall = (time.perf_counter() - start) / iterations
    print(json.dumps({"counts": counts, "iterations": iterations, "wall": wall}))


def measure(name: str, seconds: float) -> dict:
    import json

    with tempfile.TemporaryDirectory() as directory:
        ready, data = Path(directory) / "ready", Path(directory) / "perf.data"
        command = [sys.executable, __file__, "--child", name, "--seconds", str(seconds), "--ready", str(ready)]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        while not ready.exists() and process.poll() is None:
            time.sleep(0.2)
        samples, frequency = {}, 499
        if shutil.which("perf") and process.poll() is None:
            record = ["perf", "record", "-F", str(frequency), "-p", ready.read_text(), "-o", str(data)]
            subprocess.run([*record, "--", "sleep", str(seconds - 1)], capture_output=True)
            lines = subprocess.run(
                ["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,sym", "-g", "none", "-n",
                 "--stdio"], capture_output=True, text=True,
            ).stdout.splitlines()  # fmt: skip
            samples = parse(lines)
        result = json.loads(process.communicate()[0].strip().splitlines()[-1])
    result["samples"], result["frequency"], result["recorded"] = samples, frequency, seconds - 1
    return result


def parse(lines: list) -> dict:
    """perf report's rows -> {(dso, kind): samples} over libmlx.so's kinds, and {dso: samples} for the others."""
    samples = collections.Counter()
    for line in lines:
        match = re.match(r"\s*[\d.]+%\s+(\d+)\s+(.+?)\s+\[[.k]\]\s+(.*)", line)  # "[JIT] tid 123": oneDNN's code
        if not match:
            continue
        count_, dso, symbol = int(match.group(1)), match.group(2), match.group(3)
        dso = "oneDNN's JIT code" if dso.startswith("[JIT]") else dso
        samples[("libmlx.so", kind_of(symbol)) if dso == "libmlx.so" else (dso, "")] += count_
    return samples


def lines_for(name: str, result: dict) -> list:
    counts, wall = collections.Counter(result["counts"]), result["wall"]
    elementwise = {k: v for k, v in counts.items() if k in ELEMENTWISE}
    ours = {k: v for k, v in counts.items() if k.startswith("Kernels") or k == "MSDeformAttn"}
    lines = [
        f"## {name}: {wall:.3f} s an iteration ({result['iterations']} in the recording)",
        f"graph: {sum(counts.values())} primitives; MLX element-wise {sum(elementwise.values())} ("
        + ", ".join(f"{k} {v}" for k, v in sorted(elementwise.items(), key=lambda kv: -kv[1]))
        + f"); this package's {sum(ours.values())} ("
        + ", ".join(f"{k.removeprefix('Kernels')} {v}" for k, v in sorted(ours.items(), key=lambda kv: -kv[1]))
        + ")",
    ]
    samples = result["samples"]
    if not samples:
        return [*lines, "cost: not measured (perf is not installed)", ""]
    per_iteration = 1000 / result["frequency"] / (result["recorded"] / wall)  # ms of one core per sample, per iteration
    total = sum(samples.values())
    lines += ["", "| where | ms of one core / iteration | % of the iteration's wall time |", "| --- | ---: | ---: |"]
    libraries = collections.Counter()
    for (dso, _), n in samples.items():
        libraries[dso] += n
    for dso, n in libraries.most_common(6):
        lines.append(f"| {dso} (all) | {n * per_iteration:.1f} | {100 * n * per_iteration / 1000 / wall:.1f} |")
    mlx = sorted(((k, n) for (d, k), n in samples.items() if d == "libmlx.so"), key=lambda kn: -kn[1])
    for kind, n in mlx[:12]:
        share = 100 * n * per_iteration / 1000 / wall
        over = " **over 1%**" if share > 1 else ""
        lines.append(f"| libmlx.so: {kind} | {n * per_iteration:.1f} | {share:.1f}{over} |")
    lines.append(f"({total} samples at {result['frequency']} Hz over {result['recorded']} s)")
    return [*lines, ""]


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=12)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "elementwise_passes_cpu.txt")
    parser.add_argument("--child", choices=CASES, help="==SUPPRESS==")
    parser.add_argument("--ready", type=Path, help="==SUPPRESS==")
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.seconds, args.ready)
        return
    lines = [
        f"MLX's element-wise passes left, R50 (configs/r50.yaml, random weights); CPU: {cpu_model(count=True)} "
        f"({cpu_features()}); load average at start {load_average()}",
        "",
    ]
    for name in args.cases:
        lines += lines_for(name, measure(name, args.seconds))
    lines.append(f"load average at the end {load_average()}")
    report(lines, args.output)


if __name__ == "__main__":
    main()
