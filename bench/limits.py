"""How far from this machine's limit: its ceilings, and each workload's lower bound beside its measured time.

    python bench/limits.py [--repeats 5] [--big-repeats 2] [--train-size 512x683]
                           [--output bench/results/limits_cpu.txt]

Ceilings, measured in this run: the FMA peak (one core, all cores), load bandwidth at working sets
that fit L1 and L2 and at the attention's per-thread working set, STREAM's copy and triad on all
cores over arrays far beyond the last-level cache, random 128-byte row gathers (bench/limits.c,
compiled here with `cc -O2 -march=native -fopenmp`: AVX-512 where the compiler targets it, else
AVX2); the BLAS's sgemm rate through MLX (`mx.matmul`, the BLAS deformable_detr sets up) at 4096^2
and at the R50 backbone's convolutions as products (im2col shapes at 800 x 1066, bench/conv.py).

Workloads: the attention core (`kernels.ms_deform_attn`, backend cpu, bench/attention.py's encoder
shape and points, uniform and encoder-like), forward and forward + backward (`mx.vjp` from a given
output gradient), and as a diagnostic the encoder-like points folded into each level's first 4 x 4
pixels (the same arithmetic with every tap row in L1: what is left when memory costs nothing); R50
inference (batch 1, 800 x 1066, bench/model.py's setup) and one training step (batch 2 at
--train-size, checkpointing off). For each, the work it must do is counted from the
shapes (the formulas are printed): bytes that must move and FLOPs, each term at the rate that
applies, the bound their maximum, beside the median measured time: ratio = measured / bound (1 would
be at the machine's limit).
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from math import prod
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import deformable_detr  # noqa: E402, F401  (first: it loads the BLAS MLX then calls, and sets glibc's malloc)
import kernels  # noqa: E402
from deformable_detr.errors import ArgumentParser, entry_point  # noqa: E402

import mlx.core as mx  # noqa: E402
from attention import ENCODER, inputs  # noqa: E402
from common import cpu_model, image_sizes, load_average, median_time, report  # noqa: E402
from conv import SHAPES as CONV_SHAPES  # noqa: E402
from counts import CoresHad, attention_work, count_work  # noqa: E402

C_FLAGS = ["-O2", "-march=native", "-fopenmp"]
MiB = 2**20


def compile_ceilings(directory: Path) -> Path:
    """bench/limits.c built for this CPU; a failure stops the script with the compiler's message."""
    binary = directory / "limits"
    done = subprocess.run(
        ["cc", *C_FLAGS, str(ROOT / "bench" / "limits.c"), "-o", str(binary)], capture_output=True, text=True
    )
    if done.returncode:
        sys.exit(f"error: bench/limits.c: cc {' '.join(C_FLAGS)} failed:\n{done.stderr[-2000:]}")
    return binary


def ceiling(binary: Path, *arguments) -> dict:
    done = subprocess.run([str(binary), *map(str, arguments)], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"error: bench/limits.c {' '.join(map(str, arguments))}: {done.stderr.strip()}")
    return json.loads(done.stdout)


def machine_ceilings(binary: Path, threads: int, head_bytes: int) -> dict:
    """GFLOP/s and GB/s; `head_bytes`: one attention head's value (the kernel goes head by head)."""
    c = {"fma_1": ceiling(binary, "fma", 1)["gflops"], "fma_all": ceiling(binary, "fma", threads)["gflops"]}
    c["isa"] = ceiling(binary, "fma", 1)["isa"]
    for name, size in (("l1", 16 * 1024), ("l2", MiB)):
        c[f"read_{name}_1"] = ceiling(binary, "read", size, 1)["gbs"]
        c[f"read_{name}_all"] = ceiling(binary, "read", size, threads)["gbs"]
    c["read_head_all"] = ceiling(binary, "read", head_bytes, threads)["gbs"]
    c["update_head_all"] = ceiling(binary, "update", 2 * head_bytes, threads)["gbs"]
    c["gather_head_all"] = ceiling(binary, "gather", head_bytes, 128, threads)["gbs"]
    c["read_dram_all"] = ceiling(binary, "read", 256 * MiB, threads)["gbs"]
    stream = ceiling(binary, "stream", 256 * MiB, threads)
    c["copy"], c["triad"] = stream["copy_gbs"], stream["triad_gbs"]
    return c


