"""R50 Deformable DETR inference on the CPU where a model is deployed, in one run: this port (MLX)
in float32 and bfloat16, its .mlxfn file in plain MLX, onnxruntime and OpenVINO (f32, bf16) on this
port's exported ONNX file, and PyTorch (Hugging Face's model) in float32 and under autocast bfloat16.

    python bench/deploy.py [--repeats 3] [--threads N] [--output-dir DIR] [--mlx-only | --no-mlxfn]

configs/r50.yaml with random weights, batch 1 at 800 x 1066 (the authors' evaluation size). Ours
and PyTorch are measured by bench/model.py's own processes (its inference rows, the same code):
`ours (MLX, float32)` and `ours (MLX, bfloat16)` (the forward inside
`kernels.onednn.products_in(mx.bfloat16)`, as `--precision bfloat16` predicts), `(default)` on the
one `--precision auto` picks on this machine (bfloat16 where its products are fast: AMX or AVX512-BF16
through oneDNN), the row the others' ratios are against; `PyTorch (float32)` and `PyTorch (autocast
bfloat16)` (the forward under `torch.autocast("cpu", dtype=torch.bfloat16)`, a user's fastest PyTorch
there). Where bfloat16 products are not fast (kernels.bfloat16_products: AVX2, AVX-512 without BF16),
both bfloat16 rows are skipped, the header saying why: they would be slower than float32, not faster
(PyTorch's autocast took 130 s an image on a Zen 2). The header names the CPU and any instruction-set
caps (bench/common.py's AS_AVX2). onnxruntime runs the file
`export --to onnx --size 800 1066` writes (the canvas the image fills), once with each sampler
(gather, the default; grid_sample), on all `--threads` cores (intra_op_num_threads) with its
default graph optimisations, as a CPU server would run it. OpenVINO (where installed) runs the same
files as they are in its CPU plugin on `--threads` threads (INFERENCE_NUM_THREADS), at f32 and,
where the CPU has bfloat16 instructions, at its default precision there (bf16), with the largest
difference of its logits and boxes from its f32 ones; the notes under the table also compare
OpenVINO at f32 with onnxruntime on the same input. The .mlxfn file (`export --to mlx --size 800
1066`) runs in a Python process that imports only mlx (`mx.import_function`, MLX's own BLAS and ops:
none of this package's CPU kernels; float32), as mlx-c or mlx-swift would run it; `--mlx-only`
measures ours and that file only. Each row runs in its own process and reports its median over
`--repeats` after a warm-up and its peak resident memory; the export runs in a process of its own
first and is timed.
Writes `deploy_cpu.txt` to --output-dir (default bench/results).
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import resource
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
# the measuring processes (bench/model.py's too) import this checkout's package, installed or not
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
import kernels  # noqa: E402
from deformable_detr.errors import ArgumentParser, entry_point  # noqa: E402

from common import cpu_model, instruction_caps, measured, median_time, report  # noqa: E402
from model import PRECISIONS, SIZE, TORCH_LABELS, run_side  # noqa: E402

SAMPLERS = ("gather", "grid_sample")


def export(directory: Path) -> dict:
    """configs/r50.yaml, random weights (MLX's initialisation, seed 0) -> r50_<sampler>.onnx for
    each sampler, as `export --to onnx` builds them (no onnxruntime check: timed alone)."""
    from deformable_detr import build_model, load_config
    from deformable_detr.deploy.onnx.detector import build_graph

    import mlx.core as mx
    import numpy as np
    import onnx
    from mlx.utils import tree_flatten

    cfg = load_config(ROOT / "configs" / "r50.yaml", ["model.dropout=0.0"])
    mx.random.seed(0)
    weights = {k: np.array(v) for k, v in tree_flatten(build_model(cfg).parameters())}
    seconds = {}
    for sampler in SAMPLERS:
        start = time.perf_counter()
        onnx.save(build_graph(weights, cfg.model, SIZE, sampler=sampler), str(directory / f"r50_{sampler}.onnx"))
        seconds[sampler] = time.perf_counter() - start
    size_mib = (directory / "r50_gather.onnx").stat().st_size / 2**20
    return {"seconds": seconds, "file_mib": size_mib, "versions": f"onnx {onnx.__version__}"}


def export_mlxfn(directory: Path) -> dict:
    """The same model -> r50.mlxfn, as `export --to mlx` traces it (without its check: timed alone)."""
    import kernels
    from deformable_detr import build_model, load_config
    from deformable_detr.deploy.mlxfn import canvas_function, example_inputs

    import mlx.core as mx

    cfg = load_config(ROOT / "configs" / "r50.yaml", ["model.dropout=0.0"])
    mx.random.seed(0)
    model = build_model(cfg)
    model.eval()
    mx.eval(model.parameters())
    start = time.perf_counter()
    with kernels.export_mode():
        mx.export_function(
            str(directory / "r50.mlxfn"), canvas_function(model, False), **example_inputs(SIZE, 1, False)
        )
    seconds = time.perf_counter() - start
    size_mib = (directory / "r50.mlxfn").stat().st_size / 2**20
    return {"seconds": seconds, "file_mib": size_mib, "versions": f"MLX {mx.__version__}"}


# The .mlxfn file's process: only mlx (and the standard library) imported; prints its JSON line.
PLAIN_MLX = """
import json, resource, statistics, sys, time
import mlx.core as mx
function = mx.import_function(sys.argv[1])
key = mx.random.key(0)
h, w = int(sys.argv[3]), int(sys.argv[4])
inputs = {"pixel_values": mx.random.normal((1, 3, h, w), key=key), "pixel_mask": mx.ones((1, h, w), mx.int64)}
times = []
for _ in range(int(sys.argv[2]) + 1):
    start = time.perf_counter()
    mx.eval(function(**inputs))
    times.append(time.perf_counter() - start)
print(json.dumps({"seconds": statistics.median(times[1:]), "versions": f"MLX {mx.__version__} (mx.import_function)",
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run_mlxfn(path: Path, repeats: int) -> dict:
    command = [sys.executable, "-I", "-c", PLAIN_MLX, str(path), str(repeats), *map(str, SIZE)]
    return measured(command, dict(os.environ), path.name)


def random_inputs(shape) -> dict:
    """An ONNX file's inputs for its pixel_values shape (N, 3, H, W): seeded noise, no padding; the
    same in every runtime's process, so that their saved outputs compare."""
    import numpy as np

    n, _, h, w = shape
    rng = np.random.default_rng(0)
    return {
        "pixel_values": rng.standard_normal((n, 3, h, w)).astype(np.float32),
        "pixel_mask": np.ones((n, h, w), np.int64),
    }


def outputs_path(path: Path, runtime: str) -> Path:
    """Where a runtime's process leaves its logits and boxes on `path`, for the notes' comparisons."""
    return path.with_name(f"{path.stem}.{runtime}.npz")


def measure_onnxruntime(path: Path, repeats: int, threads: int) -> dict:
    import numpy as np
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    inputs = random_inputs(session.get_inputs()[0].shape)
    seconds = median_time(lambda: session.run(None, inputs), repeats)
    logits, boxes = session.run(["logits", "pred_boxes"], inputs)
    np.savez(outputs_path(path, "onnxruntime"), logits=logits, pred_boxes=boxes)
    return {"seconds": seconds, "versions": f"onnxruntime {onnxruntime.__version__} (CPUExecutionProvider)"}


def measure_openvino(path: Path, repeats: int, threads: int, precision: str) -> dict:
    """OpenVINO's CPU plugin on the file as written, at f32 or (precision "default") at the precision
    it picks for this CPU: bf16 where the CPU has bfloat16 instructions. Its other settings are its
    defaults (PERFORMANCE_HINT LATENCY), as a server's single-image requests would run."""
    import numpy as np
    import openvino

    core = openvino.Core()
    config = {"INFERENCE_NUM_THREADS": threads}
    if precision == "f32":
        config["INFERENCE_PRECISION_HINT"] = "f32"
    compiled = core.compile_model(str(path), "CPU", config)
    request = compiled.create_infer_request()
    inputs = random_inputs(compiled.input("pixel_values").shape)
    seconds = median_time(lambda: request.infer(inputs), repeats)
    results = request.infer(inputs)
    np.savez(outputs_path(path, f"openvino_{precision}"), logits=results["logits"], pred_boxes=results["pred_boxes"])
    return {
        "seconds": seconds,
        "versions": f"OpenVINO {openvino.__version__.split('-')[0]} (CPU plugin)",
        "precision": compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name(),
        "bf16": "BF16" in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"),
    }


# --measure's runtimes: each runs in a process of this script's own (run_runtime)
MEASURES = {
    "onnxruntime": measure_onnxruntime,
    "openvino_f32": partial(measure_openvino, precision="f32"),
    "openvino_default": partial(measure_openvino, precision="default"),
}


def run_runtime(path: Path, runtime: str, repeats: int, threads: int) -> dict:
    """A runtime of MEASURES on the file in its own process, glibc's malloc set as our commands set it
    (as model.py does PyTorch's)."""
    from deformable_detr import runtime as our_runtime

    variables = ("LD_PRELOAD", *our_runtime.MALLOC)
    env = our_runtime.malloc_environment({k: v for k, v in os.environ.items() if k not in variables})
    command = [sys.executable, __file__, "--measure", str(path), "--runtime", runtime]
    command += ["--repeats", str(repeats), "--threads", str(threads)]
    return measured(command, env, f"{runtime} on {path.name}")


def difference(path: Path, runtime: str, reference: str) -> str:
    """The largest |difference| of two runtimes' saved logits and boxes on `path`, and the largest
    |value| of the reference's, as the notes print them."""
    import numpy as np

    outputs, expected = np.load(outputs_path(path, runtime)), np.load(outputs_path(path, reference))
    return ", ".join(
        f"{name} {np.abs(outputs[key] - expected[key]).max():.2g} (largest |value| {np.abs(expected[key]).max():.2g})"
        for name, key in (("logits", "logits"), ("boxes", "pred_boxes"))
    )


def openvino_rows(directory: Path, args, notes: list) -> list:
    """OpenVINO's rows on both samplers' files: f32, then its default precision where the CPU has
    bf16 instructions; the notes say how far each is from its reference, or why a row is missing."""
    if importlib.util.find_spec("openvino") is None:
        notes.append("OpenVINO: not measured: openvino is not installed (pip install openvino)")
        return []
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):  # its CPU plugin picks kernels by the CPU's own flags
        notes.append(
            f"OpenVINO: not measured: its CPU plugin crashes under ONEDNN_MAX_CPU_ISA="
            f"{os.environ['ONEDNN_MAX_CPU_ISA']} on a CPU with more (tests/test_openvino.py); on a real CPU of that "
            "kind it runs"
        )
        return []
    files = {sampler: directory / f"r50_{sampler}.onnx" for sampler in SAMPLERS}
    rows = []
    for sampler, path in files.items():
        result = run_runtime(path, "openvino_f32", args.repeats, args.threads)
        rows.append((f"OpenVINO (f32), our ONNX file ({sampler} sampler)", result))
        notes.append(f"OpenVINO f32 against onnxruntime, {sampler}: {difference(path, 'openvino_f32', 'onnxruntime')}")
    if not rows[0][1]["bf16"]:  # OpenVINO's OPTIMIZATION_CAPABILITIES: its default is then f32, the rows above
        notes.append("OpenVINO's default precision: f32 on this CPU (no bf16 instructions), measured above")
        return rows
    for sampler, path in files.items():
        result = run_runtime(path, "openvino_default", args.repeats, args.threads)
        rows.append((f"OpenVINO (its default, {result['precision']}), our ONNX file ({sampler} sampler)", result))
        against = difference(path, "openvino_default", "openvino_f32")
        notes.append(f"OpenVINO {result['precision']} against its f32, {sampler}: {against}")
    return rows


def table(rows: list, ours: float) -> list:
    lines = ["| runtime | s / image | its time / ours (default) (> 1: slower than ours) | peak RSS MiB |"]
    lines.append("| --- | ---: | ---: | ---: |")
    for name, result in rows:
        lines.append(
            f"| {name} | {result['seconds']:.2f} | {result['seconds'] / ours:.2f} | {result['peak_rss_mib']:.0f} |"
        )
    return lines


def ours_rows(args) -> list:
    """Ours in float32 and with bfloat16 products, in bench/model.py's processes; `(default)` on the
    one `--precision auto` picks (as ours' process says)."""
    runs = {p: run_side("ours", "inference", args.repeats, SIZE, args.threads, precision=p) for p in args.precisions}
    default = runs["float32"]["auto"][0]
    return [(f"ours (MLX, {p})" + (" (default)" if p == default else ""), result) for p, result in runs.items()]


def measure_rows(directory: Path, args, notes: list) -> tuple:
    """-> ([(runtime, its measurement)], the exports' lines), ours first; `notes` gets the lines
    under the table."""
    rows, exports = ours_rows(args), []
    if args.no_mlxfn:  # plain MLX on this CPU takes minutes an image
        exports.append("export --to mlx: not measured (--no-mlxfn)")
    else:
        exported = measured([sys.executable, __file__, "--export-mlxfn-to", str(directory)], dict(os.environ), "export")
        exports.append(
            f"export --to mlx: {exported['versions']}, {exported['file_mib']:.0f} MiB file, traced and written in "
            f"{exported['seconds']:.1f} s"
        )
        rows.append(("MLX on our .mlxfn file (plain mlx)", run_mlxfn(directory / "r50.mlxfn", args.repeats)))
    if args.mlx_only:
        return rows, exports
    exported = measured([sys.executable, __file__, "--export-to", str(directory)], dict(os.environ), "the export")
    exports.append(
        f"export --to onnx: {exported['versions']}, {exported['file_mib']:.0f} MiB file, built and written in "
        + ", ".join(f"{s:.1f} s ({sampler})" for sampler, s in exported["seconds"].items())
    )
    for sampler in SAMPLERS:
        result = run_runtime(directory / f"r50_{sampler}.onnx", "onnxruntime", args.repeats, args.threads)
        rows.append((f"onnxruntime, our ONNX file ({sampler} sampler)", result))
    rows += openvino_rows(directory, args, notes)
    for precision, label in TORCH_LABELS.items():
        if precision in args.precisions:
            rows.append((label, run_side("torch", "inference", args.repeats, SIZE, args.threads, precision=precision)))
    return rows, exports


def child_result(args) -> dict:
    """What a measuring or exporting process of this script prints: its result and its peak RSS."""
    if args.measure:
        result = MEASURES[args.runtime](args.measure, args.repeats, args.threads)
    else:
        result = export(args.export_to) if args.export_to else export_mlxfn(args.export_mlxfn_to)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--output-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # an ONNX file: a runtime's process
    parser.add_argument("--runtime", choices=MEASURES, default="onnxruntime", help=argparse.SUPPRESS)
    parser.add_argument("--export-to", type=Path, help=argparse.SUPPRESS)  # the export's process
    parser.add_argument("--export-mlxfn-to", type=Path, help=argparse.SUPPRESS)  # the .mlxfn export's process
    parser.add_argument("--mlx-only", action="store_true", help="ours and the .mlxfn file only")
    parser.add_argument("--no-mlxfn", action="store_true", help="without the .mlxfn file (minutes an image here)")
    args = parser.parse_args(argv)
    if args.measure or args.export_to or args.export_mlxfn_to:
        print(json.dumps(child_result(args)))
        return

    load_before, notes = os.getloadavg()[0], []
    # bfloat16 rows only where its products are fast (PyTorch's autocast needs the same instructions)
    fast, why = kernels.bfloat16_products()
    args.precisions = PRECISIONS if fast else ("float32",)
    with tempfile.TemporaryDirectory() as directory:
        rows, exports = measure_rows(Path(directory), args, notes)
    versions = sorted({f"{name.split(' (')[0]}: {result['versions']}" for name, result in rows})
    default = next(result for name, result in rows if name.endswith("(default)"))
    lines = [
        f"R50 Deformable DETR inference, batch 1, {SIZE[0]} x {SIZE[1]}, random weights (configs/r50.yaml)",
        f"CPU: {cpu_model()}{instruction_caps()}; bfloat16 products {'fast' if fast else 'not fast'}: {why}"
        + ("" if fast else " (the bfloat16 rows, PyTorch's and ours, skipped)")
        + f"; {args.threads} threads for each side; {datetime.date.today().isoformat()}; "
        f"python {platform.python_version()}",
        *versions,
        f"`--precision auto` picks {default['auto'][0]} here ({default['auto'][1]}): ours' default",
        *exports,
        f"median of {args.repeats} after a warm-up, each side in its own process; load average (1 min) "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} cores (above {args.threads}: "
        "other work shared the cores, and the times are noisy)",
        "",
        *table(rows, default["seconds"]),
        *([""] + notes if notes else []),
    ]
    report(lines, args.output_dir / "deploy_cpu.txt")


if __name__ == "__main__":
    main()
