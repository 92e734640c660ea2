"""What the benchmark scripts share: the timing rule, measuring in a process of its own, image sizes
as arguments, writing the report, the charts (pillow only)."""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from PIL import Image, ImageDraw

COLORS = [(238, 119, 51), (0, 119, 187), (0, 153, 136), (204, 51, 17), (51, 187, 238), (238, 51, 119)]
RESULTS = Path(__file__).resolve().parent / "results"


def cpu_model(count: bool = False) -> str:
    """The processor's name as Linux reports it (with `count`, "name x N" for its N logical CPUs), or
    the platform's word for it elsewhere."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    if not names:
        return platform.processor() or platform.machine()
    return f"{names[0]} x {len(names)}" if count else names[0]


def cpu_features() -> str:
    """The CPU's bfloat16 and matrix features as /proc/cpuinfo names them (what makes its products fast), or none."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "flags unknown"
    found = [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags.split()]
    return "flags " + (", ".join(found) if found else "without avx512_bf16 or amx")


# What makes a newer x86 CPU compute as an older one does, for each library (bench/README.md#reproduce):
# oneDNN's kernels (ours and PyTorch's), OpenBLAS's and our attention kernel's (ours), ATen's vector
# code and MKL's (PyTorch's).
AS_AVX2 = {
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "KERNELS_ATTENTION_ISA": "1",
    "OPENBLAS_CORETYPE": "Haswell",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def instruction_caps() -> str:
    """ ", as AVX2: ONEDNN_MAX_CPU_ISA=AVX2, ..." for those of AS_AVX2's variables set here, or ""."""
    caps = [f"{name}={os.environ[name]}" for name in AS_AVX2 if os.environ.get(name)]
    return f" (instruction sets capped: {', '.join(caps)})" if caps else ""


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as the reports print them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def sides_header() -> list[str]:
    """The first lines of an ours-against-MLX's-ops report: when, on which CPU at what load, MLX, the
    BLAS and the threads. MLX and kernels are imported here, by then loaded by the script."""
    import kernels

    import mlx.core as mx

    return [
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU: {cpu_model(count=True)}; "
        f"load average at start: {load_average()}",
        f"mlx {mx.__version__}, BLAS {kernels.blas.description()}, threads {kernels.cpu.threads()}",
        "",
    ]


def sides_lines(title: str, times: dict, agreement: str) -> list[str]:
    """The lines of an alternating comparison of "ours" and "MLX's ops" (`times`: side -> seconds of
    each round): the title, each side's median and rounds, the ratio, then `agreement`."""
    ours, theirs = (statistics.median(times[side]) for side in ("ours", "MLX's ops"))
    lines = [title]
    for side, seconds in (("ours", ours), ("MLX's ops", theirs)):
        lines.append(f"- {side}: {seconds:.3f} s (each round: {', '.join(f'{t:.2f}' for t in times[side])})")
    return lines + [f"- ratio MLX's ops / ours: {theirs / ours:.2f}; {agreement}"]


def bench_parser(doc: str, size: str, output: str, repeats: int, image: str = "the images", repeats_help=None):
    """A benchmark's parser with the arguments they share: --size HxW of `image`, --repeats, --output (default
    bench/results/`output`); its description, the first paragraph of `doc`. (deformable_detr: imported here, after
    the script's own first import of it, which sets up MLX's BLAS.)"""
    from deformable_detr.errors import ArgumentParser

    parser = ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--size", type=image_sizes, default=size, help=f"HxW of {image}")
    parser.add_argument("--repeats", type=int, default=repeats, help=repeats_help)
    parser.add_argument("--output", type=Path, default=RESULTS / output)
    return parser


def sides_report(args, timed, what: str, outputs: str, pairs: list) -> str:
    """An ours-against-MLX's-ops report, printed and written to args.output: sides_header; the alternating
    comparison `timed(size, repeats)` -> (times, whether the `outputs` are bit for bit the same) at args.size and
    args.repeats, titled `what`; then each of `pairs`, (title, (their label, ours), timing() -> (theirs, ours,
    the same)): a blank line, the title, each way's median in ms, the ratio and whether they agree; last, the load
    average."""
    lines, size = sides_header(), args.size[0]
    times, same = timed(size, args.repeats)
    title = f"{what}, {size[0]}x{size[1]} ({args.repeats} alternating rounds, median):"
    lines += sides_lines(title, times, f"{outputs} bit for bit the same: {same}")
    for title, (theirs_label, ours_label), timing in pairs:
        theirs, ours, same = timing()
        lines += [
            "",
            title,
            f"{theirs_label} {theirs * 1e3:.1f} ms; {ours_label} {ours * 1e3:.1f} ms (ratio {theirs / ours:.2f}); "
            f"bit for bit the same: {same}",
        ]
    lines.append(f"\nload average at the end: {load_average()}")
    return report(lines, args.output)


def wall_times(run, repeats: int) -> list:
    """The wall time of each of `repeats` calls, after one warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def median_time(run, repeats: int) -> float:
    """Median wall time of `repeats` calls after one warm-up call."""
    return statistics.median(wall_times(run, repeats))


def measured(command: list, env: dict, what: str) -> dict:
    """Run a measuring process (its peak memory its own) and return the JSON of its last line; a
    failure stops the script with the process's error."""
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"error: {what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(lines: list, path: Path) -> str:
    """Print the report and write it to `path`."""
    text = "\n".join(lines)
    print(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    return text


def image_sizes(text: str) -> list[tuple[int, int]]:
    """An argument of sizes, `HxW[,HxW...]` -> [(H, W), ...]."""
    try:
        sizes = [tuple(int(side) for side in size.split("x")) for size in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(len(size) != 2 or min(size) <= 0 for size in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: expected sizes HxW such as 512x683, comma-separated")
    return sizes


def count_at_least(least: int, what: str, why: str = ""):
    """An argument's type: a whole number of `what`, at least `least` (`why` says why, where given)."""

    def count(text: str) -> int:
        if not text.isdigit() or int(text) < least:
            reason = f" ({why})" if why else ""
            raise argparse.ArgumentTypeError(f"{text!r}: expected a number of {what}, at least {least}{reason}")
        return int(text)

    return count


def bars(title: str, groups: list[tuple[str, list[tuple[str, float]]]], path, unit: str = "s"):
    """groups: [(group label, [(bar label, value), ...]), ...]; one colour per bar position."""
    per_group = max(len(bars) for _, bars in groups)
    bar, gap, left = 26, 6, 230
    group_height = per_group * (bar + gap) + 30
    width, height = 900, 60 + group_height * len(groups)
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((20, 18), title, fill="black")
    longest = max(value for _, bars in groups for _, value in bars) or 1.0
    for g, (label, values) in enumerate(groups):
        top = 55 + g * group_height
        draw.text((20, top + (per_group * (bar + gap)) // 2 - 6), label, fill="black")
        for i, (name, value) in enumerate(values):
            y = top + i * (bar + gap)
            length = max(1, int((width - left - 260) * value / longest))
            draw.rectangle([left, y, left + length, y + bar], fill=COLORS[i % len(COLORS)])
            draw.text((left + length + 8, y + 8), f"{name}: {value:.3g} {unit}", fill="black")
    image.save(path)
