"""Where an R50 inference's time goes: ours by category (the products, the fused one-pass passes, the
attention core, the rest) against OpenVINO's own per-layer profile (PERF_COUNT) of our ONNX file, in one run.

    python bench/inference_profile.py [--repeats 3] [--threads N] [--ours-root DIR [--ours-root DIR2]]
                                      [--no-grid-sample] [--output PATH]

configs/r50.yaml with random weights (seed 0), batch 1 at 800 x 1066 (bench/model.py's `ours_setup`), at float32
and, where bfloat16 products are fast here (kernels.bfloat16_products), with bfloat16 products (the forward inside
`kernels.onednn.products_in(mx.bfloat16, kernels.onednn.kept_weights())`, as model.py and a Detector run it).

Ours: the kernels' entry points are wrapped at module attribute level (every caller looks them up as
`kernels.onednn.conv2d(...)`, `kernels.layer_norm(...)`, ...; kernels.linear calls `onednn.linear` the same way).
Each wrapper evaluates its array inputs (the lazy work that makes them is MLX's, the rest), starts a clock, calls,
evaluates the result and stops; a wrapped call inside another (kernels.linear's onednn.linear) is taken out of the
outer's time, so each second is counted once. Categories:
- products: kernels.onednn.conv2d and kernels.onednn.linear, whatever post-ops they carry (calls oneDNN declines,
  returning None, are counted apart: the caller's own product is then in the rest);
- fused one-pass passes: the native kernels (channel_affine, layer_norm, softmax, masked_scale, relu,
  scale_where_positive, sin_cos, kernels.linear's bias rows where oneDNN did not take the product, patches,
  bernoulli16; and any other function new in kernels.__all__, named in the notes);
- the attention core: kernels.ms_deform_attn (its sampling and weighted sum; the sampling locations and weights
  before it are MLX's ops and kernels.softmax);
- the rest: MLX's own ops, the instrumented forward's total minus the three above.
The un-instrumented forward is timed too (median of --repeats after a warm-up), so that the reader sees what the
syncs cost; the instrumented rounds' breakdown is that of the round with the median total. `--ours-root DIR`
(repeatable) measures ours from another checkout (its package, its built kernels, its bench/model.py's
`ours_setup`), one column per checkout, e.g. a worktree of the commit before a change and this one; default: this
checkout.

OpenVINO: bench/deploy.py's `export` writes our ONNX files (gather and grid_sample samplers); the attention core's
nodes are recorded as they are built: each level's sampling (deformable_detr/deploy/onnx/attention.py's gather_level
or grid_sample_level: the taps, their weights, the Gather or GridSample, the weighted sum), then the levels' sum up to
the output projection (ours' kernel sums the levels too; as in ours, the sampling locations before them are not in
it). Each file is compiled with {"PERF_COUNT": True, "INFERENCE_NUM_THREADS": --threads} at f32 and at its default
(bf16 where the CPU has it); after a warm-up, --repeats inferences, and the `get_profiling_info()` of the one with the
median wall time is summed by category: a node whose original layers (the runtime model's `originalLayersNames`: what
OpenVINO fused into it) include the attention core's -> the attention core; Convolution, FullyConnected, MatMul ->
products; Subgraph (OpenVINO's JIT-fused element-wise chains), MVN (LayerNorm), Softmax -> fused one-pass passes;
the rest (Reorder, Convert, Transpose, Concat, Gather outside the attention, single element-wise ops ...) -> the rest.
Also: its top node types by time, which ops its Convolutions, FullyConnected and MatMuls carry fused, its reorders and
converts, and its wall time per inference with PERF_COUNT and without (a compile of its own). The grid_sample file
(unless --no-grid-sample) is profiled in the notes only, by category.

Each runtime runs in a process of its own (as bench/deploy.py). Writes inference_profile_cpu.txt (--output).
"""

