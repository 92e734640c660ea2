"""R50 inference and training step, this checkout against another (the one before a change), side by side with
OpenVINO and PyTorch, in one run: what bench/deploy.py and bench/model.py measure, each row in a process of its
own (each checkout's own bench/model.py measures its own code), the two checkouts alternating.

    python bench/before_after.py --before DIR [--rounds 2] [--repeats 3] [--output bench/results/before_after_cpu.txt]

DIR: a checkout with its extensions built (`git worktree add DIR COMMIT`, then its kernels/*.so built from its
own sources). Rows:
- ours, before and after: inference at 800 x 1066, batch 1, float32 and bfloat16 products (`--precision`), and
  a training step at 512 x 683, batch 2, train.precision float32 and bfloat16 (checkpointing off: configs/r50's
  `auto` at this size); each the median over `--rounds` rounds (before, after, before, after ...) of each
  process's median of `--repeats` after a warm-up.
- OpenVINO (where installed) on this checkout's ONNX file of the same model (`export --to onnx`, both samplers),
  at f32 and at its default precision (bf16 on a CPU with bfloat16 instructions): the faster sampler's time.
- PyTorch (Hugging Face's model): float32 and autocast bfloat16, inference and the training step.
The bfloat16 rows run only where bfloat16 products are fast here (kernels.bfloat16_products); the header names the
CPU with its flags. Ratios: OpenVINO's time over ours at the same precision (> 1: ours faster), our bfloat16 step's
speed-up over our float32 one, and the fastest PyTorch step over ours.
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
import kernels  # noqa: E402
from deformable_detr.errors import ArgumentParser, entry_point  # noqa: E402

from common import cpu_features, cpu_model, instruction_caps, load_average, measured, report  # noqa: E402
from deploy import SAMPLERS, run_runtime  # noqa: E402
from model import SIZE, run_side  # noqa: E402

TRAIN_SIZE = (512, 683)
TASKS = {"inference": SIZE, "train": TRAIN_SIZE}


def ours(checkout: Path, task: str, precision: str, repeats: int, threads: int) -> dict:
    """`checkout`'s bench/model.py measuring its own code, in its own process (its package first on the path)."""
    from deformable_detr import runtime

    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", *runtime.MALLOC)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))
    size = TASKS[task]
    command = [sys.executable, str(checkout / "bench" / "model.py"), "--measure", "ours", "--task", task]
    command += ["--repeats", str(repeats), "--threads", str(threads), "--train-size", f"{size[0]}x{size[1]}"]
    command += ["--precision", precision]
    result = measured(command, env, f"{checkout.name} {task} {precision}")
    result["checkout"] = checkout
    return result


def commit_of(checkout: Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "log", "-1", "--format=%h"], capture_output=True, text=True)
    return done.stdout.strip() or "?"


def openvino(precisions, repeats: int, threads: int) -> dict:
    """{precision: (seconds of the faster sampler, which)} of OpenVINO on this checkout's ONNX files."""
    import importlib.util

    if importlib.util.find_spec("openvino") is None:
        return {}
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        export = [sys.executable, str(ROOT / "bench" / "deploy.py"), "--export-to", directory]
        measured(export, dict(os.environ), "the export")
        for precision, runtime in (("float32", "openvino_f32"), ("bfloat16", "openvino_default")):
            if precision not in precisions:
                continue
            times = {s: run_runtime(Path(directory) / f"r50_{s}.onnx", runtime, repeats, threads) for s in SAMPLERS}
            sampler = min(times, key=lambda s: times[s]["seconds"])
            results[precision] = (times[sampler]["seconds"], sampler, times[sampler].get("precision", "f32"))
    return results


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the checkout before the change (built)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "before_after_cpu.txt")
    args = parser.parse_args(argv)
    if not (args.before / "bench" / "model.py").is_file():
        parser.error(f"--before {args.before}: no bench/model.py there (a checkout of this project is expected)")
    start_load = load_average()
    fast, why = kernels.bfloat16_products()
    precisions = ("float32", "bfloat16") if fast else ("float32",)
    checkouts = {"before": args.before.resolve(), "after": ROOT}
    runs = {}  # (side, task, precision) -> [seconds]
    for round_ in range(args.rounds):
        for task in TASKS:
            for precision in precisions:
                for side, checkout in checkouts.items():
                    result = ours(checkout, task, precision, args.repeats, args.threads)
                    runs.setdefault((side, task, precision), []).append(result["seconds"])
                    print(f"round {round_ + 1}: {side} {task} {precision}: {result['seconds']:.3f} s", flush=True)
    theirs = openvino(precisions, args.repeats, args.threads)
    torch = {
        (task, precision): run_side("torch", task, args.repeats, size, args.threads, precision=precision)["seconds"]
        for task, size in TASKS.items()
        for precision in precisions
    }
    ours_median = {key: statistics.median(times) for key, times in runs.items()}

    def said(key):
        return f"{ours_median[key]:.3f} ({', '.join(f'{t:.3f}' for t in runs[key])})"

    lines = [
        f"R50 Deformable DETR (configs/r50.yaml, random weights), this checkout ({commit_of(ROOT)}) against "
        f"{args.before} ({commit_of(args.before)}), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"CPU: {cpu_model(count=True)}{instruction_caps()} ({cpu_features()}); bfloat16 products "
        f"{'fast' if fast else 'not fast'}: {why}; {args.threads} threads each side; load average {start_load} at "
        f"the start, {load_average()} at the end",
        f"ours: the median of {args.rounds} rounds (each a process's median of {args.repeats} after a warm-up), the "
        "rounds in brackets; the others one process each",
        "",
        "Inference, batch 1, 800 x 1066:",
        "",
        "| precision | ours before s | ours after s | after / before | OpenVINO s | OpenVINO / ours after | "
        "PyTorch s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for precision in precisions:
        before, after = ours_median[("before", "inference", precision)], ours_median[("after", "inference", precision)]
        ov = theirs.get(precision)
        ov_cells = f"{ov[0]:.3f} ({ov[2]}, {ov[1]}) | {ov[0] / after:.2f}" if ov else "not measured | "
        lines.append(
            f"| {precision} | {said(('before', 'inference', precision))} | {said(('after', 'inference', precision))} "
            f"| {after / before:.2f} | {ov_cells} | {torch[('inference', precision)]:.3f} |"
        )
    lines += [
        "",
        f"Training step, batch 2, {TRAIN_SIZE[0]} x {TRAIN_SIZE[1]} (PyTorch: bfloat16 is autocast):",
        "",
        "| train.precision | ours before s | ours after s | after / before | PyTorch s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for precision in precisions:
        before, after = ours_median[("before", "train", precision)], ours_median[("after", "train", precision)]
        lines.append(
            f"| {precision} | {said(('before', 'train', precision))} | {said(('after', 'train', precision))} | "
            f"{after / before:.2f} | {torch[('train', precision)]:.3f} |"
        )
    fastest_torch = min(torch[("train", p)] for p in precisions)
    for side in checkouts:
        step = {p: ours_median[(side, "train", p)] for p in precisions}
        line = f"{side}: the fastest PyTorch step / ours float32 {fastest_torch / step['float32']:.2f}x"
        if "bfloat16" in step:
            line += (
                f", / ours bfloat16 {fastest_torch / step['bfloat16']:.2f}x; ours bfloat16 over ours float32 "
                f"{step['float32'] / step['bfloat16']:.2f}x"
            )
        lines.append(line)
    report(lines, args.output)


if __name__ == "__main__":
    main()
