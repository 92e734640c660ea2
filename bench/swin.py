"""The Swin-T backbone (models/swin.py, H-Deformable-DETR's) against this port's ResNet-50 backbone, and
against HDETR's own Swin-T in PyTorch: forward only, batch 1, float32, at 800 x 1066.

    python bench/swin.py [--size 800x1066] [--repeats 5] [--hdetr /work/hdetr] [--output bench/results/swin_cpu.txt]

Ours: `SwinBackbone("swin_tiny")` and `Backbone("resnet50")`, random weights, evaluation mode, on this
machine's cores (the products on oneDNN where it is there); also configs/r50.yaml's whole detector, to
estimate Swin-T's share of a full forward: Swin-T / (detector - R50 backbone + Swin-T), the transformer's
time taken as it is behind R50 (the Swin-T detector's input projections are smaller). PyTorch (with
`--hdetr`, a checkout of HDETR/H-Deformable-DETR): their SwinTransformer as their TransformerBackbone
builds swin_tiny, through tests/make_swin_reference.py's stand-ins for what it imports, `torch.no_grad()`,
as many threads as cores. Each side in its own process; the median of `--repeats` after a warm-up.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from deformable_detr.errors import entry_point  # noqa: E402  (first: it sets up MLX's BLAS)

from common import bench_parser, cpu_model, load_average, measured, median_time, report  # noqa: E402


def measure_mlx(size, repeats):
    import kernels
    from deformable_detr.models.backbone import Backbone
    from deformable_detr.models.swin import SwinBackbone

    import mlx.core as mx

    mx.random.seed(0)
    images, mask = mx.random.normal((1, *size, 3)), mx.zeros((1, *size), dtype=mx.bool_)
    result = {"versions": f"mlx {mx.__version__}, products on {kernels.onednn.describe()}"}
    for name, backbone in (("swin_tiny", SwinBackbone("swin_tiny")), ("resnet50", Backbone("resnet50"))):
        backbone.eval()
        mx.eval(backbone.parameters())
        result[name] = median_time(lambda b=backbone: mx.eval([f for f, _ in b(images, mask)]), repeats)
        del backbone
    try:  # the whole R50 detector, for the share estimate
        from deformable_detr import build_model, load_config

        model = build_model(load_config(ROOT / "configs" / "r50.yaml", ["model.dropout=0.0"]))
        model.eval()
        mx.eval(model.parameters())
        result["detector_r50"] = median_time(lambda: mx.eval(model(images, mask)), repeats)
    except Exception as error:  # noqa: BLE001  (a detector mid-change must not stop the backbones' numbers)
        result["detector_r50_error"] = f"{type(error).__name__}: {error}".splitlines()[0]
    return result


def measure_torch(size, repeats, hdetr: Path):
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from make_swin_reference import install_stand_ins

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    install_stand_ins(hdetr)
    from models.swin_transformer import SwinTransformer

    torch.manual_seed(0)
    body = SwinTransformer(
        embed_dim=96,
        depths=[2, 2, 6, 2],
        num_heads=[3, 6, 12, 24],
        window_size=7,
        drop_path_rate=0.2,
        out_indices=(1, 2, 3),
    )
    body.eval()  # (their train() returns None: no chaining)
    images = torch.randn(1, 3, *size)
    with torch.no_grad():
        seconds = median_time(lambda: body(images), repeats)
    return {"swin_tiny": seconds, "versions": f"torch {torch.__version__}, {torch.get_num_threads()} threads"}


def cpu_line() -> str:
    """lscpu's model name and whether the CPU has AVX512-BF16."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        lscpu = ""
    names = [line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")]
    bf16 = "avx512_bf16" in lscpu
    return f"CPU: {names[0] if names else cpu_model()} x {os.cpu_count()}, avx512_bf16: {'yes' if bf16 else 'no'}"


@entry_point
def main(argv=None):
    parser = bench_parser(__doc__, "800x1066", "swin_cpu.txt", 5, "the image")
    parser.add_argument("--hdetr", type=Path, help="a checkout of HDETR/H-Deformable-DETR: time their Swin-T too")
    parser.add_argument("--measure", choices=["mlx", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    size = args.size[0]
    if args.measure == "mlx":
        print(json.dumps(measure_mlx(size, args.repeats)))
        return
    if args.measure == "torch":
        print(json.dumps(measure_torch(size, args.repeats, args.hdetr.resolve())))
        return

    from deformable_detr.runtime import malloc_environment

    common = ["--size", f"{size[0]}x{size[1]}", "--repeats", str(args.repeats)]
    plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    start = f"load average at start: {load_average()}"
    ours = measured([sys.executable, __file__, "--measure", "mlx", *common], plain, "the MLX side")
    theirs = None
    if args.hdetr:
        command = [sys.executable, __file__, "--measure", "torch", "--hdetr", str(args.hdetr), *common]
        theirs = measured(command, malloc_environment(plain), "the PyTorch side")  # the malloc ours runs on
    lines = [
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cpu_line()}; {start}",
        f"ours: {ours['versions']}" + (f"; PyTorch: {theirs['versions']}" if theirs else ""),
        "",
        f"forward, batch 1, float32, {size[0]} x {size[1]}: seconds, median of {args.repeats} after a warm-up",
        "",
        "| backbone | ours (MLX) | PyTorch (HDETR's code) | PyTorch / ours |",
        "| --- | ---: | ---: | ---: |",
    ]
    if theirs:
        ratio = theirs["swin_tiny"] / ours["swin_tiny"]
        lines.append(f"| Swin-T | {ours['swin_tiny']:.3f} | {theirs['swin_tiny']:.3f} | {ratio:.2f} |")
    else:
        lines.append(f"| Swin-T | {ours['swin_tiny']:.3f} | (no --hdetr) | |")
    lines.append(f"| ResNet-50 | {ours['resnet50']:.3f} | | |")
    lines.append("")
    lines.append(f"Swin-T / ResNet-50 (ours): {ours['swin_tiny'] / ours['resnet50']:.2f}")
    if "detector_r50" in ours:
        with_swin = ours["detector_r50"] - ours["resnet50"] + ours["swin_tiny"]
        lines.append(
            f"R50 detector (configs/r50.yaml) forward: {ours['detector_r50']:.3f} s, the backbone "
            f"{ours['resnet50'] / ours['detector_r50']:.0%} of it; with Swin-T in its place about {with_swin:.2f} s, "
            f"Swin-T about {ours['swin_tiny'] / with_swin:.0%} of it"
        )
    else:
        lines.append(f"(the whole detector was not timed: {ours['detector_r50_error']})")
    lines.append(f"\nload average at the end: {load_average()}")
    report(lines, args.output)


if __name__ == "__main__":
    main()