import argparse
import collections
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from common import (  # noqa: E402
    RESULTS,
    cpu_features,
    cpu_model,
    instruction_caps,
    load_average,
    measured,
    report,
    wall_times,
)

CATEGORIES = ("products", "fused one-pass passes", "attention core", "rest")
PRODUCTS = ("conv2d", "linear")  # of kernels.onednn
ATTENTION = ("ms_deform_attn", "grid_sample")  # of kernels
FUSED = (
    "channel_affine",
    "layer_norm",
    "softmax",
    "masked_scale",
    "relu",
    "scale_where_positive",
    "sin_cos",
    "linear",
    "patches",
    "bernoulli16",
)
NOT_OPERATIONS = {  # names of kernels.__all__ that compute nothing an inference runs
    "BACKENDS",
    "available_backends",
    "bfloat16_products",
    "bfloat16_rule",
    "export_mode",
    "exporting",
    "onednn",
    "linear_assignment",
}
OPENVINO_PRODUCTS = {"Convolution", "FullyConnected", "MatMul", "GroupConvolution", "Deconvolution"}
OPENVINO_FUSED = {"Subgraph", "MVN", "Softmax"}
SIZE = (800, 1066)


# ---- ours, in its process -------------------------------------------------------------------------


class Clock:
    """Each wrapped call's own seconds (nested wrapped calls taken out) and count, by category and by entry point."""

    def __init__(self):
        self.nested = []  # per open call: the seconds of the wrapped calls inside it
        self.reset()

    def reset(self):
        self.seconds = collections.Counter()
        self.calls = collections.Counter()
        self.by_name = collections.defaultdict(lambda: [0, 0.0])
        self.declined = collections.Counter()

    def wrap(self, category: str, name: str, function):
        import mlx.core as mx

        def timed(*args, **kwargs):
            inputs = arrays_in((args, kwargs))
            if inputs:
                mx.eval(inputs)
            self.nested.append(0.0)
            start = time.perf_counter()
            result = function(*args, **kwargs)
            outputs = arrays_in(result)
            if outputs:
                mx.eval(outputs)
            elapsed = time.perf_counter() - start
            inner = self.nested.pop()
            if self.nested:
                self.nested[-1] += elapsed
            own = elapsed - inner
            self.seconds[category] += own
            if result is None:  # oneDNN declined: the caller computes it its own way
                self.declined[name] += 1
            elif outputs and inner == 0.0:  # a call that did its own work (not only a wrapped one's)
                self.calls[category] += 1
                self.by_name[name][0] += 1
            self.by_name[name][1] += own
            return result

        timed.__wrapped__ = function
        return timed


def arrays_in(value) -> list:
    import mlx.core as mx

    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for item in value for a in arrays_in(item)]
    if isinstance(value, dict):
        return [a for item in value.values() for a in arrays_in(item)]
    return []


def entry_points(kernels) -> tuple[list, list]:
    """[(module, attribute, category, name)] to wrap, and the new names of kernels.__all__ wrapped as fused passes."""
    import inspect

    points = [(kernels.onednn, name, "products", f"onednn.{name}") for name in PRODUCTS]
    points += [(kernels, name, "attention core", name) for name in ATTENTION if hasattr(kernels, name)]
    points += [(kernels, name, "fused one-pass passes", name) for name in FUSED if hasattr(kernels, name)]
    known = set(PRODUCTS) | set(ATTENTION) | set(FUSED) | NOT_OPERATIONS
    new = [
        name
        for name in getattr(kernels, "__all__", [])
        if name not in known and inspect.isfunction(getattr(kernels, name, None))
    ]
    points += [(kernels, name, "fused one-pass passes", name) for name in new]
    return points, new


