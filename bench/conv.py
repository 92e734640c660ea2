"""MLX's CPU convolution and this port's (`backbone.Conv2d`: matrix products, of patches for k x k) against
PyTorch's on the R50 backbone's shapes at 800 x 1066, and the whole ResNet-50 (this port's backbone
against transformers' ResNet-50, random weights), forward only.

    python bench/conv.py [--repeats 5] [--output bench/results/conv_cpu.txt]

Both sides use this machine's cores (MLX: the preloaded BLAS's GEMM under its im2col convolution, as train.py runs;
PyTorch: oneDNN, as many threads); each side in its own process. The median of `--repeats` after a
warm-up.
"""

import argparse
import json
import os
import sys
from pathlib import Path

from deformable_detr.errors import ArgumentParser, entry_point

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import measured, report  # noqa: E402
from common import median_time as median  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [  # (in channels, out channels, kernel, stride, input height, input width): the backbone's
    (3, 64, 7, 2, 800, 1066),
    (64, 64, 3, 1, 200, 267),
    (64, 256, 1, 1, 200, 267),
    (256, 512, 1, 2, 200, 267),
    (128, 128, 3, 2, 200, 267),
    (128, 128, 3, 1, 100, 134),
    (256, 256, 3, 1, 50, 67),
    (1024, 256, 1, 1, 50, 67),
    (512, 512, 3, 1, 25, 34),
]


def measure_mlx(repeats):
    from deformable_detr import build_model, load_config
    from deformable_detr.models.backbone import Conv2d

    import mlx.core as mx

    result = {}
    for c_in, c_out, k, s, h, w in SHAPES:
        conv = Conv2d(c_in, c_out, k, s, k // 2, bias=False)
        x = mx.random.normal((1, h, w, c_in))
        mx.eval(x, conv.parameters())
        result[str((c_in, c_out, k, s, h, w))] = {
            "mlx": median(
                lambda x=x, conv=conv: mx.eval(mx.conv2d(x, conv.weight, conv.stride, conv.padding)), repeats
            ),
            "ours": median(lambda x=x, conv=conv: mx.eval(conv(x)), repeats),
        }
    backbone = build_model(load_config(ROOT / "configs" / "r50.yaml")).backbone[0]
    images, mask = mx.random.normal((1, 800, 1066, 3)), mx.zeros((1, 800, 1066), dtype=mx.bool_)
    result["resnet50"] = median(lambda: mx.eval([f for f, _ in backbone(images, mask)]), repeats)
    return result


def measure_torch(repeats):
    import torch
    import torch.nn.functional as F
    import transformers

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    result = {}
    with torch.no_grad():
        for c_in, c_out, k, s, h, w in SHAPES:
            x, weight = torch.randn(1, c_in, h, w), torch.randn(c_out, c_in, k, k)
            result[str((c_in, c_out, k, s, h, w))] = median(
                lambda x=x, weight=weight, s=s, k=k: F.conv2d(x, weight, stride=s, padding=k // 2), repeats
            )
        resnet = transformers.ResNetModel(transformers.ResNetConfig()).eval()
        images = torch.randn(1, 3, 800, 1066)
        result["resnet50"] = median(lambda: resnet(images), repeats)
    return result


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "conv_cpu.txt")
    parser.add_argument("--measure", choices=["mlx", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps((measure_mlx if args.measure == "mlx" else measure_torch)(args.repeats)))
        return
    from deformable_detr.runtime import malloc_environment

    sides = {}
    for side in ("mlx", "torch"):
        plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        env = plain if side == "mlx" else malloc_environment(plain)  # the same malloc (ours: as it imports the package)
        command = [sys.executable, __file__, "--measure", side, "--repeats", str(args.repeats)]
        sides[side] = measured(command, env, f"the {side} side")
    lines = [
        f"forward, seconds, median of {args.repeats} after a warm-up; ratio = PyTorch / ours (< 1: ours slower)",
        "",
        "MLX: mx.conv2d; ours: backbone.Conv2d (1 x 1 as a matrix product, k x k as patches times the weight)",
        "",
        "| convolution (in, out, kernel, stride, H, W) / model | PyTorch | MLX | ours | ratio (PyTorch / ours) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key, mine in sides["mlx"].items():
        theirs = sides["torch"][key]
        if key == "resnet50":
            name, plain, mine = "ResNet-50 at 800 x 1066 (this port's backbone / transformers')", "", mine
        else:
            name, plain, mine = key, f"{mine['mlx']:.4f}", mine["ours"]
        lines.append(f"| {name} | {theirs:.4f} | {plain} | {mine:.4f} | {theirs / mine:.2f} |")
    report(lines, args.output)


if __name__ == "__main__":
    main()