def sgemm_rate(m: int, k: int, n: int, repeats: int) -> float:
    """GFLOP/s of an (m, k) x (k, n) float32 product through MLX."""
    a, b = mx.random.normal((m, k)), mx.random.normal((k, n))
    mx.eval(a, b)
    return 2 * m * k * n / median_time(lambda: mx.eval(a @ b), repeats) / 1e9


def sgemm_rates(repeats: int) -> dict:
    """(m, k, n) -> GFLOP/s: 4096^2, and the backbone's convolutions as products at 800 x 1066."""
    shapes = [(4096, 4096, 4096)]
    for c_in, c_out, k, s, h, w in CONV_SHAPES:
        out_h, out_w = (h + 2 * (k // 2) - k) // s + 1, (w + 2 * (k // 2) - k) // s + 1
        shapes.append((out_h * out_w, c_in * k * k, c_out))
    return {
        shape: sgemm_rate(*shape, repeats=repeats if shape[0] != 4096 else max(2, repeats // 2)) for shape in shapes
    }


def bound(terms: list) -> tuple:
    """terms: [(name, seconds)] -> (seconds, name) of the largest."""
    name, seconds = max(terms, key=lambda term: term[1])
    return seconds, name


def core_times(shapes, arrays, repeats) -> tuple[float, float]:
    """Median seconds of the attention core's forward, and of its forward and backward from a given
    output gradient (`mx.vjp`): the work the bound counts, without attention.py's loss around it (a
    product with the cotangent and its sum, then their VJP: three more passes over the output)."""
    value, locations, weights = (mx.array(a) for a in arrays)
    cotangent = mx.ones((value.shape[0], locations.shape[1], value.shape[2] * value.shape[3]))

    def core(v, locs, w):
        return kernels.ms_deform_attn(v, shapes, None, locs, w, backend="cpu")

    forward = median_time(lambda: mx.eval(core(value, locations, weights)), repeats)
    both = median_time(lambda: mx.eval(mx.vjp(core, [value, locations, weights], [cotangent])), repeats)
    return forward, both


# attention.py's point distributions timed here, and their names in the table ("l1": the encoder-like
# points' arithmetic with every row in L1, against the encoder-like bound)
POINTS = {"uniform": "uniform", "encoder": "encoder-like", "l1": "encoder-like, rows in L1 (diagnostic)"}


def attention_times(repeats: int) -> dict:
    """(points, forward + backward?) -> (work, median seconds, cores had) of the attention core, backend cpu."""
    times = {}
    for where in POINTS:
        arrays = inputs(**ENCODER, where=where)
        with CoresHad() as had:
            seconds = core_times(ENCODER["shapes"], arrays, repeats)
        for both, median in zip((False, True), seconds, strict=True):
            times[where, both] = attention_work(arrays[0].shape, arrays[1].shape, both), median, had.cores
    return times


def attention_rows(ceilings: dict, times: dict) -> tuple[list, list]:
    """Table rows and the printed counts for the attention core, every point distribution."""
    rows, notes = [], []
    for (where, both), (work, seconds, cores) in times.items():
        taps_rate = (
            (ceilings["update_head_all"] if both else ceilings["read_head_all"])
            if where == "uniform"
            else ceilings["read_l1_all"]
        )
        level = "a head's value, all cores" if where == "uniform" else "L1, all cores"
        terms = [
            (f"tap rows at {level}", work["tap_bytes"] / taps_rate / 1e9),
            ("FMA peak", work["flop"] / ceilings["fma_all"] / 1e9),
            ("compulsory bytes at triad", work["bytes"] / ceilings["triad"] / 1e9),
        ]
        seconds_bound, which = bound(terms)
        name = f"attention, {POINTS[where]}, {'fwd+bwd' if both else 'fwd'}"
        text = f"{work['flop'] / 1e9:.2f} GFLOP, {work['tap_bytes'] / 1e9:.2f} GB taps, {work['bytes'] / 1e9:.3f} GB"
        rows.append((name, text, seconds_bound, which, seconds, cores))
        if where == "uniform":  # the same counts for every distribution
            notes.append(f"attention, {'fwd+bwd' if both else 'fwd'} (either points): {work['formula']}")
    return rows, notes


def r50_times(size, train_size, repeats, big_repeats) -> dict:
    """task -> (image size, work, median seconds, cores had): R50 inference and a training step."""
    return {
        task: (image_size, *count_work(task, image_size, big_repeats if task == "train" else repeats))
        for task, image_size in (("inference", size), ("train", train_size))
    }


def r50_rows(ceilings, rates, times) -> tuple[list, list]:
    """R50 inference and a training step: counted in one forward, timed after."""
    rows, notes = [], []
    sgemm = rates[(4096, 4096, 4096)]
    narrow = {shape: rate for shape, rate in rates.items() if shape != (4096, 4096, 4096)}
    # the backbone's products at their own rates: their FLOPs over the sum of their times
    narrow_rate = sum(2 * prod(s) for s in narrow) / sum(2 * prod(s) / r for s, r in narrow.items())
    for task, (image_size, work, seconds, cores) in times.items():
        compute = work["product_flop"] / sgemm / 1e9 + work["attention_flop"] / ceilings["fma_all"] / 1e9
        terms = [
            ("FLOPs at sgemm 4096^2 (+ attention at FMA peak)", compute),
            ("bytes at triad", work["bytes"] / ceilings["triad"] / 1e9),
        ]
        seconds_bound, which = bound(terms)
        batch = 1 if task == "inference" else 2
        what = "inference" if task == "inference" else "training step"
        name = f"R50 {what}, batch {batch}, {image_size[0]}x{image_size[1]}"
        flop = work["product_flop"] + work["attention_flop"]
        text = f"{flop / 1e9:.1f} GFLOP, {work['bytes'] / 1e9:.2f} GB"
        rows.append((name, text, seconds_bound, which, seconds, cores))
        notes.append(
            f"{name}: {work['formula']}; at the backbone's products' own sgemm rate ({narrow_rate:.1f} GFLOP/s) "
            f"instead of 4096^2's, the FLOPs would take {work['product_flop'] / narrow_rate / 1e9:.2f} s"
        )
    return rows, notes


def header(threads: int) -> list:
    cpu = cpu_model()
    blas_env = {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_")}
    return [
        f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; CPU: {cpu}, {threads} cores used ({os.cpu_count()} online); "
        f"load average at start: {load_average()}",
        f"mlx {mx.__version__} ({mx.default_device()}), BLAS {kernels.blas.description()}, "
        f"OpenBLAS variables: {blas_env or 'none'}; "
        f"bench/limits.c: cc {' '.join(C_FLAGS)}",
    ]


def ceiling_lines(c: dict, rates: dict, head_bytes: int) -> list:
    head = head_bytes / MiB
    lines = [
        "",
        "## Ceilings (best of several trials, before and after the workloads; all cores at least one core's; "
        "GB/s counted as STREAM does, write-allocate reads not counted)",
        "",
        f"- FMA peak ({c['isa']}, register-resident independent chains): {c['fma_1']:.1f} GFLOP/s one core, "
        f"{c['fma_all']:.1f} all cores",
        f"- load bandwidth, 16 KiB a thread (L1): {c['read_l1_1']:.1f} GB/s one core, {c['read_l1_all']:.1f} all cores",
        f"- load bandwidth, 1 MiB a thread (L2): {c['read_l2_1']:.1f} GB/s one core, {c['read_l2_all']:.1f} all cores",
        f"- load bandwidth, {head:.2f} MiB a thread (one attention head's value): {c['read_head_all']:.1f} GB/s all "
        f"cores; y += a x over twice that (value and its gradient): {c['update_head_all']:.1f} GB/s; "
        f"random 128-byte rows from it: {c['gather_head_all']:.1f} GB/s",
        f"- memory (256 MiB arrays, beyond the last-level cache), all cores: read {c['read_dram_all']:.1f} GB/s, "
        f"copy {c['copy']:.1f}, triad {c['triad']:.1f}",
        "- sgemm through MLX (m x k x n: GFLOP/s): "
        + ", ".join(f"{m}x{k}x{n}: {r:.1f}" for (m, k, n), r in rates.items()),
    ]
    return lines


def table(rows: list, threads: int) -> list:
    """`cores had` (of `threads`): the process's CPU time over the wall time while measured; the last
    column scales the bound by the cores missing, as if the ceilings were linear in the cores (FMA and
    L1 are; memory is less): an estimate of the ratio on a machine the workload had to itself."""
    lines = [
        "",
        "## Workloads",
        "",
        f"| workload | work | bound (s) | which | measured (s) | ratio | cores had (of {threads}) | ratio, bound "
        "for the cores had |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, work, seconds_bound, which, seconds, cores in rows:
        ratio, had = seconds / seconds_bound, min(cores, threads) / threads
        lines.append(
            f"| {name} | {work} | {seconds_bound:.4f} | {which} | {seconds:.4f} | {ratio:.1f} | {cores:.2f} "
            f"| {ratio * had:.1f} |"
        )
    return lines


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of the small workloads (median)")
    parser.add_argument("--big-repeats", type=int, default=2, help="timed runs of the training step (median)")
    parser.add_argument("--train-size", type=image_sizes, default="512x683", help="HxW of the training step's images")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "limits_cpu.txt")
    args = parser.parse_args(argv)
    threads = len(os.sched_getaffinity(0))
    lines = header(threads)
    batch, heads, channels = ENCODER["batch"], ENCODER["heads"], ENCODER["channels"]
    head_bytes = sum(h * w for h, w in ENCODER["shapes"]) * channels * 4
    with tempfile.TemporaryDirectory() as directory:
        binary = compile_ceilings(Path(directory))
        first = machine_ceilings(binary, threads, head_bytes)
        rates = sgemm_rates(args.repeats)
        # the workloads' times are measured after the ceilings, the ceilings again after them: a machine
        # shared with other work reaches its ceilings in its quieter moments, so the higher of the two
        measured = {"attention": attention_times(args.repeats)}
        measured["r50"] = r50_times((800, 1066), args.train_size[0], 3, args.big_repeats)
        last = machine_ceilings(binary, threads, head_bytes)
        again = sgemm_rates(args.repeats)
        rates = {shape: max(rate, again[shape]) for shape, rate in rates.items()}
    ceilings = {k: v if k == "isa" else max(v, last[k]) for k, v in first.items()}
    for name in ("fma", "read_l1", "read_l2"):  # all cores reach at least what one does (the others idle)
        ceilings[f"{name}_all"] = max(ceilings[f"{name}_all"], ceilings[f"{name}_1"])
    lines += ceiling_lines(ceilings, rates, head_bytes)
    rows, notes = attention_rows(ceilings, measured["attention"])
    more_rows, more_notes = r50_rows(ceilings, rates, measured["r50"])
    lines += table(rows + more_rows, threads)
    lines += ["", "## Counts", ""] + [f"- {note}" for note in notes + more_notes]
    lines.append(f"\nload average at the end: {load_average()}; batch {batch}, {heads} heads")
    report(lines, args.output)


if __name__ == "__main__":
    main()