def measure_ours(root: Path, repeats: int) -> dict:
    """Ours from checkout `root`, in this process: per precision, the plain forward's median and the instrumented
    forward's breakdown."""
    sys.path[:0] = [str(root), str(root / "bench")]
    import kernels  # noqa: F401  (first: it sets up the BLAS under MLX)

    import mlx.core as mx
    import model as bench_model  # root's bench/model.py

    if not Path(kernels.__file__).resolve().is_relative_to(root.resolve()):
        raise SystemExit(f"error: kernels imported from {kernels.__file__}, not from {root}")
    fast, why = kernels.bfloat16_products()
    _, model, _, images, mask, _ = bench_model.ours_setup("inference", SIZE)
    x, m = mx.array(images), mx.array(mask)
    clock = Clock()
    points, new = entry_points(kernels)
    result = {
        "root": str(root),
        "commit": commit_of(root),
        "onednn": kernels.onednn.describe(),
        "bfloat16": [fast, why],
        "new_entry_points": new,
        "versions": f"mlx {mx.__version__}, attention backend {kernels.available_backends()[-1]}, "
        f"BLAS {kernels.blas.description()}",
        "precisions": {},
    }
    for precision in ("float32", "bfloat16") if fast else ("float32",):
        dtype, kept = getattr(mx, precision), kernels.onednn.kept_weights()

        def forward(dtype=dtype, kept=kept):
            with kernels.onednn.products_in(dtype, kept):
                mx.eval(model(x, m))

        plain = wall_times(forward, repeats)
        originals = [(module, name, getattr(module, name)) for module, name, _, _ in points]
        for module, name, category, label in points:
            setattr(module, name, clock.wrap(category, label, getattr(module, name)))
        try:
            clock.reset()
            forward()  # warm-up
            instrumented = []
            for _ in range(repeats):
                clock.reset()
                start = time.perf_counter()
                forward()
                total = time.perf_counter() - start
                instrumented.append(
                    {
                        "total": total,
                        "seconds": dict(clock.seconds),
                        "calls": dict(clock.calls),
                        "by_name": {k: list(v) for k, v in clock.by_name.items() if v[0] or v[1] > 1e-4},
                        "declined": dict(clock.declined),
                    }
                )
        finally:
            for module, name, original in originals:
                setattr(module, name, original)
        chosen = sorted(instrumented, key=lambda r: r["total"])[len(instrumented) // 2]
        chosen["seconds"]["rest"] = chosen["total"] - sum(chosen["seconds"].values())
        chosen["plain"] = statistics.median(plain)
        chosen["plain_rounds"] = plain
        chosen["instrumented_rounds"] = [r["total"] for r in instrumented]
        result["precisions"][precision] = chosen
    return result


def commit_of(root: Path) -> str:
    """The checkout's short commit, "+ changes" where its tracked files differ from it."""
    git = ["git", "-C", str(root)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD"], capture_output=True).returncode
    return (head or "no git") + (" + changes" if dirty else "")


# ---- the ONNX files and OpenVINO, in their processes ----------------------------------------------------


def export_tagged(directory: Path) -> dict:
    """bench/deploy.py's export, the attention core's nodes recorded per sampler (the names of their outputs, which
    OpenVINO's layers take as names) with every node's op type, in <file>.nodes.json: each level's sampling, then
    the levels' sum and its reshapes up to the output projection (ours' kernel sums the levels too)."""
    from deformable_detr.deploy.onnx import attention, detector, transformer

    import deploy

    tagged = {"gather": [], "grid_sample": []}
    types = {"gather": {}, "grid_sample": {}}
    last = {}  # the node count after the latest level's sampling

    def names(nodes) -> list:
        return [name for node in nodes for name in node.output]

    def recording(sampler, function):
        def recorded(g, *args, **kwargs):
            first = len(g.nodes)
            out = function(g, *args, **kwargs)
            tagged[sampler] += names(g.nodes[first:])
            last["end"] = len(g.nodes)
            return out

        return recorded

    def deformable_attention(g, *args, **kwargs):
        out = original_attention(g, *args, **kwargs)
        sizes = kwargs.get("sizes", args[-1])
        tagged[sizes.sampler] += names(g.nodes[last["end"] : len(g.nodes) - 2])  # the output projection: 2 nodes
        return out

    attention.gather_level = recording("gather", attention.gather_level)
    attention.grid_sample_level = recording("grid_sample", attention.grid_sample_level)
    original_attention = transformer.deformable_attention  # the encoder's and decoder's caller takes it from there
    transformer.deformable_attention = deformable_attention

    original_build = detector.build_graph

    def build_recording(weights, cfg, size, sampler="gather", **kwargs):
        graph = original_build(weights, cfg, size, sampler=sampler, **kwargs)
        types[sampler] = {name: node.op_type for node in graph.graph.node for name in node.output}
        return graph

    detector.build_graph = build_recording
    result = deploy.export(directory)
    for sampler in tagged:
        path = directory / f"r50_{sampler}.nodes.json"
        path.write_text(json.dumps({"attention": tagged[sampler], "types": types[sampler]}))
    return result


def base_name(layer: str) -> str:
    """An OpenVINO layer's ONNX node output name: "conv_53/WithoutBiases" -> "conv_53"."""
    return layer.split("/", 1)[0]


def openvino_category(layer_type: str, originals: list, attention: set) -> str:
    if any(base_name(name) in attention for name in originals):
        return "attention core"
    if layer_type in OPENVINO_PRODUCTS:
        return "products"
    if layer_type in OPENVINO_FUSED:
        return "fused one-pass passes"
    return "rest"


def measure_openvino(path: Path, repeats: int, threads: int, precision: str) -> dict:
    """OpenVINO's CPU plugin on `path` with PERF_COUNT, at f32 or its default; per repeat its profile by category;
    the round with the median wall time kept, with its node types, fusions, reorders and converts."""
    import deploy
    import openvino

    nodes = json.loads(path.with_suffix(".nodes.json").read_text())
    attention, onnx_types = set(nodes["attention"]), nodes["types"]
    core = openvino.Core()
    walls = {}
    for counting in (False, True):
        config = {"PERF_COUNT": counting, "INFERENCE_NUM_THREADS": threads}
        if precision == "f32":
            config["INFERENCE_PRECISION_HINT"] = "f32"
        compiled = core.compile_model(str(path), "CPU", config)
        request = compiled.create_infer_request()
        inputs = deploy.random_inputs(compiled.input("pixel_values").shape)
        request.infer(inputs)  # warm-up
        profiles = []
        for _ in range(repeats):
            start = time.perf_counter()
            request.infer(inputs)
            wall = time.perf_counter() - start
            profiles.append((wall, request.get_profiling_info() if counting else None))
        walls[counting] = [wall for wall, _ in profiles]
    wall, profile = sorted(profiles, key=lambda p: p[0])[len(profiles) // 2]
    runtime = {
        op.get_friendly_name(): {key: str(value.value) for key, value in op.get_rt_info().items()}
        for op in compiled.get_runtime_model().get_ordered_ops()
    }

    def info(name, key):
        return runtime.get(name, {}).get(key)

    seconds, calls = collections.Counter(), collections.Counter()
    by_type = collections.defaultdict(lambda: [0, 0.0, collections.Counter()])
    fusions = collections.defaultdict(collections.Counter)
    precisions = collections.defaultdict(collections.Counter)
    reorders, converts = [], []
    mixed = 0
    for entry in profile:
        if str(entry.status) != "Status.EXECUTED":
            continue
        real = entry.real_time.total_seconds()
        originals = (info(entry.node_name, "originalLayersNames") or entry.node_name).split(",")
        category = openvino_category(entry.node_type, originals, attention)
        others = [n for n in originals if base_name(n) in onnx_types and base_name(n) not in attention]
        if category == "attention core" and others:  # OpenVINO's own nodes (not in the file) aside
            mixed += 1
        seconds[category] += real
        calls[category] += 1
        kind = by_type[entry.node_type]
        kind[0] += 1
        kind[1] += real
        kind[2][entry.exec_type] += 1
        if entry.node_type in OPENVINO_PRODUCTS:
            own = base_name(entry.node_name)
            fused = sorted(
                {onnx_types.get(base_name(n), f"its own {n.split('_')[0]}") for n in originals if base_name(n) != own}
            )
            fusions[entry.node_type]["+".join(fused) or "nothing"] += 1
            precisions[entry.node_type][info(entry.node_name, "outputPrecisions") or "?"] += 1
        if entry.node_type == "Reorder":
            reorders.append((entry.node_name, real))
        if entry.node_type == "Convert":
            converts.append((entry.node_name, real, info(entry.node_name, "outputPrecisions")))
    return {
        "wall": wall,
        "walls_counting": walls[True],
        "walls_plain": walls[False],
        "plain": statistics.median(walls[False]),
        "profile_total": sum(seconds.values()),
        "seconds": dict(seconds),
        "calls": dict(calls),
        "by_type": {k: [v[0], v[1], dict(v[2])] for k, v in by_type.items()},
        "fusions": {k: dict(v) for k, v in fusions.items()},
        "output_precisions": {k: dict(v) for k, v in precisions.items()},
        "reorders": sorted(reorders, key=lambda r: -r[1]),
        "converts": sorted(converts, key=lambda r: -r[1]),
        "mixed_attention_layers": mixed,
        "precision": compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name(),
        "bf16": "BF16" in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"),
        "version": f"OpenVINO {openvino.__version__.split('-')[0]} (CPU plugin)",
    }


# ---- the report -----------------------------------------------------------------------------------------


def child(arguments: list, env: dict, what: str) -> dict:
    return measured([sys.executable, "-X", "faulthandler", __file__, *arguments], env, what)  # a crash shows where


def ours_env(root: Path) -> dict:
    """Ours' process: its package first on the path; glibc's malloc as it sets it itself on import."""
    from deformable_detr import runtime

    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", *runtime.MALLOC)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return env


def openvino_env() -> dict:
    from deformable_detr import runtime

    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", *runtime.MALLOC)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return runtime.malloc_environment(env)


def cell(seconds: float | None, total: float | None, calls: int | None = None) -> str:
    if seconds is None:
        return "-"
    share = f", {100 * seconds / total:.0f}%" if total else ""
    count = f" ({calls})" if calls is not None else ""
    return f"{seconds:.3f}{share}{count}"


def main_table(ours: list, openvino: dict) -> list:
    """category | ours f32 (each checkout) | OpenVINO f32 | ours bf16 (each) | OpenVINO bf16: s, % (calls)."""
    columns = []
    for precision, ov_precision in (("float32", "f32"), ("bfloat16", "default")):
        for run in ours:
            label = f"ours {precision}"
            if len(ours) > 1:  # which checkout: its directory's name and commit
                label += f" ({Path(run['root']).resolve().name} {run['commit']})"
            columns.append((label, run["precisions"].get(precision), "ours"))
        ov = openvino.get(ov_precision)
        columns.append((f"OpenVINO {ov['precision'] if ov else ov_precision}", ov, "openvino"))
    lines = ["| category | " + " | ".join(label for label, _, _ in columns) + " |"]
    lines.append("| --- |" + " ---: |" * len(columns))
    for category in CATEGORIES:
        row = [category]
        for _, data, side in columns:
            if data is None:
                row.append("-")
                continue
            total = data["total"] if side == "ours" else data["profile_total"]
            calls = None if category == "rest" and side == "ours" else data["calls"].get(category, 0)
            row.append(cell(data["seconds"].get(category, 0.0), total, calls))
        lines.append("| " + " | ".join(row) + " |")
    for title, key in (("sum of the categories (ours: the instrumented total)", "sum"), ("wall, as deployed", "plain")):
        row = [title]
        for _, data, side in columns:
            if data is None:
                row.append("-")
            elif key == "sum":
                row.append(f"{data['total'] if side == 'ours' else data['profile_total']:.3f}")
            else:
                row.append(f"{data['plain']:.3f}")
        lines.append("| " + " | ".join(row) + " |")
    row = ["wall with the instrumentation (ours: syncs; OpenVINO: PERF_COUNT)"]
    row += ["-" if d is None else f"{d['total'] if s == 'ours' else d['wall']:.3f}" for _, d, s in columns]
    lines.append("| " + " | ".join(row) + " |")
    return lines


def ours_notes(run: dict) -> list:
    lines = [f"ours at {run['root']} ({run['commit']}): {run['versions']}; oneDNN: {run['onednn']}"]
    if not run["bfloat16"][0]:
        lines.append(f"- bfloat16 not measured: {run['bfloat16'][1]}")
    if run["new_entry_points"]:
        lines.append(f"- new in kernels.__all__, counted as fused passes: {', '.join(run['new_entry_points'])}")
    for precision, data in run["precisions"].items():
        parts = sorted(data["by_name"].items(), key=lambda item: -item[1][1])
        entries = ", ".join(f"{name} {calls} calls {seconds:.3f} s" for name, (calls, seconds) in parts)
        entries += (
            " (0 calls: only what it did around a wrapped call inside it)"
            if any(not c for c, _ in dict(parts).values())
            else ""
        )
        lines.append(
            f"- {precision}: plain forward {data['plain']:.3f} s (rounds {fmt(data['plain_rounds'])}), instrumented "
            f"{data['total']:.3f} s (rounds {fmt(data['instrumented_rounds'])}): the syncs cost "
            f"{data['total'] - data['plain']:+.3f} s; by entry point: {entries}"
        )
        if data["declined"]:
            declined = ", ".join(f"{name} {count}" for name, count in data["declined"].items())
            lines.append(f"  oneDNN declined (their products in the rest): {declined}")
    return lines


def openvino_notes(name: str, data: dict, top: int = 10) -> list:
    kinds = sorted(data["by_type"].items(), key=lambda item: -item[1][1])[:top]
    lines = [
        f"OpenVINO {data['precision']} ({name}): wall {data['plain']:.3f} s without PERF_COUNT (rounds "
        f"{fmt(data['walls_plain'])}), {data['wall']:.3f} s with it (rounds {fmt(data['walls_counting'])}); its "
        f"profile sums to {data['profile_total']:.3f} s",
        "- top node types: "
        + "; ".join(
            f"{kind} {seconds:.3f} s, {count} nodes ({', '.join(f'{e} {n}' for e, n in execs.items())})"
            for kind, (count, seconds, execs) in kinds
        ),
    ]
    for kind, signatures in data["fusions"].items():
        fused = ", ".join(f"{s} {n}" for s, n in sorted(signatures.items(), key=lambda item: -item[1]))
        outputs = ", ".join(f"{p} {n}" for p, n in data["output_precisions"][kind].items())
        lines.append(f"- {kind}: what each carries fused: {fused}; their outputs: {outputs}")
    reorders, converts = data["reorders"], data["converts"]
    lines.append(
        f"- Reorders: {len(reorders)} nodes, {sum(r[1] for r in reorders):.3f} s"
        + (f" (largest: {', '.join(f'{n} {s * 1e3:.1f} ms' for n, s in reorders[:3])})" if reorders else "")
        + f"; Converts: {len(converts)} nodes, {sum(c[1] for c in converts):.3f} s"
        + (f" (largest: {', '.join(f'{n} to {p} {s * 1e3:.1f} ms' for n, s, p in converts[:3])})" if converts else "")
    )
    if data["mixed_attention_layers"]:
        lines.append(
            f"- {data['mixed_attention_layers']} layers fuse the attention's sampling with nodes around it: counted "
            "in the attention core"
        )
    return lines


def fmt(values: list) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def run_all(args) -> list:
    roots = args.ours_root or [ROOT]
    ours = [
        child(["--measure-ours", str(root), "--repeats", str(args.repeats)], ours_env(root), "ours") for root in roots
    ]
    for run in ours:
        print(f"ours {run['commit']}: " + ", ".join(f"{p} {d['plain']:.2f} s" for p, d in run["precisions"].items()))
    openvino, grid = {}, {}
    with tempfile.TemporaryDirectory() as directory:
        exported = child(["--export-to", directory], openvino_env(), "the export")
        for precision in ("f32", "default"):
            for sampler in ("gather", "grid_sample") if not args.no_grid_sample else ("gather",):
                path = Path(directory) / f"r50_{sampler}.onnx"
                command = ["--measure-openvino", str(path), "--precision", precision]
                data = child(
                    command + ["--repeats", str(args.repeats), "--threads", str(args.threads)],
                    openvino_env(),
                    f"OpenVINO {precision} {sampler}",
                )
                (openvino if sampler == "gather" else grid)[precision] = data
                print(f"OpenVINO {data['precision']} {sampler}: {data['plain']:.2f} s", flush=True)
            if precision == "f32" and not openvino["f32"]["bf16"]:
                break  # its default is f32 here
    default_note = []
    if "default" not in openvino:
        default_note = ["OpenVINO's default precision is f32 on this CPU (no bf16 instructions): its f32 column"]
    lines = [
        f"R50 Deformable DETR inference, batch 1, {SIZE[0]} x {SIZE[1]}, random weights (configs/r50.yaml, seed 0): "
        "where the time goes, ours against OpenVINO's per-layer profile (PERF_COUNT) of our ONNX file (gather sampler)",
        f"CPU: {cpu_model(count=True)} ({cpu_features()}){instruction_caps()}; OpenVINO on {args.threads} threads, "
        f"ours on every core; {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}; python "
        f"{platform.python_version()}; {openvino['f32']['version']}; export: {exported['versions']}",
        f"each side in its own process; median of {args.repeats} after a warm-up (the breakdowns: the round with the "
        f"median total); load average at start {args.load_before}, at the end {load_average()} on {os.cpu_count()} "
        "cores (other work shared them: the times are noisy)",
        "cells: seconds, % of the column's total (ours: its instrumented forward; OpenVINO: its profile's sum), "
        "(calls: ours' entry-point calls, OpenVINO's executed nodes)",
        "",
        *main_table(ours, openvino),
        "",
        *default_note,
    ]
    for run in ours:
        lines += ours_notes(run)
    for data in openvino.values():
        lines += openvino_notes("gather sampler", data)
    for data in grid.values():
        seconds, total = data["seconds"], data["profile_total"]
        lines.append(
            f"OpenVINO {data['precision']}, grid_sample sampler: wall {data['plain']:.3f} s; its profile's "
            f"{total:.3f} s: "
            + ", ".join(f"{c} {seconds.get(c, 0.0):.3f} ({100 * seconds.get(c, 0.0) / total:.0f}%)" for c in CATEGORIES)
        )
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="OpenVINO's threads")
    parser.add_argument("--ours-root", type=Path, action="append", help="a checkout to measure ours from (repeatable)")
    parser.add_argument("--no-grid-sample", action="store_true", help="without the grid_sample file's profile")
    parser.add_argument("--output", type=Path, default=RESULTS / "inference_profile_cpu.txt")
    parser.add_argument("--measure-ours", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--measure-openvino", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--precision", choices=("f32", "default"), default="f32", help=argparse.SUPPRESS)
    parser.add_argument("--export-to", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_ours:
        print(json.dumps(measure_ours(args.measure_ours, args.repeats)))
    elif args.measure_openvino:
        print(json.dumps(measure_openvino(args.measure_openvino, args.repeats, args.threads, args.precision)))
    elif args.export_to:
        sys.path[:0] = [str(ROOT)]
        print(json.dumps(export_tagged(Path(args.export_to))))
    else:
        args.load_before = load_average()
        sys.path[:0] = [str(ROOT)]
        report(run_all(args), args.output)


if __name__ == "__main__":
    main()
