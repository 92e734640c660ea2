"""How close the port stays to the authors' PyTorch outputs with oneDNN's products and with the old
path: the worst errors of every quantity tests/test_fidelity.py compares, once with
KERNELS_ONEDNN=0 (OpenBLAS products, im2col convolutions) and once with oneDNN (the default on
x86-64 Linux), each in its own process (the variable is read once per process).

    python bench/fidelity.py [--variants base,refine,two_stage] [--output bench/results/fidelity_cpu.txt]

The reference is tests/fixtures/reference (the authors' code on a CPU, weights rebuilt from its
recipe, tests/reference_weights.py); the model, its outputs, losses and gradients are test_fidelity's
`run`, its layers `layers`, two-stage's queries matched with `query_permutation`, as the tests do.
Per quantity: the largest absolute difference (gradients: relative to the tensor's largest entry, as
the test's atol is; losses: relative), and in brackets the share of the test's allowance that the
worst element uses (|ours - theirs| / (atol + rtol |theirs|); 100% is the edge of failing).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import kernels  # noqa: F401  (first: the BLAS the commands use)
from deformable_detr.errors import ArgumentParser, entry_point

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("base", "refine", "two_stage")
SIDES = {"OpenBLAS (KERNELS_ONEDNN=0)": "0", "oneDNN (default)": None}


def compared(ours, theirs, atol: float, rtol: float, scale: float = 1.0) -> dict:
    """The largest |ours - theirs| / scale, and the largest share of the allowance atol + rtol |theirs|."""
    import numpy as np

    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    difference = np.abs(ours - theirs)
    share = difference / (atol + rtol * np.abs(theirs))
    return {"error": float(difference.max() / scale), "share": float(share.max())}


def approx(value: float, want: float, rel: float, abs_: float) -> dict:
    """pytest.approx(want, rel, abs) of `value`: the relative error, and the share of the allowance
    max(rel |want|, abs)."""
    difference = abs(value - want)
    return {"error": difference / abs(want), "share": difference / max(rel * abs(want), abs_)}


def worst(entries: dict) -> dict:
    """The entry of `entries` ({name: compared(...)}) that uses the most of its allowance, named."""
    name = max(entries, key=lambda k: entries[k]["share"])
    return {**entries[name], "name": name}


def measure(variants: list[str]) -> dict:
    """{row: compared(...)} for each variant's outputs, losses, gradients and detections' scores, in
    this process's setting of KERNELS_ONEDNN."""
    os.environ.setdefault("MLX_ENABLE_TF32", "0")  # as tests/conftest.py: full float32 products
    sys.path.insert(0, str(ROOT / "tests"))
    from deformable_detr import post_process

    import numpy as np
    from reference_weights import manifest
    from test_fidelity import IMAGE_SIZES, OUTPUT_TOLERANCE, layers, query_permutation, run

    rows = {}
    for variant in variants:
        start = time.perf_counter()
        out, losses, total, grads, ref = run(variant)
        perm = None
        if variant == "two_stage":
            try:
                perm = query_permutation(out, ref)
                moved = int((perm != np.arange(perm.shape[1])).sum())
                rows[f"{variant}: queries reordered by near-ties (of {perm.size})"] = {"count": moved}
            except AssertionError as error:
                rows[f"{variant}: query matching"] = {"failed": str(error)}
        for name, ours, theirs in layers(out, ref):
            if perm is not None and not name.startswith("enc."):
                ours = np.stack([ours[b][perm[b]] for b in range(len(ours))])
            rows[f"{variant}: {name}"] = compared(ours, theirs, OUTPUT_TOLERANCE["atol"], OUTPUT_TOLERANCE["rtol"])
        info = manifest()["variants"][variant]
        terms = {key: approx(losses[key].item(), want, 1e-3, 1e-6) for key, want in info["losses"].items()}
        rows[f"{variant}: losses, worst of {len(terms)} terms (relative)"] = worst(terms)
        rows[f"{variant}: total loss (relative)"] = approx(total.item(), info["total_loss"], 1e-3, 1e-12)
        names = [k.removeprefix("grad.") for k in ref if k.startswith("grad.")]
        rows[f"{variant}: attention gradients, worst of {len(names)} (of the tensor's largest)"] = worst(
            {
                name: compared(grads[name], ref["grad." + name], 1e-3 * scale, 1e-3, scale=scale)
                for name in names
                for scale in [float(np.abs(ref["grad." + name]).max())]
            }
        )
        for i, detections in enumerate(post_process(out, IMAGE_SIZES)):
            rows[f"{variant}: post-processed scores, image {i}"] = compared(
                np.array(detections["scores"]), ref[f"post{i}.scores"], 1e-6, 1e-4
            )
        print(f"{variant}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return {"rows": rows, "onednn": kernels.onednn.describe(), "blas": kernels.blas.description()}


def cell(entry: dict | None) -> str:
    if entry is None:
        return "-"
    if "count" in entry:
        return str(entry["count"])
    if "failed" in entry:
        return f"failed: {entry['failed']}"
    name = f", {entry['name']}" if "name" in entry else ""
    return f"{entry['error']:.2e} ({entry['share']:.1%}{name})"


TOLERANCES = {  # the test's allowance for each kind of row
    "queries": "near-ties < 1e-5",
    "query matching": "one to one",
    "losses": "rel 1e-3, abs 1e-6",
    "total loss": "rel 1e-3",
    "gradients": "1e-3 of the largest + rel 1e-3",
    "scores": "rtol 1e-4, atol 1e-6",
    "pred_": "rtol 1e-4, atol 1e-4",
}


def tolerance(row: str) -> str:
    return next(value for key, value in TOLERANCES.items() if key in row)


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="of " + ", ".join(VARIANTS))
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "fidelity_cpu.txt")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        parser.error(f"--variants: unknown {', '.join(unknown)}; expected of {', '.join(VARIANTS)}")
    if args.measure:
        print(json.dumps(measure(variants)))
        return

    import mlx.core as mx

    results = {}
    for side, value in SIDES.items():
        switch = kernels.settings.ONEDNN
        env = {k: v for k, v in os.environ.items() if k not in (switch.name, switch.old)}
        if value is not None:
            env[switch.name] = value
        command = [sys.executable, __file__, "--measure", "--variants", args.variants]
        print(f"{side} ...", file=sys.stderr, flush=True)
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True)
        if done.returncode:
            sys.exit(f"error: the {side} side failed (exit status {done.returncode})")
        results[side] = json.loads(done.stdout.strip().splitlines()[-1])

    lines = [
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU: {cpu_model(count=True)}; "
        f"bfloat16 instructions: {', '.join(kernels.onednn.bfloat16_instructions()) or 'none'}",
        f"mlx {mx.__version__}; oneDNN here: {kernels.onednn.describe()}; "
        + "; ".join(f"{side}: {r['onednn']}, BLAS {r['blas']}" for side, r in results.items()),
        "against tests/fixtures/reference (the authors' PyTorch model on a CPU, float32), as tests/test_fidelity.py;",
        "each cell: the largest |ours - theirs| (gradients: over the tensor's largest entry; losses: relative), then",
        "the share of the test's allowance atol + rtol |theirs| the worst element uses (100%: failing), and which term",
        "",
        "| quantity | " + " | ".join(SIDES) + " | test's tolerance |",
        "| --- | " + " | ".join("---:" for _ in SIDES) + " | --- |",
    ]
    rows = dict.fromkeys(row for r in results.values() for row in r["rows"])
    for row in rows:
        cells = [cell(results[side]["rows"].get(row)) for side in SIDES]
        lines.append(f"| {row} | " + " | ".join(cells) + f" | {tolerance(row)} |")
    report(lines, args.output)


if __name__ == "__main__":
    main()
